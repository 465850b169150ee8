// cp::attention: checks, then one of the three modes (attention.h).
//
// kAllGather: K and V stacked into one tensor and all-gathered along the
// sequence (one collective; its backward reduce-scatters dK, dV), put in
// position order, and each of this rank's query chunks attends to the keys
// up to its last position (causal) or to all of them, with ordinary autograd
// ops. Under the head-tail layout the two chunks of a rank then see
// (r + 1) + (2W - r) chunks of keys: balanced.
//
// kRing: ring.cpp.
//
// kUlysses: q, k, v concatenated along the batch and sent through one
// sequence_to_heads all-to-all, put in position order, attention over the
// whole sequence for H/W heads (in 2W query chunks, each over the keys up
// to its end, so a causal mask skips the blocks above the diagonal), back
// to rank order and through heads_to_sequence.

#include "commgrad/cp/attention.h"

#include "detail/blocks.h"
#include "detail/ring.h"

#include "commgrad/cp/ulysses.h"
#include "commgrad/dist/check.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace commgrad::cp {

const char* mode_name(AttentionMode mode) {
  switch (mode) {
    case AttentionMode::kAllGather:
      return "allgather";
    case AttentionMode::kRing:
      return "ring";
    case AttentionMode::kUlysses:
      return "ulysses";
  }
  return "?";
}

AttentionMode parse_mode(const std::string& name) {
  if (name == "allgather") return AttentionMode::kAllGather;
  if (name == "ring") return AttentionMode::kRing;
  if (name == "ulysses") return AttentionMode::kUlysses;
  TORCH_CHECK(false, "[commgrad] cp::parse_mode: unknown context-parallel mode '", name,
              "' (allgather, ring or ulysses)");
}

namespace {

constexpr const char* kOp = "cp::attention";

// softmax(q k^T scale, masked where `allowed` is false) v, with autograd.
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (allowed.defined()) scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), v);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ContextParallelOptions& o) {
  const Group& g = o.group();
  check_member(kOp, g);
  for (const at::Tensor* x : {&q, &k, &v}) {
    COMMGRAD_CHECK(x->defined() && x->dim() == 4 && x->is_floating_point(), kOp, g,
                   "expected floating-point q, k, v [batch, heads, tokens, head_dim], got ",
                   x->defined() ? tensor_name(*x) : std::string("an undefined tensor"));
  }
  COMMGRAD_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes() && q.scalar_type() == k.scalar_type() &&
                     q.scalar_type() == v.scalar_type(),
                 kOp, g, "q, k and v differ: ", tensor_name(q), ", ", tensor_name(k), ", ", tensor_name(v));
  const int64_t sequence = q.size(2) * g.size();
  const int64_t parts = o.layout() == SequenceLayout::kHeadTail ? 2 * g.size() : g.size();
  COMMGRAD_CHECK(o.layout() == SequenceLayout::kContiguous || q.size(2) % 2 == 0, kOp, g, "the sequence of ", sequence,
                 " tokens (", q.size(2), " on each of ", g.size(), " ranks) does not split into ", parts,
                 " equal chunks for the head-tail layout");
  COMMGRAD_CHECK(o.mode() != AttentionMode::kUlysses || q.size(1) % g.size() == 0, kOp, g, "ulysses: ", q.size(1),
                 " heads (", tensor_name(q), ") are not divisible by the context-parallel size ", g.size(),
                 "; use mode allgather or ring, or a head count divisible by ", g.size());
}

// The global position of each token of the all-gathered sequence (rank order).
at::Tensor gathered_positions(int64_t sequence, SequenceLayout layout, int size) {
  return at::argsort(gathered_order(sequence, layout, size));
}

// Attention of the queries of `chunks` (q holds them at their offsets) to
// keys k, v in position order: without a causal mask each chunk sees every
// key; with one, chunk c sees the keys [0, c.position + c.length) and only
// its diagonal block is masked, so the blocks above the diagonal are never
// computed.
at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<SequenceChunk>& chunks, bool causal) {
  std::vector<at::Tensor> outs;
  for (const auto& qc : chunks) {
    const at::Tensor qpart = q.narrow(2, qc.offset, qc.length);
    if (!causal) {
      outs.push_back(masked_attention(qpart, k, v, at::Tensor()));
      continue;
    }
    const int64_t end = qc.position + qc.length;
    const at::Tensor allowed = detail::causal_mask(qc, SequenceChunk{0, end, 0});
    outs.push_back(masked_attention(qpart, k.narrow(2, 0, end), v.narrow(2, 0, end), allowed));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}

at::Tensor allgather_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ContextParallelOptions& o) {
  const Group& g = o.group();
  const int64_t sequence = q.size(2) * g.size();
  at::Tensor kv = ops::all_gather(at::stack({k, v}), ops::AllGatherOptions().dim(3), g);  // [2, b, h, s, d]
  if (o.layout() != SequenceLayout::kContiguous)
    kv = kv.index_select(3, gathered_order(sequence, o.layout(), g.size()));
  return prefix_attention(q, kv[0], kv[1], sequence_chunks(sequence, o.layout(), g.rank(), g.size(), kOp), o.causal());
}

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextParallelOptions& o) {
  const Group& g = o.group();
  const int64_t b = q.size(0), local = q.size(2), sequence = local * g.size();
  at::Tensor heads = sequence_to_heads(at::cat({q, k, v}, 0), g);  // [3b, H/W, s, d], rank order
  const bool reorder = o.layout() != SequenceLayout::kContiguous;
  if (reorder) heads = heads.index_select(2, gathered_order(sequence, o.layout(), g.size()));
  // The whole sequence in chunks of s/(2W) tokens (s/W when odd), each
  // attending to the keys up to its end.
  const int64_t n = local % 2 == 0 ? 2 * g.size() : g.size();
  std::vector<SequenceChunk> chunks;
  for (int64_t i = 0; i < n; ++i) chunks.push_back({i * sequence / n, sequence / n, i * sequence / n});
  at::Tensor out =
      prefix_attention(heads.narrow(0, 0, b), heads.narrow(0, b, b), heads.narrow(0, 2 * b, b), chunks, o.causal());
  if (reorder) out = out.index_select(2, gathered_positions(sequence, o.layout(), g.size()));
  return heads_to_sequence(out, g);
}

}  // namespace

at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  // Under a causal mask in 4 query chunks (when the sequence splits so),
  // each over the keys up to its end: the blocks above the diagonal are not
  // computed, as on a rank of a context-parallel group of 2.
  const int64_t s = q.size(2), n = causal && s % 4 == 0 ? 4 : 1;
  std::vector<SequenceChunk> chunks;
  for (int64_t i = 0; i < n; ++i) chunks.push_back({i * s / n, s / n, i * s / n});
  return prefix_attention(q, k, v, chunks, causal);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const ContextParallelOptions& options) {
  check_inputs(q, k, v, options);
  if (options.group().size() == 1) return full_attention(q, k, v, options.causal());
  switch (options.mode()) {
    case AttentionMode::kAllGather:
      return allgather_attention(q, k, v, options);
    case AttentionMode::kRing:
      return detail::ring_attention(q, k, v, options);
    case AttentionMode::kUlysses:
      return ulysses_attention(q, k, v, options);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown AttentionMode");
}

}  // namespace commgrad::cp
