// MoELayer at EP = 2 and 4 against the same layer on one rank (ColossalAI's
// test_mixtral_layer): 7 tokens per rank, 4 experts, hidden 8, top-2.
//
// The convention under test (moe_layer.h): the one-rank reference sees the
// union of every rank's tokens and its loss is the mean over all of them,
// L = (1/T_all) sum_t <y_t, g_t>. Rank r's loss is its part of that mean,
// L_r = (1/T_all) sum_{t on r} <y_t, g_t>, so L = sum_r L_r (Family 1), and the
// router's injected losses get the same factor (loss_scale = T_r / T_all).
// Then, with NO factor of any group size anywhere:
//   - router logits, outputs and input gradients equal the reference's rows;
//   - each expert's gradient on the rank that holds it equals the
//     reference's gradient of the expert with the same name;
//   - the router weight's gradients summed over the ranks equal the reference's;
//   - the aux loss (each rank's, normalised over its own tokens) averaged over
//     the ranks, weighted by their tokens, equals the reference's.
// float64 within 1e-12 and float32 within 1e-6 of the largest magnitude.
// And against a dense reference written with LibTorch alone (its own
// router, the capacity's drops written out) at EP 1, 2 and 4, both
// dispatchers, which also agree with each other.
// Under a zero-bubble schedule's deferral the experts' weight gradients wait
// for W and then equal a plain backward's.

#include "commgrad/dist/parallel_state.h"
#include "commgrad/moe/moe_layer.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/weight_gradients.h"

