#include "gpt/gathered.h"

#include <limits>
#include <stdexcept>

namespace gpt {

namespace {

// Writes `value` into the elements of `whole` (its global tensor) that `piece` covers.
void fill(torch::Tensor& whole, const commgrad::checkpoint::TensorPiece& piece, const torch::Tensor& value) {
  torch::Tensor box = whole;
  for (size_t d = 0; d < piece.box_offset.size(); ++d) {
    box = box.narrow(static_cast<int64_t>(d), piece.box_offset[d], piece.box_shape[d]);
  }
  auto flat = box.contiguous().view(-1);
  const int64_t end = piece.flat_end < 0 ? flat.numel() : piece.flat_end;
  flat.narrow(0, piece.flat_begin, end - piece.flat_begin).copy_(value);
  box.copy_(flat.view(box.sizes()));
}

}  // namespace

NamedTensors gather_pieces(const std::vector<commgrad::checkpoint::TensorPiece>& pieces,
                           const std::map<std::string, std::vector<int64_t>>& shapes, const commgrad::Group& group) {
  // Values (-inf where this rank holds nothing) and coverage (1 where it
  // holds the element), both maximised over the group in one all-reduce.
  const float nothing = -std::numeric_limits<float>::infinity();
  NamedTensors values, covered;
  std::vector<torch::Tensor> flat;
  for (const auto& [name, shape] : shapes) {
    values[name] = torch::full(shape, nothing);
    covered[name] = torch::zeros(shape);
    flat.push_back(values[name].view(-1));
    flat.push_back(covered[name].view(-1));
  }
  for (const auto& piece : pieces) {
    const auto it = values.find(piece.name);
    if (it == values.end()) continue;
    if (piece.global_shape != shapes.at(piece.name)) {
      throw std::invalid_argument("gather_pieces: '" + piece.name + "' is " +
                                  c10::str(at::IntArrayRef(piece.global_shape)) + " on this rank, expected " +
                                  c10::str(at::IntArrayRef(shapes.at(piece.name))));
    }
    fill(it->second, piece, piece.tensor.detach().reshape(-1).to(at::kFloat));
    fill(covered[piece.name], piece, torch::ones({1}));
  }
  auto all = torch::cat(flat);
  all =
      commgrad::ops::raw::all_reduce(all, commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax), group).wait();
  int64_t offset = 0;
  NamedTensors whole;
  for (const auto& [name, shape] : shapes) {
    const int64_t n = values[name].numel();
    whole[name] = all.narrow(0, offset, n).view(shape).clone();
    const auto missing = n - all.narrow(0, offset + n, n).sum().item<int64_t>();
    offset += 2 * n;
    if (missing > 0) {
      throw std::runtime_error("gather_pieces: no rank holds " + std::to_string(missing) + " of the " +
                               std::to_string(n) + " elements of '" + name + "'");
    }
  }
  return whole;
}

}  // namespace gpt
