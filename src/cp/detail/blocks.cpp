// Block attention with log-sum-exp (blocks.h).
//
// Forward of one block, scores S = q k^T * scale with the hidden entries at
// -inf:  m = rowmax S (0 for a row that sees nothing), P = exp(S - m),
// l = rowsum P, out = (P v) / l, lse = m + log l. Two blocks of the same
// queries merge as  lse = logaddexp(lse_a, lse_b),
// out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse), which is exact: the
// merged out is the softmax over both blocks' keys.
//
// Backward of one block given the final lse and delta = rowsum(dO * O):
// P = exp(S - lse) (the final probabilities), dV = P^T dO, dP = dO V^T,
// dS = P (dP - delta), dQ = dS K scale, dK = dS^T Q scale. Summed over the
// blocks they are the gradients of the whole softmax attention.

#include "blocks.h"

#include <ATen/ATen.h>

#include <limits>

namespace commgrad::cp::detail {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& allowed, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (allowed.defined()) s.masked_fill_(allowed.logical_not(), -kInf);
  return s;
}

}  // namespace

at::ScalarType accumulate_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

Visibility visibility(const SequenceChunk& q, const SequenceChunk& k, bool causal) {
  if (!causal) return Visibility::kAll;
  if (k.position + k.length - 1 <= q.position) return Visibility::kAll;
  if (k.position > q.position + q.length - 1) return Visibility::kNone;
  return Visibility::kMasked;
}

at::Tensor causal_mask(const SequenceChunk& q, const SequenceChunk& k) {
  const at::Tensor qp = at::arange(q.position, q.position + q.length, at::kLong).unsqueeze(1);
  const at::Tensor kp = at::arange(k.position, k.position + k.length, at::kLong).unsqueeze(0);
  return kp.le(qp);
}

BlockResult block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                          double scale) {
  const at::Tensor s = scores(q, k, allowed, scale);
  at::Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true));
  m.masked_fill_(m.eq(-kInf), 0.0);
  const at::Tensor p = (s - m).exp_();
  const at::Tensor l = p.sum(-1, /*keepdim=*/true);
  // A row that sees no key has l = 0 and P v = 0: out 0, lse -inf.
  const at::Tensor out = at::matmul(p, v).div_(l.clamp_min(std::numeric_limits<float>::min()));
  const at::Tensor lse = (m + l.log()).squeeze(-1);
  return {out, lse};
}

void merge(at::Tensor& out, at::Tensor& lse, const BlockResult& block) {
  if (!out.defined()) {
    out = block.out;
    lse = block.lse;
    return;
  }
  at::Tensor m = at::maximum(lse, block.lse);
  m.masked_fill_(m.eq(-kInf), 0.0);
  const at::Tensor wa = (lse - m).exp_(), wb = (block.lse - m).exp_();
  const at::Tensor total = wa + wb;
  const at::Tensor inv = total.clamp_min(std::numeric_limits<float>::min()).reciprocal();
  out = out * (wa * inv).unsqueeze(-1) + block.out * (wb * inv).unsqueeze(-1);
  lse = m + total.log();
}

BlockGrads block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                          const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& allowed, double scale) {
  const at::Tensor p = (scores(q, k, allowed, scale) - lse.unsqueeze(-1)).exp_();
  const at::Tensor dv = at::matmul(p.transpose(-2, -1), dout);
  const at::Tensor dp = at::matmul(dout, v.transpose(-2, -1));
  const at::Tensor ds = p.mul_(dp.sub_(delta.unsqueeze(-1)));
  const at::Tensor dq = at::matmul(ds, k).mul_(scale);
  const at::Tensor dk = at::matmul(ds.transpose(-2, -1), q).mul_(scale);
  return {dq, dk, dv};
}

}  // namespace commgrad::cp::detail
