// Ring attention: K and V travel around the context-parallel group.
//
// Rank r of W holds q, k, v of its own tokens. At step t = 0 .. W-1 it holds
// the K/V part of rank (r - t) mod W; it attends its queries to it and, for
// t < W-1, passes it on to rank r+1 while receiving the next from rank r-1.
// The transfer of step t+1's part is posted before step t's blocks compute,
// so it runs behind them. The queries' partial outputs are merged by their
// log-sum-exp in float32 (float64 for float64 inputs; blocks.h), so the
// result is the softmax over every key, whatever order the parts came in.
//
// The causal mask is applied per pair of chunks (sequence.h): a pair whose
// keys all follow its queries is skipped, one whose keys all precede them
// is computed without a mask, the pairs on the diagonal with one. Under the
// head-tail layout every step t > 0 then computes exactly half a block on
// every rank (PyTorch's and Megatron's load balancing).
//
// Backward (FlashAttention's, per block, from the saved output and
// log-sum-exp): K/V travel the ring again in the same order (W-1
// transfers), and behind them an accumulator of dK/dV for the part each
// rank holds: at step t rank r adds its queries' share to the accumulator of
// part (r - t), then sends it to rank r+1, which adds its own share at step
// t+1. After the last step (W transfers in all) each accumulator has
// visited every rank and arrived home. The incoming accumulator is waited
// for only after the step's blocks computed, so it overlaps too.
//
// Costs per rank, with P = b h (s/W) d elements of one part: forward
// (W-1) 2P sent; backward (W-1) 2P + W 2P (the accumulators travel in the
// compute dtype, float32 at least).

#include "detail/ring.h"

#include "detail/blocks.h"

#include "commgrad/ops/raw.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

namespace commgrad::cp::detail {

namespace {

constexpr int kKvTag = 0x43500;   // K/V parts
constexpr int kDkvTag = 0x43501;  // dK/dV accumulators

// One step of the ring: x goes to rank r+1, rank r-1's comes in.
class Shift {
 public:
  Shift(const at::Tensor& x, int tag, const Group& g, RingCounters* counters) : keep_(x.contiguous()) {
    const int w = g.size(), r = g.rank();
    send_ = ops::raw::send(keep_, ops::SendOptions((r + 1) % w).tag(tag), g);
    recv_ = ops::raw::recv(keep_.sizes(), ops::RecvOptions((r + w - 1) % w).tag(tag).dtype(keep_.scalar_type()), g);
    if (counters != nullptr) counters->bytes_sent += keep_.numel() * static_cast<int64_t>(keep_.element_size());
  }
  at::Tensor wait() {
    at::Tensor y = recv_.wait();
    send_.wait();
    return y;
  }

