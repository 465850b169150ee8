// The sequence layouts of context parallelism (sequence.h).
//
// Head-tail: a sequence of s tokens is cut into 2W chunks of c = s / (2W);
// rank r holds chunks r and 2W-1-r. Under a causal mask chunk i attends to
// i + 1 chunks' worth of keys, so rank r's two chunks attend to
// (r + 1) + (2W - r) = 2W + 1 chunks whatever r is: the work is balanced.
//
// shard_sequence cuts with narrow() (views) and cat(); unshard_sequence
// all-gathers the parts in rank order and puts the tokens back in order with
// one index_select through gathered_order().

#include "commgrad/cp/sequence.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

namespace commgrad::cp {

const char* layout_name(SequenceLayout layout) {
  return layout == SequenceLayout::kHeadTail ? "head-tail" : "contiguous";
}

namespace {

// Why a sequence of `sequence` tokens does not split over `size` ranks
// under `layout`; empty when it does.
std::string split_problem(int64_t sequence, SequenceLayout layout, int size) {
  const int64_t parts = layout == SequenceLayout::kHeadTail ? 2 * static_cast<int64_t>(size) : size;
  if (sequence >= 0 && sequence % parts == 0) return {};
  return "a sequence of " + std::to_string(sequence) + " tokens does not split into " + std::to_string(parts) +
         " equal chunks (the " + layout_name(layout) + " layout over a context-parallel group of " +
         std::to_string(size) +
         (layout == SequenceLayout::kHeadTail ? " needs a multiple of 2 x the group size)" : ")");
}

}  // namespace

std::vector<SequenceChunk> sequence_chunks(int64_t sequence, SequenceLayout layout, int rank, int size,
                                           const char* op) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[commgrad] ", op, ": rank ", rank, " of ", size);
  const std::string problem = split_problem(sequence, layout, size);
  TORCH_CHECK(problem.empty(), "[commgrad] ", op, " rank ", rank, "/", size, ": ", problem);
  const int64_t parts = layout == SequenceLayout::kHeadTail ? 2 * static_cast<int64_t>(size) : size;
  const int64_t c = sequence / parts;
  if (layout == SequenceLayout::kContiguous) return {{0, c, rank * c}};
  return {{0, c, rank * c}, {c, c, (parts - 1 - rank) * c}};
}

namespace {

int64_t wrap_dim(const char* op, const Group& group, const at::Tensor& x, int64_t dim) {
  COMMGRAD_CHECK(x.defined() && x.dim() >= 1, op, group, "expected a tensor with a sequence dim, got ",
                 x.defined() ? tensor_name(x) : std::string("an undefined tensor"));
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  COMMGRAD_CHECK(d >= 0 && d < x.dim(), op, group, "dim ", dim, " is out of range for ", tensor_name(x));
  return d;
}

// sequence_chunks with the group named in its error.
std::vector<SequenceChunk> chunks_of(const char* op, const Group& group, int64_t sequence, SequenceLayout layout,
                                     int rank) {
  const std::string problem = split_problem(sequence, layout, group.size());
  COMMGRAD_CHECK(problem.empty(), op, group, problem);
  return sequence_chunks(sequence, layout, rank, group.size(), op);
}

}  // namespace

at::Tensor local_positions(int64_t sequence, SequenceLayout layout, const Group& group) {
  check_member("cp::local_positions", group);
  std::vector<at::Tensor> parts;
  for (const auto& c : chunks_of("cp::local_positions", group, sequence, layout, group.rank())) {
    parts.push_back(at::arange(c.position, c.position + c.length, at::kLong));
  }
  return at::cat(parts);
}

at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, SequenceLayout layout, const Group& group) {
  const char* op = "cp::shard_sequence";
  check_member(op, group);
  const int64_t d = wrap_dim(op, group, x, dim);
  std::vector<at::Tensor> parts;
  for (const auto& c : chunks_of(op, group, x.size(d), layout, group.rank())) {
    parts.push_back(x.narrow(d, c.position, c.length));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, d);
}

at::Tensor gathered_order(int64_t sequence, SequenceLayout layout, int size) {
  std::vector<int64_t> index(sequence);
  const int64_t local = sequence / size;
  for (int r = 0; r < size; ++r) {
    for (const auto& c : sequence_chunks(sequence, layout, r, size, "cp::gathered_order")) {
      for (int64_t i = 0; i < c.length; ++i) index[c.position + i] = r * local + c.offset + i;
    }
  }
  return at::tensor(index, at::kLong);
}

at::Tensor unshard_sequence(const at::Tensor& local, int64_t dim, SequenceLayout layout, const Group& group) {
  const char* op = "cp::unshard_sequence";
  check_member(op, group);
  const int64_t d = wrap_dim(op, group, local, dim);
  const int64_t sequence = local.size(d) * group.size();
  chunks_of(op, group, sequence, layout, group.rank());  // the error, before any communication
  if (group.size() == 1) return local;
  const at::Tensor gathered = ops::all_gather(local, ops::AllGatherOptions().dim(d), group);
  if (layout == SequenceLayout::kContiguous) return gathered;
  return gathered.index_select(d, gathered_order(sequence, layout, group.size()));
}

}  // namespace commgrad::cp
