// Context-parallel attention (commgrad::cp) against full attention on one
// rank, as PyTorch's test_ring_attention_sdpa does: q, k, v = rand(2, 4,
// 64 W, 16), the same on every rank; W = 2, 3, 4; causal and not; head-tail
// layout on and off; the unsharded output and dq, dk, dv within 2e-6
// absolute / 1e-5 relative in float32 and 1e-12 in float64. The ring's
// transfers against their closed form (W-1 forward; W-1 K/V and W dK/dV
// backward). The head-tail layout's closed form, Ulysses' all-to-alls
// (DeepSpeed's test: values that encode (position, head)), and the errors.

#include "commgrad/cp/attention.h"
#include "commgrad/cp/sequence.h"
#include "commgrad/cp/ulysses.h"

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>

namespace commgrad::cp {
namespace {

using commgrad::testing::spawn_ranks;
using ::testing::HasSubstr;

using commgrad::testing::error_of;

// The reference, written apart from the library: einsum and an additive mask.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  at::Tensor scores = at::einsum("bhqd,bhkd->bhqk", {q, k}) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    const int64_t s = q.size(2);
    const at::Tensor above = at::arange(s).unsqueeze(0).gt(at::arange(s).unsqueeze(1));
    scores = scores + at::zeros({s, s}, q.options()).masked_fill(above, -std::numeric_limits<double>::infinity());
  }
  return at::einsum("bhqk,bhkd->bhqd", {at::softmax(scores, -1), v});
}

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& expected) {
  const bool f64 = expected.scalar_type() == at::kDouble;
  const double atol = f64 ? 1e-12 : 2e-6, rtol = f64 ? 1e-12 : 1e-5;
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  const at::Tensor diff = (got.to(at::kDouble) - expected.to(at::kDouble)).abs();
  EXPECT_TRUE(at::allclose(got, expected, rtol, atol))
      << what << ": max abs err " << diff.max().item<double>() << " (atol " << atol << ", rtol " << rtol << ")";
}

using Case = std::tuple<int, AttentionMode, bool>;  // W, mode, causal

class CpAttention : public ::testing::TestWithParam<Case> {};

// One comparison on every rank: cp::attention of this rank's part against
// the reference over the whole sequence, loss = sum(out * w).
void check_mode(const Group& g, AttentionMode mode, bool causal, SequenceLayout layout, at::ScalarType dtype) {
  SCOPED_TRACE(::testing::Message() << mode_name(mode) << (causal ? " causal " : " ") << layout_name(layout) << " "
                                    << dtype);
  const int64_t w = g.size(), heads = mode == AttentionMode::kUlysses && w == 3 ? 6 : 4;
  auto gen = at::detail::createCPUGenerator(1234);
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor q = at::rand({2, heads, 64 * w, 16}, gen, opts), k = at::rand({2, heads, 64 * w, 16}, gen, opts),
             v = at::rand({2, heads, 64 * w, 16}, gen, opts), weight = at::rand({2, heads, 64 * w, 16}, gen, opts);
  std::vector<at::Tensor> local;
  for (const auto& x : {q, k, v}) local.push_back(shard_sequence(x, 2, layout, g).clone().requires_grad_());
  auto counters = std::make_shared<RingCounters>();
  const auto options = ContextParallelOptions(g, mode).layout(layout).causal(causal).counters(counters);
  const at::Tensor out = attention(local[0], local[1], local[2], options);
  (out * shard_sequence(weight, 2, layout, g)).sum().backward();

  for (auto& x : {&q, &k, &v}) x->requires_grad_();
  const at::Tensor expected = reference_attention(q, k, v, causal);
  (expected * weight).sum().backward();
  at::NoGradGuard no_grad;
  expect_close("out", unshard_sequence(out, 2, layout, g), expected);
  expect_close("dq", unshard_sequence(local[0].grad(), 2, layout, g), q.grad());
  expect_close("dk", unshard_sequence(local[1].grad(), 2, layout, g), k.grad());
  expect_close("dv", unshard_sequence(local[2].grad(), 2, layout, g), v.grad());
  if (mode == AttentionMode::kRing) {
    EXPECT_EQ(counters->forward_kv, w - 1);
    EXPECT_EQ(counters->backward_kv, w - 1);
    EXPECT_EQ(counters->backward_dkv, w);
    const int64_t part = 2 * heads * 64 * 16;  // elements of one rank's K (or V)
    const int64_t acc = dtype == at::kDouble ? 8 : 4, bytes = c10::elementSize(dtype);
    EXPECT_EQ(counters->bytes_sent, (w - 1) * 2 * part * bytes * 2 + w * 2 * part * acc);
  }
}

