#include "gpt/gathered.h"

#include <limits>
#include <stdexcept>

namespace gpt {

namespace {

// Writes `piece`'s elements into `whole` (its global tensor).
void fill(torch::Tensor& whole, const commgrad::checkpoint::TensorPiece& piece) {
  torch::Tensor box = whole;
  for (size_t d = 0; d < piece.box_offset.size(); ++d) {
    box = box.narrow(static_cast<int64_t>(d), piece.box_offset[d], piece.box_shape[d]);
  }
  auto flat = box.contiguous().view(-1);
  const int64_t end = piece.flat_end < 0 ? flat.numel() : piece.flat_end;
  flat.narrow(0, piece.flat_begin, end - piece.flat_begin).copy_(piece.tensor.detach().reshape(-1).to(at::kFloat));
  box.copy_(flat.view(box.sizes()));
}

}  // namespace

NamedTensors gather_pieces(const std::vector<commgrad::checkpoint::TensorPiece>& pieces,
                           const std::map<std::string, std::vector<int64_t>>& shapes, const commgrad::Group& group) {
  const float nothing = -std::numeric_limits<float>::infinity();
  NamedTensors whole;
  std::vector<torch::Tensor> flat;
  for (const auto& [name, shape] : shapes) {
    whole[name] = torch::full(shape, nothing);
    flat.push_back(whole[name].view(-1));
  }
  for (const auto& piece : pieces) {
    const auto it = whole.find(piece.name);
    if (it == whole.end()) continue;
    if (piece.global_shape != shapes.at(piece.name)) {
      throw std::invalid_argument("gather_pieces: '" + piece.name + "' is " +
                                  c10::str(at::IntArrayRef(piece.global_shape)) + " on this rank, expected " +
                                  c10::str(at::IntArrayRef(shapes.at(piece.name))));
    }
    fill(it->second, piece);
  }
  auto all = torch::cat(flat);
  all =
      commgrad::ops::raw::all_reduce(all, commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax), group).wait();
  int64_t offset = 0;
  for (auto& [name, tensor] : whole) {
    tensor = all.narrow(0, offset, tensor.numel()).view(tensor.sizes()).clone();
    offset += tensor.numel();
    const auto missing = (tensor == nothing).sum().item<int64_t>();
    if (missing > 0) {
      throw std::runtime_error("gather_pieces: no rank holds " + std::to_string(missing) + " of the " +
                               std::to_string(tensor.numel()) + " elements of '" + name + "'");
    }
  }
  return whole;
}

}  // namespace gpt
