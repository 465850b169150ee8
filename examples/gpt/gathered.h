#pragma once
// Whole tensors from the pieces the ranks hold (checkpoint::TensorPiece: a
// box of the whole tensor, or a flat range of one): what `gpt_train --check`
// hands its one-process reference and compares with it. Every rank fills
// the elements its pieces cover into whole float32 tensors that are -inf
// elsewhere, and a coverage tensor of ones there; one all-reduce (MAX) over
// the group makes each element the value of whichever rank holds it (ranks
// holding the same element hold the same value: replicas). An element no
// rank holds is an error that names the tensor.

#include "gpt/reference.h"

#include <commgrad/commgrad.h>

#include <map>
#include <string>
#include <vector>

namespace gpt {

/// The whole tensor of every name of `shapes` (float32), from the pieces of
/// every rank of `group` (pieces of other names are ignored). Collective
/// over `group`; every rank gets the same tensors.
NamedTensors gather_pieces(const std::vector<commgrad::checkpoint::TensorPiece>& pieces,
                           const std::map<std::string, std::vector<int64_t>>& shapes, const commgrad::Group& group);

}  // namespace gpt