TEST_P(CpAttention, MatchesFullAttentionOnOneRank) {
  const auto [w, mode, causal] = GetParam();
  spawn_ranks(w, [mode = mode, causal = causal](Group& g) {
    for (const auto layout : {SequenceLayout::kHeadTail, SequenceLayout::kContiguous}) {
      for (const auto dtype : {at::kFloat, at::kDouble}) check_mode(g, mode, causal, layout, dtype);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, CpAttention,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(AttentionMode::kAllGather, AttentionMode::kRing,
                                                              AttentionMode::kUlysses),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return c10::str("w", std::get<0>(info.param), "_", mode_name(std::get<1>(info.param)),
                                           std::get<2>(info.param) ? "_causal" : "_full");
                         });

TEST(CpSequence, HeadTailClosedForm) {
  spawn_ranks(2, [](Group& g) {
    const int r = g.rank();
    const at::Tensor expected =
        at::cat({at::arange(8 * r, 8 * r + 8, at::kLong), at::arange(8 * (3 - r), 8 * (3 - r) + 8, at::kLong)});
    EXPECT_TRUE(at::equal(local_positions(32, SequenceLayout::kHeadTail, g), expected));
    const at::Tensor x = at::arange(32, at::kLong).repeat({3, 1});  // [3, 32]: the value is the position
    const at::Tensor local = shard_sequence(x, 1, SequenceLayout::kHeadTail, g);
    EXPECT_TRUE(at::equal(local, expected.repeat({3, 1})));
    EXPECT_TRUE(at::equal(unshard_sequence(local, 1, SequenceLayout::kHeadTail, g), x));
    EXPECT_TRUE(at::equal(local_positions(32, SequenceLayout::kContiguous, g), at::arange(16 * r, 16 * r + 16)));
  });
}

// x[b, h, token, e] = 1000 b + 100 position + h (+ e / 10): where every value belongs.
at::Tensor encoded(int64_t b, int64_t heads, const at::Tensor& positions, int64_t d) {
  const at::Tensor bb = at::arange(b, at::kDouble).view({b, 1, 1, 1}) * 1000;
  const at::Tensor hh = at::arange(heads, at::kDouble).view({1, heads, 1, 1});
  const at::Tensor pp = positions.to(at::kDouble).view({1, 1, -1, 1}) * 100;
  const at::Tensor ee = at::arange(d, at::kDouble).view({1, 1, 1, d}) / 10;
  return (bb + hh + pp + ee).contiguous();
}

TEST(CpUlysses, SequenceToHeadsClosedFormRoundTripAndGradients) {
  for (const int w : {2, 4}) {
    spawn_ranks(w, [](Group& g) {
      const int64_t w = g.size(), r = g.rank(), heads = 2 * w, s = 4 * w;
      const at::Tensor mine = local_positions(s, SequenceLayout::kContiguous, g);
      const at::Tensor x = encoded(2, heads, mine, 3).requires_grad_();
      const at::Tensor y = sequence_to_heads(x, g);  // every position, heads [2r, 2r + 2)
      const at::Tensor expected = encoded(2, heads, at::arange(s), 3).narrow(1, 2 * r, 2);
      EXPECT_TRUE(at::equal(y, expected));
      EXPECT_TRUE(at::equal(heads_to_sequence(y, g), x));
      // The gradient of sum(y * c), c = 2 y + 1 held constant, is c: each
      // value's gradient must land where the value came from.
      (y * (2 * y.detach() + 1)).sum().backward();
      EXPECT_TRUE(at::equal(x.grad(), 2 * x.detach() + 1));
    });
  }
}

TEST(CpErrors, NameTheLayerTheGroupAndTheSizes) {
  spawn_ranks(2, [](Group& g) {
    const std::string where = g.describe() + ": ";
    EXPECT_THAT(error_of([&] {
                  shard_sequence(at::zeros({30, 2}), 0, SequenceLayout::kHeadTail, g);
                }),
                HasSubstr("[commgrad] cp::shard_sequence " + where +
                          "a sequence of 30 tokens does not split into 4 equal chunks"));
    const at::Tensor odd = at::zeros({1, 4, 3, 8});  // 3 tokens a rank: 6 do not split into 4 chunks
    EXPECT_THAT(error_of([&] { attention(odd, odd, odd, ContextParallelOptions(g)); }),
                HasSubstr("[commgrad] cp::attention " + where +
                          "the sequence of 6 tokens (3 on each of 2 ranks) "
                          "does not split into 4 equal chunks for the head-tail layout"));
    const at::Tensor three = at::zeros({1, 3, 4, 8});
    EXPECT_THAT(error_of([&] { attention(three, three, three, ContextParallelOptions(g, AttentionMode::kUlysses)); }),
                HasSubstr("[commgrad] cp::attention " + where +
                          "ulysses: 3 heads (float32[1, 3, 4, 8]) are not divisible by the context-parallel size 2"));
    EXPECT_THAT(error_of([&] { sequence_to_heads(three, g); }), HasSubstr("[commgrad] cp::sequence_to_heads " + where +
                                                                          "dim 1 of float32[1, 3, 4, 8] (heads) is not "
                                                                          "divisible by the context-parallel size 2"));
    EXPECT_THAT(error_of([] { parse_mode("p2p"); }), HasSubstr("unknown context-parallel mode 'p2p'"));
  });
}

}  // namespace
}  // namespace commgrad::cp