#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::moe {
namespace {

using commgrad::testing::spawn_ranks;

constexpr int64_t kTokens = 7, kHidden = 8, kFfn = 16, kExperts = 4, kTopK = 2;

double tolerance(at::ScalarType dtype) { return dtype == at::kDouble ? 1e-12 : 1e-6; }

// |got - expected| <= tol * max|expected| (exact when expected is all zero).
void expect_close(const at::Tensor& got, const at::Tensor& expected, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  if (got.numel() == 0) return;
  const double err = (got.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  const double scale = expected.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err << " against max magnitude " << scale;
}

at::Tensor randn(at::IntArrayRef sizes, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// What one case varies.
struct Case {
  // A constructor, not aggregate initialisation: GCC's
  // -Wmissing-field-initializers flags every {world, dtype} otherwise.
  Case(int world = 2, at::ScalarType dtype = at::kDouble) : world(world), dtype(dtype) {}
  int world;
  at::ScalarType dtype;
  int64_t top_k = kTopK;
  std::vector<int64_t> tokens;  // per rank; empty: kTokens each
  double capacity_factor = 0.0;
  DispatcherType dispatcher = DispatcherType::kAllToAll;
  double bias_rate = 0.0;
  ScoreFunction score = ScoreFunction::kSoftmax;
  // Makes the batch route a particular way (rows of the router weight, the inputs).
  std::function<void(MoELayer&, at::Tensor&)> shape;
  // Checks that the case routed as it means to: the rows each local expert received, by rank.
  std::function<void(const std::vector<int64_t>&, int rank)> verify;
  int64_t tokens_of(int r) const { return tokens.empty() ? kTokens : tokens[r]; }
};

MoELayer make_layer(const Case& c, const Group& group, double aux) {
  MoELayer layer(MoELayerOptions(kHidden, kFfn, kExperts, c.top_k, group)
                     .routing(RoutingOptions()
                                  .aux_loss_coeff(aux)
                                  .z_loss_coeff(aux > 0 ? 1e-3 : 0.0)
                                  .expert_bias_rate(c.bias_rate)
                                  .score_function(c.score)
                                  .normalize_top_k(c.score == ScoreFunction::kSigmoid))
                     .capacity_factor(c.capacity_factor)
                     .dispatcher(c.dispatcher)
                     .seed(17));
  layer->to(c.dtype);
  return layer;
}

// One rank's side of a case: the EP layer on its rows, the reference on all
// rows (on every rank: each compares its own part). With a capacity the
// reference runs on each rank's rows separately (the capacity is per rank)
// and without the aux loss (whose counts then would differ).
void run_case(const Case& c, Group& world) {
  const int rank = world.rank();
  int64_t total = 0, first = 0;
  for (int r = 0; r < c.world; ++r) {
    if (r < rank) first += c.tokens_of(r);
    total += c.tokens_of(r);
  }
  const double aux = c.capacity_factor > 0 ? 0.0 : 1e-2;
  MoELayer layer = make_layer(c, world, aux);
  MoELayer reference = make_layer(c, self_group(), aux);
  at::Tensor x_all = randn({total, kHidden}, 1, c.dtype);
  const at::Tensor g_all = randn({total, kHidden}, 2, c.dtype);
  if (c.shape) {
    c.shape(layer, x_all);
    c.shape(reference, x_all);
  }
  const int64_t mine = c.tokens_of(rank);
  const at::Tensor x = x_all.narrow(0, first, mine).clone().requires_grad_(true);
  layer->router->loss_scale = static_cast<double>(mine) / static_cast<double>(total);
  const at::Tensor y = layer(x);
  ((y * g_all.narrow(0, first, mine)).sum() / static_cast<double>(total)).backward();

  const at::Tensor x_ref = x_all.clone().requires_grad_(true);
  at::Tensor y_ref;
  std::vector<at::Tensor> logits_ref, experts_ref;  // this rank's rows' (with a capacity: by rank)
  if (c.capacity_factor > 0) {
    std::vector<at::Tensor> parts;
    int64_t begin = 0;
    for (int r = 0; r < c.world; ++r) {
      reference->router->loss_scale = static_cast<double>(c.tokens_of(r)) / static_cast<double>(total);
      parts.push_back(reference(x_ref.narrow(0, begin, c.tokens_of(r))));
      logits_ref.push_back(reference->last_routing().logits);
      experts_ref.push_back(reference->last_routing().experts);
      begin += c.tokens_of(r);
    }
    y_ref = at::cat(parts, 0);
  } else {
    y_ref = reference(x_ref);
    logits_ref.push_back(reference->last_routing().logits.narrow(0, first, mine));
    experts_ref.push_back(reference->last_routing().experts.narrow(0, first, mine));
  }
  ((y_ref * g_all).sum() / static_cast<double>(total)).backward();

  const double tol = tolerance(c.dtype);
  const size_t part = c.capacity_factor > 0 ? static_cast<size_t>(rank) : 0;
  expect_close(layer->last_routing().logits, logits_ref[part], tol, "router logits");
  EXPECT_TRUE(at::equal(layer->last_routing().experts, experts_ref[part]))
      << "the ranks chose other experts than the reference";
  if (c.verify) c.verify(layer->last_tokens_per_expert(), rank);
  expect_close(y, y_ref.narrow(0, first, mine), tol, "output");
  expect_close(x.grad(), x_ref.grad().narrow(0, first, mine), tol, "input gradient");
  if (aux > 0) {
    // The ranks' aux losses, each over its own tokens, weighted by their share of the batch.
    const double share = static_cast<double>(mine) / static_cast<double>(total);
    const at::Tensor mean_aux =
        ops::raw::all_reduce((layer->last_routing().aux_loss * share).reshape({1}), {}, world).wait();
    expect_close(mean_aux.reshape({}), reference->last_routing().aux_loss, tol, "aux loss");
  }
  const at::Tensor router_grad = ops::raw::all_reduce(layer->router->weight.grad(), {}, world).wait();
  expect_close(router_grad, reference->router->weight.grad(), tol, "router weight gradient (summed over ranks)");
  const auto ref_params = reference->experts->named_parameters();
  for (const auto& p : layer->experts->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key() << " got no gradient";
    expect_close(p.value().grad(), ref_params[p.key()].grad(), tol, "gradient of " + p.key());
    expect_close(p.value(), ref_params[p.key()], 0.0, "value of " + p.key());
  }
}

void run(const Case& c) {
  spawn_ranks(c.world, [&](Group& world) { run_case(c, world); });
}

// Router rows and a large first input feature that decide the routing:
// expert e's logit is about 10 * bias[e] for every token.
std::function<void(MoELayer&, at::Tensor&)> route_by(std::vector<double> bias) {
  return [bias](MoELayer& layer, at::Tensor& x) {
    torch::NoGradGuard no_grad;
    x.select(1, 0).fill_(10.0);
    for (size_t e = 0; e < bias.size(); ++e) layer->router->weight[e][0].fill_(bias[e]);
  };
}

TEST(MoELayerTest, EqualsOneRankAtEp2Float64) { run({2, at::kDouble}); }
TEST(MoELayerTest, EqualsOneRankAtEp4Float64) { run({4, at::kDouble}); }
TEST(MoELayerTest, EqualsOneRankAtEp2Float32) { run({2, at::kFloat}); }
TEST(MoELayerTest, EqualsOneRankAtEp4Float32) { run({4, at::kFloat}); }

// Rank 1 holds experts 2 and 3, which no token chooses: it sends its tokens
// and receives none (Megatron#1877).
TEST(MoELayerTest, RankThatReceivesNoTokens) {
  Case c{2, at::kDouble};
  c.shape = route_by({1.0, 1.0, -1.0, -1.0});
  c.verify = [](const std::vector<int64_t>& rows, int rank) {
    const std::vector<int64_t> expected = rank == 0 ? std::vector<int64_t>{14, 14} : std::vector<int64_t>{0, 0};
    EXPECT_EQ(rows, expected);
  };
  run(c);
}

// Rank 1 has no tokens of its own (T = 0) but holds experts the others use.
TEST(MoELayerTest, RankWithNoTokensOfItsOwn) {
  Case c{2, at::kDouble};
  c.tokens = {7, 0};
  run(c);
}

TEST(MoELayerTest, ExpertThatReceivesNoTokens) {
  Case c{4, at::kDouble};
  c.shape = route_by({0.0, 0.0, 0.0, -1.0});
  c.verify = [](const std::vector<int64_t>& rows, int rank) {
    if (rank == 3) {
      EXPECT_EQ(rows, std::vector<int64_t>{0});
    }
  };
  run(c);
}

TEST(MoELayerTest, AllTokensToOneExpert) {
  Case c{2, at::kDouble};
  c.top_k = 1;
  c.shape = route_by({1.0, -1.0, -1.0, -1.0});
  c.verify = [](const std::vector<int64_t>& rows, int rank) {
    const std::vector<int64_t> expected = rank == 0 ? std::vector<int64_t>{14, 0} : std::vector<int64_t>{0, 0};
    EXPECT_EQ(rows, expected);
  };
  run(c);
}

TEST(MoELayerTest, TopKEqualsExperts) {
  Case c{4, at::kDouble};
  c.top_k = kExperts;
  c.verify = [](const std::vector<int64_t>& rows, int) { EXPECT_EQ(rows, std::vector<int64_t>{28}); };
  run(c);
}

// Capacity 0.5: ceil(0.5 * 7 * 2 / 4) = 2 pairs per expert and rank, so
// tokens are dropped; the same ones at EP = 1 and 2 (the capacity is per rank).
TEST(MoELayerTest, CapacityDropsTheSameTokensAsOneRank) {
  Case c{2, at::kDouble};
  c.capacity_factor = 0.5;
  c.verify = [](const std::vector<int64_t>& rows, int) {
    EXPECT_LE(rows[0] + rows[1], 8) << "at most 2 pairs per expert from each of the 2 ranks";
  };
  run(c);
}

TEST(MoELayerTest, AllGatherDispatcherEqualsOneRank) {
  Case c{2, at::kDouble};
  c.dispatcher = DispatcherType::kAllGather;
  run(c);
}

// ~~~ Against a dense reference ~~~

// The MoE block written out with LibTorch alone (no commgrad code): its own
// softmax router, top-k, each expert run on the tokens that chose it and
// weighted by their probability, and, with a capacity, each expert keeping
// its `capacity` most probable pairs (ties: the earlier pair, t * k + j).
// Weights are copies of a one-rank MoELayer's (leaves with gradients).
struct DenseMoE {
  at::Tensor router;
  std::vector<std::array<at::Tensor, 4>> experts;  // fc1 weight, fc1 bias, fc2 weight, fc2 bias

  explicit DenseMoE(MoELayer& from) {
    auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    router = leaf(from->router->weight);
    const auto params = from->experts->named_parameters();
    for (int64_t e = 0; e < kExperts; ++e) {
      const std::string p = "expert" + std::to_string(e) + ".";
      experts.push_back({leaf(params[p + "fc1.weight"]), leaf(params[p + "fc1.bias"]), leaf(params[p + "fc2.weight"]),
                         leaf(params[p + "fc2.bias"])});
    }
  }

  // One rank's tokens x [T, h]; capacity 0: none.
  at::Tensor forward(const at::Tensor& x, int64_t k, int64_t capacity) const {
    const auto scores = at::softmax(at::linear(x, router), -1);
    const auto [top, chosen] = at::topk(scores, k, -1);
    auto out = at::zeros_like(x);
    for (int64_t e = 0; e < kExperts; ++e) {
      const auto flat = (chosen.reshape(-1) == e).nonzero().reshape(-1);  // pairs t * k + j, in order
      if (flat.numel() == 0) continue;
      auto keep = flat;
      if (capacity > 0 && flat.numel() > capacity) {
        const auto probs = top.reshape(-1).index_select(0, flat).detach();
        const auto order = std::get<1>(at::sort(probs, /*stable=*/true, /*dim=*/0, /*descending=*/true));
        keep = std::get<0>(at::sort(flat.index_select(0, order.narrow(0, 0, capacity))));
      }
      const auto rows = at::floor_divide(keep, k);
      const auto& w = experts[e];
      const auto y = at::linear(at::gelu(at::linear(x.index_select(0, rows), w[0], w[1])), w[2], w[3]);
      out = out.index_add(0, rows, y * top.reshape(-1).index_select(0, keep).unsqueeze(1));
    }
    return out;
  }
};

// MoELayer at EP 1, 2 and 4, with and without a capacity that drops, both
// dispatchers, float64: output, input gradient, the router's gradient
// summed over the ranks and each expert's gradient on the rank that holds
// it equal the dense reference's (1e-12); and the comparison sees a
// gradient off by a factor of 2. The two dispatchers give the same numbers.
TEST(MoELayerTest, EqualsADenseReferenceAtEp124WithAndWithoutCapacity) {
  for (int world : {1, 2, 4}) {
    for (double capacity_factor : {0.0, 0.5}) {
      spawn_ranks(world, [&](Group& group) {
        Case c{world, at::kDouble};
        c.capacity_factor = capacity_factor;
        const int rank = group.rank();
        const int64_t total = kTokens * world;
        const at::Tensor x_all = randn({total, kHidden}, 1, at::kDouble);
        const at::Tensor g_all = randn({total, kHidden}, 2, at::kDouble);
        MoELayer whole = make_layer(c, self_group(), 0.0);
        const DenseMoE dense(whole);
        // The reference: each rank's tokens apart (the capacity is per rank).
        const int64_t capacity = capacity_factor > 0 ? expert_capacity(capacity_factor, kTokens, kTopK, kExperts) : 0;
        const at::Tensor x_ref = x_all.clone().requires_grad_(true);
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r)
          parts.push_back(dense.forward(x_ref.narrow(0, r * kTokens, kTokens), kTopK, capacity));
        const at::Tensor y_ref = at::cat(parts);
        ((y_ref * g_all).sum() / static_cast<double>(total)).backward();

        std::vector<at::Tensor> outputs;  // by dispatcher: y, x.grad, router grad
        for (auto dispatcher : {DispatcherType::kAllToAll, DispatcherType::kAllGather}) {
          SCOPED_TRACE(::testing::Message()
                       << "EP " << world << ", capacity factor " << capacity_factor
                       << (dispatcher == DispatcherType::kAllGather ? ", all-gather" : ", all-to-all"));
          c.dispatcher = dispatcher;
          MoELayer layer = make_layer(c, group, 0.0);
          const at::Tensor x = x_all.narrow(0, rank * kTokens, kTokens).clone().requires_grad_(true);
          const at::Tensor y = layer(x);
          ((y * g_all.narrow(0, rank * kTokens, kTokens)).sum() / static_cast<double>(total)).backward();
          expect_close(y, y_ref.narrow(0, rank * kTokens, kTokens), 1e-12, "output");
          expect_close(x.grad(), x_ref.grad().narrow(0, rank * kTokens, kTokens), 1e-12, "input gradient");
          const at::Tensor router_grad = ops::raw::all_reduce(layer->router->weight.grad(), {}, group).wait();
          expect_close(router_grad, dense.router.grad(), 1e-12, "router gradient (summed over ranks)");
          EXPECT_GT((router_grad * 2 - dense.router.grad()).abs().max().item<double>(),
                    1e-12 * dense.router.grad().abs().max().item<double>())
              << "a router gradient off by 2 must not pass";
          for (const auto& p : layer->experts->named_parameters()) {
            const int64_t e = std::stoll(p.key().substr(6, p.key().find('.') - 6));
            const std::string which = p.key().substr(p.key().find('.') + 1);
            const int slot = which == "fc1.weight" ? 0 : which == "fc1.bias" ? 1 : which == "fc2.weight" ? 2 : 3;
            expect_close(p.value().grad(), dense.experts[e][slot].grad(), 1e-12, "gradient of " + p.key());
          }
          for (const auto& t : {y, x.grad(), router_grad}) outputs.push_back(t);
        }
        for (size_t i = 0; i < 3; ++i) expect_close(outputs[i + 3], outputs[i], 1e-12, "all-gather against all-to-all");
      });
    }
  }
}

// Aux-loss-free balancing: a bias that moves choices (not weights) routes
// the same at EP = 2 as on one rank.
TEST(MoELayerTest, ExpertBiasEqualsOneRankAtEp2) {
  Case c{2, at::kDouble};
  c.bias_rate = 0.01;
  c.shape = [](MoELayer& layer, at::Tensor&) {
    torch::NoGradGuard no_grad;
    layer->router->expert_bias.copy_(torch::tensor({0.2, 0.0, -0.1, 0.3}));
  };
  run(c);
}

TEST(MoELayerTest, ExpertBiasChoosesButTheScoresWeigh) {
  MoELayer layer(MoELayerOptions(kHidden, kFfn, kExperts, 1, self_group())
                     .routing(RoutingOptions().expert_bias_rate(0.1))
                     .seed(3));
  {
    torch::NoGradGuard no_grad;
    layer->router->expert_bias.copy_(torch::tensor({0.0, 0.0, 0.0, 5.0}));
  }
  const auto x = randn({kTokens, kHidden}, 5, at::kFloat);
  layer(x);
  const auto& r = layer->last_routing();
  EXPECT_TRUE(at::equal(r.experts, at::full({kTokens, 1}, 3, at::kLong)));
  EXPECT_TRUE(at::allclose(r.probs, at::softmax(r.logits, -1).narrow(1, 3, 1)));
  // Loads [0, 0, 0, 7]: the mean 1.75 is above experts 0-2 and below 3.
  layer->router->update_expert_bias();
  EXPECT_TRUE(at::allclose(layer->router->expert_bias, torch::tensor({0.1, 0.1, 0.1, 4.9})))
      << layer->router->expert_bias;
}

// DeepSeek-V3's sigmoid scores (normalised top-k) route and train the same at EP = 2.
TEST(MoELayerTest, SigmoidScoresEqualOneRankAtEp2) {
  Case c{2, at::kDouble};
  c.score = ScoreFunction::kSigmoid;
  run(c);
}

// Sigmoid scores: the combine weights are the chosen sigmoids (divided by
// their sum with normalize_top_k), and the balancing loss's P takes the
// scores normalised over the experts, so equal scores give aux = coeff.
TEST(MoELayerTest, SigmoidScoresWeighByTheirSigmoid) {
  for (const bool normalize : {false, true}) {
    TopKRouter router(
        TopKRouterOptions(kHidden, kExperts, kTopK)
            .routing(
                RoutingOptions().score_function(ScoreFunction::kSigmoid).normalize_top_k(normalize).aux_loss_coeff(0.1))
            .seed(3));
    const auto x = randn({kTokens, kHidden}, 5, at::kDouble);
    const auto r = router(x);
    auto expected = at::sigmoid(r.logits).gather(1, r.experts);
    if (normalize) expected = expected / expected.sum(-1, true);
    expect_close(r.probs, expected, 1e-15, normalize ? "normalised weights" : "weights");
    EXPECT_TRUE(at::equal(r.experts, std::get<1>(at::topk(r.logits, kTopK))));
  }
  TopKRouter flat(TopKRouterOptions(kHidden, kExperts, kTopK)
                      .routing(RoutingOptions().score_function(ScoreFunction::kSigmoid).aux_loss_coeff(0.1))
                      .seed(3));
  {
    torch::NoGradGuard no_grad;
    flat->weight.zero_();
  }
  EXPECT_NEAR(flat(randn({kTokens, kHidden}, 5, at::kFloat)).aux_loss.item<double>(), 0.1, 1e-7);
  std::ostringstream out;
  out << *flat;
  EXPECT_EQ(out.str(),
            "commgrad::moe::TopKRouter(hidden=8, experts=4, top_k=2, score_function=sigmoid, aux_loss_coeff=0.1)");
}

TEST(MoELayerTest, CapacityMaskKeepsTheMostProbablePairs) {
  // 4 tokens, top-1, all on expert 0 with probabilities 0.3 0.9 0.5 0.7; capacity 2.
  const auto experts = torch::zeros({4, 1}, torch::kLong);
  const auto probs = torch::tensor({0.3, 0.9, 0.5, 0.7}).view({4, 1});
  const auto by_prob = capacity_mask(experts, probs, 2, 2, DropPolicy::kProbability);
  EXPECT_TRUE(at::equal(by_prob.view(-1), torch::tensor({false, true, false, true})));
  const auto by_pos = capacity_mask(experts, probs, 2, 2, DropPolicy::kPosition);
  EXPECT_TRUE(at::equal(by_pos.view(-1), torch::tensor({true, true, false, false})));
  EXPECT_EQ(expert_capacity(0.5, 7, 2, 4), 2);
}

TEST(MoELayerTest, SwitchLossIsTheCoefficientUnderUniformRouting) {
  const auto scores = torch::full({8, 4}, 0.25, torch::kDouble);
  const auto counts = torch::full({4}, 4, torch::kLong);  // 8 tokens x top-2 over 4 experts
  EXPECT_NEAR(switch_load_balancing_loss(scores, counts, 8, 2, 0.01).item<double>(), 0.01, 1e-15);
}

TEST(MoELayerTest, AuxLossReachesTheRouterWithoutChangingTheOutput) {
  MoELayer plain(MoELayerOptions(kHidden, kFfn, kExperts, kTopK, self_group()).seed(3));
  MoELayer balanced(MoELayerOptions(kHidden, kFfn, kExperts, kTopK, self_group())
                        .routing(RoutingOptions().aux_loss_coeff(0.5))
                        .seed(3));
  const auto x = randn({kTokens, kHidden}, 5, at::kFloat);
  const auto y1 = plain(x), y2 = balanced(x);
  EXPECT_TRUE(at::equal(y1, y2));
  y1.sum().backward();
  y2.sum().backward();
  EXPECT_FALSE(at::allclose(plain->router->weight.grad(), balanced->router->weight.grad()));
  EXPECT_GT(balanced->last_routing().aux_loss.item<double>(), 0.0);
}

// The per-sequence balancing loss is linear in the sequences: the batch in
// two halves (each its mean, each half's losses scaled by 1/2, as two
// microbatches or two data-parallel ranks are) gives the whole batch's gradients.
TEST(MoELayerTest, PerSequenceAuxLossDoesNotDependOnHowSequencesAreGrouped) {
  auto make = [] {
    MoELayer layer(MoELayerOptions(kHidden, kFfn, kExperts, kTopK, self_group())
                       .routing(RoutingOptions().aux_loss_coeff(0.1).aux_loss_per_sequence(true))
                       .seed(3));
    layer->to(at::kDouble);
    return layer;
  };
  const auto x = randn({5, 4, kHidden}, 5, at::kDouble);  // [s, b, h]
  const auto g = randn({5, 4, kHidden}, 6, at::kDouble);
  MoELayer whole = make(), halves = make();
  ((whole(x) * g).sum() / 20.0).backward();
  set_aux_loss_scale(*halves, 0.5);
  for (int half = 0; half < 2; ++half) {
    const auto part = x.narrow(1, 2 * half, 2);
    ((halves(part) * g.narrow(1, 2 * half, 2)).sum() / 10.0 * 0.5).backward();
  }
  for (const auto& p : whole->named_parameters()) {
    expect_close(halves->named_parameters()[p.key()].grad(), p.value().grad(), 1e-12, p.key());
  }
}

// Under tp::DeferWeightGradients (a zero-bubble schedule's forward) the
// experts' weight gradients wait for W: after backward only the biases (and
// the router) have theirs; compute() brings the weights', equal to a plain
// backward's. At EP = 2.
TEST(MoELayerTest, ExpertWeightGradientsWaitForW) {
  spawn_ranks(2, [](Group& world) {
    const Case c;
    MoELayer deferred = make_layer(c, world, 1e-2), plain = make_layer(c, world, 1e-2);
    const at::Tensor x = randn({kTokens, kHidden}, 3 + world.rank(), at::kDouble);
    const at::Tensor g = randn({kTokens, kHidden}, 5 + world.rank(), at::kDouble);
    tp::WeightGradients weights;
    at::Tensor y;
    {
      tp::DeferWeightGradients defer(weights);
      y = deferred(x);
    }
    (y * g).sum().backward();
    (plain(x) * g).sum().backward();
    EXPECT_EQ(weights.size(), 4U);  // 2 local experts x fc1, fc2
    const auto params = plain->named_parameters();
    for (const auto& p : deferred->named_parameters()) {
      const bool waits = p.key().find("experts.") == 0 && p.key().find(".weight") != std::string::npos;
      EXPECT_EQ(p.value().grad().defined(), !waits) << p.key();
    }
    weights.compute();
    for (const auto& p : deferred->named_parameters()) {
      expect_close(p.value().grad(), params[p.key()].grad(), 1e-12, "gradient of " + p.key());
    }
  });
}

TEST(MoELayerTest, BadConfigurationsNameTheLayerAndTheSizes) {
  spawn_ranks(2, [](Group& world) {
    auto message = [&](const std::function<void()>& f) {
      try {
        f();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("no error");
    };
    const auto not_divisible = message([&] { MoELayer(MoELayerOptions(8, 16, 3, 2, world).seed(1)); });
    EXPECT_NE(not_divisible.find("moe::MoELayer"), std::string::npos) << not_divisible;
    EXPECT_NE(not_divisible.find("experts (3)"), std::string::npos) << not_divisible;
    EXPECT_NE(not_divisible.find("expert-parallel size 2"), std::string::npos) << not_divisible;
    const auto too_many = message([&] { MoELayer(MoELayerOptions(8, 16, 4, 5, world).seed(1)); });
    EXPECT_NE(too_many.find("top_k must be in [1, experts = 4], got 5"), std::string::npos) << too_many;
    const auto zero_k = message([&] { MoELayer(MoELayerOptions(8, 16, 4, 0, world).seed(1)); });
    EXPECT_NE(zero_k.find("top_k"), std::string::npos) << zero_k;
    MoELayer ok(MoELayerOptions(8, 16, 4, 2, world).seed(1));
    const auto bad_input = message([&] { ok(torch::zeros({3, 5})); });
    EXPECT_NE(bad_input.find("expected input [..., hidden=8]"), std::string::npos) << bad_input;
  });
}

TEST(MoELayerTest, PrettyPrint) {
  MoELayer layer(MoELayerOptions(8, 16, 4, 2, self_group()).capacity_factor(1.25).seed(1));
  std::ostringstream out;
  out << *layer;
  EXPECT_NE(out.str().find("commgrad::moe::MoELayer(hidden=8, ffn=16, experts=4, top_k=2, ep=1, capacity_factor=1.25, "
                           "drop_policy=probability)"),
            std::string::npos)
      << out.str();
}

}  // namespace
}  // namespace commgrad::moe