 private:
  at::Tensor keep_;
  ops::raw::Pending send_, recv_;
};

// What forward leaves for backward besides the tensors.
struct RingState : torch::CustomClassHolder {
  ContextParallelOptions options;
  std::vector<std::vector<SequenceChunk>> chunks;  // by rank
  double scale = 1.0;
};

// Calls fn(i, qc, kc, mask) for every pair of (this rank's query chunk i,
// key chunk of rank `src`) that the causal mask does not hide completely.
template <typename Fn>
void for_each_pair(const RingState& s, int rank, int src, Fn&& fn) {
  for (size_t i = 0; i < s.chunks[rank].size(); ++i) {
    const SequenceChunk& qc = s.chunks[rank][i];
    for (const auto& kc : s.chunks[src]) {
      const Visibility vis = visibility(qc, kc, s.options.causal());
      if (vis == Visibility::kNone) continue;
      fn(i, qc, kc, vis == Visibility::kMasked ? causal_mask(qc, kc) : at::Tensor());
    }
  }
}

at::Tensor seq(const at::Tensor& x, const SequenceChunk& c) { return x.narrow(2, c.offset, c.length); }

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::intrusive_ptr<RingState> state) {
    const Group& g = state->options.group();
    const int w = g.size(), r = g.rank();
    const auto acc = accumulate_dtype(q.scalar_type());
    const at::Tensor qa = q.to(acc);
    std::vector<at::Tensor> outs(state->chunks[r].size()), lses(outs.size());
    at::Tensor kv = at::stack({k, v});
    for (int t = 0; t < w; ++t) {
      const int src = (r - t + w) % w;
      std::optional<Shift> next;
      if (t + 1 < w) next.emplace(kv, kKvTag, g, state->options.counters().get());
      const at::Tensor kva = kv.to(acc);
      for_each_pair(
          *state, r, src, [&](size_t i, const SequenceChunk& qc, const SequenceChunk& kc, const at::Tensor& mask) {
            merge(outs[i], lses[i], block_forward(seq(qa, qc), seq(kva[0], kc), seq(kva[1], kc), mask, state->scale));
          });
      if (next) {
        kv = next->wait();
        if (state->options.counters()) ++state->options.counters()->forward_kv;
      }
    }
    const at::Tensor out = at::cat(outs, 2), lse = at::cat(lses, 2);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

torch::autograd::variable_list RingAttention::backward(torch::autograd::AutogradContext* ctx,
                                                       torch::autograd::variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const auto state = c10::static_intrusive_pointer_cast<RingState>(ctx->saved_data["state"].toCapsule());
  const Group& g = state->options.group();
  RingCounters* counters = state->options.counters().get();
  const int w = g.size(), r = g.rank();
  const at::Tensor &q = saved[0], &out = saved[3], &lse = saved[4];
  const auto acc = out.scalar_type();
  const at::Tensor qa = q.to(acc), dout = grads[0].to(acc);
  const at::Tensor delta = (dout * out).sum(-1);
  at::Tensor dq = at::zeros_like(qa);
  at::Tensor kv = at::stack({saved[1], saved[2]});
  at::Tensor dkv;
  std::optional<Shift> incoming;
  for (int t = 0; t < w; ++t) {
    const int src = (r - t + w) % w;
    std::optional<Shift> next;
    if (t + 1 < w) next.emplace(kv, kKvTag, g, counters);
    const at::Tensor kva = kv.to(acc);
    at::Tensor part = at::zeros_like(kva);
    for_each_pair(*state, r, src,
                  [&](size_t, const SequenceChunk& qc, const SequenceChunk& kc, const at::Tensor& mask) {
                    const auto b = block_backward(seq(qa, qc), seq(kva[0], kc), seq(kva[1], kc), seq(dout, qc),
                                                  lse.narrow(2, qc.offset, qc.length),
                                                  delta.narrow(2, qc.offset, qc.length), mask, state->scale);
                    seq(dq, qc).add_(b.dq);
                    seq(part[0], kc).add_(b.dk);
                    seq(part[1], kc).add_(b.dv);
                  });
    // The accumulator of part src: what came from rank r-1, plus this rank's share.
    dkv = incoming ? incoming->wait().add_(part) : part;
    if (w > 1) {
      incoming.emplace(dkv, kDkvTag, g, counters);
      if (counters != nullptr) ++counters->backward_dkv;
    }
    if (next) {
      kv = next->wait();
      if (counters != nullptr) ++counters->backward_kv;
    }
  }
  if (incoming) dkv = incoming->wait();  // this rank's own, home after visiting every rank
  const auto dtype = q.scalar_type();
  return {dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), at::Tensor()};
}

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const ContextParallelOptions& options) {
  auto state = c10::make_intrusive<RingState>();
  state->options = options;
  const Group& g = options.group();
  const int64_t sequence = q.size(2) * g.size();
  for (int rank = 0; rank < g.size(); ++rank) {
    state->chunks.push_back(sequence_chunks(sequence, options.layout(), rank, g.size(), "cp::attention"));
  }
  state->scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  return RingAttention::apply(q, k, v, state);
}

}  // namespace commgrad::cp::detail
