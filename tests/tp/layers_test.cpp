// Every tensor-parallel layer against its unsplit torch::nn reference, with
// the gradient checker, at TP 1, 2, 3 and 4, in float32 and float64.
//
// Sizes are odd multiples of the TP size (13 tp, 17 tp), so a shard taken
// from the wrong place, a transpose, or a concatenation in the wrong order
// changes numbers instead of cancelling out; inputs are non-contiguous
// (transposed) views. The checker compares the output, the loss, the input
// gradient, every parameter (so the seeded initialisation holds exactly the
// reference's shards) and every parameter gradient.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using check::Layout;
using ::testing::HasSubstr;

const std::vector<torch::ScalarType> kDtypes = {torch::kFloat32, torch::kFloat64};

// A non-contiguous [rows, cols] (the transpose of a seeded [cols, rows]).
torch::Tensor transposed_randn(int64_t rows, int64_t cols, uint64_t seed, torch::ScalarType dtype) {
  return seeded_randn({cols, rows}, seed, dtype).t();
}

// A non-contiguous [s, b, h] (dims 0 and 1 of a seeded [b, s, h] swapped).
torch::Tensor sequence_first_randn(int64_t s, int64_t b, int64_t h, uint64_t seed, torch::ScalarType dtype) {
  return seeded_randn({b, s, h}, seed, dtype).transpose(0, 1);
}

void expect_ok(const check::GradCheckResult& r, size_t rows) {
  EXPECT_TRUE(r.ok()) << r;
  EXPECT_EQ(r.tensors.size(), rows) << r;
}

class TpLayers : public ::testing::TestWithParam<int> {};

TEST_P(TpLayers, ColumnParallelLinear) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    for (auto dtype : kDtypes) {
      for (bool gather : {false, true}) {
        tp::ColumnParallelLinear par(tp::ColumnParallelLinearOptions(13 * n, 17 * n, g).gather_output(gather).seed(11));
        auto ref = reference_linear(13 * n, 17 * n, true, 11);
        par->to(dtype);
        ref->to(dtype);
        auto x = transposed_randn(5, 13 * n, 100, dtype);
        ASSERT_FALSE(x.is_contiguous());
        auto r = check::check_gradients(
            check::subject(par), check::subject(ref), {x},
            check::GradCheckOptions(g).output_layout(gather ? Layout::replicated() : Layout::partitioned(-1)));
        EXPECT_EQ(r.dtype, dtype);
        EXPECT_EQ(r.report("weight").layout, "split(0)");
        expect_ok(r, 7);  // output, loss, input.grad, weight, weight.grad, bias, bias.grad
      }
      // Without bias, and with the bias handed back to the caller.
      tp::ColumnParallelLinear nobias(tp::ColumnParallelLinearOptions(13 * n, 17 * n, g).bias(false).seed(12));
      auto nobias_ref = reference_linear(13 * n, 17 * n, false, 12);
      nobias->to(dtype);
      nobias_ref->to(dtype);
      auto x = transposed_randn(3, 13 * n, 101, dtype);
      expect_ok(check::check_gradients(check::subject(nobias), check::subject(nobias_ref), {x},
                                       check::GradCheckOptions(g).output_layout(Layout::partitioned(-1))),
                5);
      tp::ColumnParallelLinear skip(tp::ColumnParallelLinearOptions(13 * n, 17 * n, g).skip_bias_add(true).seed(13));
      skip->to(dtype);
      auto skip_ref = reference_linear(13 * n, 17 * n, true, 13);
      skip_ref->to(dtype);
      check::Subject skip_subject{skip.ptr(), [skip](const std::vector<at::Tensor>& in) mutable {
                                    auto out = skip->forward_with_bias(in[0]);
                                    EXPECT_TRUE(out.bias.defined());
                                    return out.output + out.bias;
                                  }};
      expect_ok(check::check_gradients(skip_subject, check::subject(skip_ref), {x},
                                       check::GradCheckOptions(g).output_layout(Layout::partitioned(-1))),
                7);
    }
  });
}

TEST_P(TpLayers, ColumnParallelLinearSequenceParallel) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    for (auto dtype : kDtypes) {
      tp::ColumnParallelLinear par(tp::ColumnParallelLinearOptions(13 * n, 17 * n, g).sequence_parallel(true).seed(21));
      auto ref = reference_linear(13 * n, 17 * n, true, 21);
      par->to(dtype);
      ref->to(dtype);
      auto x = sequence_first_randn(3 * n, 2, 13 * n, 200, dtype);  // [s, b, h], split along s
      auto r = check::check_gradients(
          check::subject(par), check::subject(ref), {x},
          check::GradCheckOptions(g).input_layouts({Layout::partitioned(0)}).output_layout(Layout::partitioned(-1)));
      expect_ok(r, 7);
    }
  });
}

TEST_P(TpLayers, RowParallelLinear) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    for (auto dtype : kDtypes) {
      for (bool parallel_input : {false, true}) {
        tp::RowParallelLinear par(
            tp::RowParallelLinearOptions(17 * n, 13 * n, g).input_is_parallel(parallel_input).seed(31));
        auto ref = reference_linear(17 * n, 13 * n, true, 31);
        par->to(dtype);
        ref->to(dtype);
        auto x = transposed_randn(5, 17 * n, 300, dtype);
        auto r = check::check_gradients(check::subject(par), check::subject(ref), {x},
                                        check::GradCheckOptions(g).input_layouts(
                                            {parallel_input ? Layout::partitioned(-1) : Layout::replicated()}));
        EXPECT_EQ(r.report("weight").layout, "split(1)");
        EXPECT_EQ(r.report("bias").layout, "replicated");
        expect_ok(r, 7);
      }
    }
  });
}

TEST_P(TpLayers, RowParallelLinearSequenceParallel) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    for (auto dtype : kDtypes) {
      tp::RowParallelLinear par(
          tp::RowParallelLinearOptions(17 * n, 13 * n, g).input_is_parallel(true).sequence_parallel(true).seed(41));
      auto ref = reference_linear(17 * n, 13 * n, true, 41);
      par->to(dtype);
      ref->to(dtype);
      auto x = sequence_first_randn(3 * n, 2, 17 * n, 400, dtype);
      auto options =
          check::GradCheckOptions(g).input_layouts({Layout::partitioned(-1)}).output_layout(Layout::partitioned(0));
      auto r = check::check_gradients(check::subject(par), check::subject(ref), {x}, options);
      EXPECT_EQ(r.report("bias").layout, "replicated, partial grad");
      expect_ok(r, 7);
      // Without the sequence-parallel gradient all-reduce each rank holds
      // only its chunk's share of the bias gradient.
      if (n > 1) {
        auto unsynced = check::check_gradients(check::subject(par), check::subject(ref), {x},
                                               options.sync_sequence_parallel_grads(false));
        EXPECT_EQ(unsynced.failures(), std::vector<std::string>{"bias.grad"}) << unsynced;
      }
    }
  });
}

TEST_P(TpLayers, ParallelMLP) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    for (auto dtype : kDtypes) {
      for (bool sp : {false, true}) {
        for (bool bias : {true, false}) {
          tp::ParallelMLP par(tp::ParallelMLPOptions(13 * n, 17 * n, g).bias(bias).sequence_parallel(sp).seed(51));
          ReferenceMLP ref(13 * n, 17 * n, bias, 51);
          par->to(dtype);
          ref->to(dtype);
          auto x = sequence_first_randn(3 * n, 2, 13 * n, 500, dtype);
          const Layout layout = sp ? Layout::partitioned(0) : Layout::replicated();
          auto r = check::check_gradients(check::subject(par), check::subject(ref), {x},
                                          check::GradCheckOptions(g).input_layouts({layout}).output_layout(layout));
          expect_ok(r, bias ? 11 : 7);
        }
      }
    }
  });
}

TEST_P(TpLayers, ParallelMLPFromOneFactory) {
  // The factory form: the same class at TP = n and, as the reference, at TP = 1.
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    auto x = transposed_randn(6, 13 * n, 600, torch::kFloat64);
    auto r = check::check_gradients(
        [n](const Group& group) {
          tp::ParallelMLP mlp(tp::ParallelMLPOptions(13 * n, 17 * n, group).seed(61));
          mlp->to(torch::kFloat64);
          return check::subject(mlp);
        },
        {x}, check::GradCheckOptions(g));
    expect_ok(r, 11);
    EXPECT_EQ(r.tp_size, n);
  });
}

TEST_P(TpLayers, VocabParallelEmbedding) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int64_t vocab = 17 * n;
    for (auto dtype : kDtypes) {
      for (bool sp : {false, true}) {
        tp::VocabParallelEmbedding par(tp::VocabParallelEmbeddingOptions(vocab, 13, g).sequence_parallel(sp).seed(71));
        auto ref = reference_embedding(vocab, 13, 71);
        par->to(dtype);
        ref->to(dtype);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(700);
        auto ids = at::randint(0, vocab, {2 * n, 3}, gen, torch::kLong);
        // The edges of every rank's range.
        ids[0][0] = 0;
        ids[0][1] = vocab - 1;
        ids[0][2] = std::min(vocab / n, vocab - 1);
        ids[1][0] = vocab / n - 1;
        auto r = check::check_gradients(
            check::subject(par), check::subject(ref), {ids},
            check::GradCheckOptions(g).output_layout(sp ? Layout::partitioned(0) : Layout::replicated()));
        expect_ok(r, 4);  // output, loss, weight, weight.grad
      }
    }
  });
}

struct CrossEntropyCase {
  int64_t ignore_index;
  double smoothing;
  tp::Reduction reduction;
};

TEST_P(TpLayers, VocabParallelCrossEntropy) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int64_t vocab = 17 * n;
    const std::vector<CrossEntropyCase> cases = {
        {-100, 0.0, tp::Reduction::kMean},
        {3, 0.1, tp::Reduction::kMean},  // ignore_index inside the vocabulary
        {-100, 0.2, tp::Reduction::kNone},
        {5, 0.0, tp::Reduction::kSum},
    };
    for (auto dtype : kDtypes) {
      for (const auto& c : cases) {
        auto logits = transposed_randn(7, vocab, 800, dtype) * 3;
        auto target = torch::tensor({0L, vocab - 1, c.ignore_index < 0 ? 2L : c.ignore_index,
                                     std::min(vocab / n, vocab - 2), 4L, 1L, c.ignore_index < 0 ? c.ignore_index : 6L});
        check::Subject par{nullptr, [g, c](const std::vector<at::Tensor>& in) {
                             return tp::vocab_parallel_cross_entropy(in[0], in[1],
                                                                     tp::CrossEntropyOptions()
                                                                         .group(g)
                                                                         .ignore_index(c.ignore_index)
                                                                         .label_smoothing(c.smoothing)
                                                                         .reduction(c.reduction));
                           }};
        const int64_t reduction = c.reduction == tp::Reduction::kNone   ? at::Reduction::None
                                  : c.reduction == tp::Reduction::kMean ? at::Reduction::Mean
                                                                        : at::Reduction::Sum;
        check::Subject ref{nullptr, [c, reduction](const std::vector<at::Tensor>& in) {
                             return at::cross_entropy_loss(in[0], in[1], {}, reduction, c.ignore_index, c.smoothing);
                           }};
        auto r = check::check_gradients(par, ref, {logits, target},
                                        check::GradCheckOptions(g).input_layouts({Layout::partitioned(-1), Layout()}));
        expect_ok(r, 3);  // output, loss, input[0].grad
        EXPECT_EQ(r.report("input[0].grad").layout, "split(-1)");
      }
    }
  });
}

TEST_P(TpLayers, CrossEntropyLeavesTheLogitsAlone) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    auto logits = seeded_randn({4, 5}, 900).requires_grad_(true);
    const auto before = logits.detach().clone();
    const auto version = logits._version();
    auto target = torch::tensor({0L, 5L * n - 1, 2L, 3L});
    auto loss =
        tp::vocab_parallel_cross_entropy(logits, target, tp::CrossEntropyOptions().group(g).label_smoothing(0.1));
    loss.backward();
    EXPECT_TRUE(torch::equal(logits.detach(), before));
    EXPECT_EQ(logits._version(), version);
    // Large logits stay finite (the maximum is subtracted first).
    auto big = (seeded_randn({4, 5}, 901) * 1e4).requires_grad_(true);
    auto big_loss = tp::vocab_parallel_cross_entropy(big, target, tp::CrossEntropyOptions().group(g));
    big_loss.backward();
    EXPECT_TRUE(std::isfinite(big_loss.item<double>()));
    EXPECT_TRUE(big.grad().isfinite().all().item<bool>());
  });
}

INSTANTIATE_TEST_SUITE_P(TpSizes, TpLayers, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return c10::str("tp", info.param); });

// ~~~ errors ~~~

TEST(TpLayerErrors, IndivisibleSizesAndWrongShapes) {
  spawn_ranks(4, [](Group& g) {
    const int r = g.rank();
    const std::string where = c10::str("rank ", r, "/4 group 'world' (gloo): ");
    EXPECT_THAT(error_of([&] { tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(13, 10, g)); }),
                HasSubstr("[commgrad] ColumnParallelLinear " + where +
                          "out_features (10) is not divisible by the tensor-parallel size (4)"));
    EXPECT_THAT(error_of([&] { tp::RowParallelLinear(tp::RowParallelLinearOptions(10, 13, g)); }),
                HasSubstr("[commgrad] RowParallelLinear " + where +
                          "in_features (10) is not divisible by the tensor-parallel size (4)"));
    EXPECT_THAT(error_of([&] { tp::ParallelMLP(tp::ParallelMLPOptions(8, 10, g)); }),
                HasSubstr("out_features (10) is not divisible by the tensor-parallel size (4)"));
    EXPECT_THAT(error_of([&] { tp::VocabParallelEmbedding(tp::VocabParallelEmbeddingOptions(10, 3, g)); }),
                HasSubstr("num_embeddings (10) is not divisible by the tensor-parallel size (4); pad the vocabulary"));
    EXPECT_THAT(error_of([&] {
                  tp::ColumnParallelLinear(
                      tp::ColumnParallelLinearOptions(4, 8, g).sequence_parallel(true).gather_output(true));
                }),
                HasSubstr("sequence_parallel and gather_output cannot both be set"));
    EXPECT_THAT(error_of([&] { tp::RowParallelLinear(tp::RowParallelLinearOptions(8, 4, g).sequence_parallel(true)); }),
                HasSubstr("sequence_parallel needs input_is_parallel"));

    tp::ColumnParallelLinear column(tp::ColumnParallelLinearOptions(13, 8, g));
    EXPECT_THAT(error_of([&] {
                  column(torch::ones({5, 12}));
                }),
                HasSubstr("ColumnParallelLinear " + where +
                          "expected an input of shape [..., 13] (in_features), got float32[5, 12]"));
    EXPECT_THAT(error_of([&] {
                  column(torch::ones({5, 13}, torch::kDouble));
                }),
                HasSubstr("does not have the dtype of the weight float32[2, 13]"));
    tp::RowParallelLinear row(tp::RowParallelLinearOptions(8, 3, g).input_is_parallel(true));
    EXPECT_THAT(error_of([&] {
                  row(torch::ones({5, 8}));
                }),
                HasSubstr("expected an input of shape [..., 2] (in_features / tp: input_is_parallel), got "
                          "float32[5, 8]; the input holds all in_features: pass input_is_parallel(false)"));
    tp::RowParallelLinear row_full(tp::RowParallelLinearOptions(8, 3, g));
    EXPECT_THAT(error_of([&] {
                  row_full(torch::ones({5, 2}));
                }),
                HasSubstr("expected an input of shape [..., 8] (in_features), got float32[5, 2]; the input holds "
                          "this rank's part of in_features (a ColumnParallelLinear's output with "
                          "gather_output(false)?): pass input_is_parallel(true)"));
    tp::RowParallelLinear row_sp(tp::RowParallelLinearOptions(8, 3, g).input_is_parallel(true).sequence_parallel(true));
    EXPECT_THAT(error_of([&] {
                  row_sp(torch::ones({6, 1, 2}));
                }),
                HasSubstr("the sequence length (dim 0 of float32[6, 1, 2]) must be divisible by the tensor-parallel "
                          "size 4"));
    tp::VocabParallelEmbedding emb(tp::VocabParallelEmbeddingOptions(8, 3, g));
    EXPECT_THAT(error_of([&] {
                  emb(torch::tensor({1L, 8L}));
                }),
                HasSubstr("ids must be in [0, 8), got values in [1, 8]"));
    EXPECT_THAT(error_of([&] { emb(torch::ones({2})); }), HasSubstr("ids must be an integer tensor"));
    EXPECT_THAT(error_of([&] {
                  tp::vocab_parallel_cross_entropy(torch::zeros({2, 3}), torch::tensor({1L, 12L}),
                                                   tp::CrossEntropyOptions().group(g));
                }),
                HasSubstr("target 12 is outside the vocabulary [0, 12) (3 logits per rank x tp 4) and is not "
                          "ignore_index (-100)"));
    EXPECT_THAT(error_of([&] {
                  tp::vocab_parallel_cross_entropy(torch::zeros({2, 3}), torch::tensor({1L, 2L, 3L}),
                                                   tp::CrossEntropyOptions().group(g));
                }),
                HasSubstr("must have the shape of logits float32[2, 3] without its last (vocabulary) dim"));
    // Every error above was raised on every rank alike, before any communication but the seed
    // broadcast of the unseeded ParallelMLP (which every rank made): the group still works.
    auto y = tp::ParallelMLP(tp::ParallelMLPOptions(4, 8, g).seed(1))(torch::ones({2, 4}));
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 4}));
  });
}

TEST(TpLayerErrors, CheckerRejectsMismatchedParameters) {
  spawn_ranks(2, [](Group& g) {
    tp::ColumnParallelLinear par(tp::ColumnParallelLinearOptions(4, 6, g).seed(0));
    auto wrong_shape = reference_linear(4, 8, true, 0);
    auto x = torch::ones({2, 4});
    EXPECT_THAT(error_of([&] { check::check_gradients(check::subject(par), check::subject(wrong_shape), {x}, g); }),
                HasSubstr("parallel parameter 'weight' [3, 4] (split(0)) is [6, 4] in full, but reference 'weight' "
                          "is [8, 4]"));
    EXPECT_THAT(error_of([&] {
                  check::check_gradients(check::subject(par), check::subject(reference_linear(4, 6, true, 0)), {x},
                                         check::GradCheckOptions(g).reference_names({{"weight", "w"}}));
                }),
                HasSubstr("parallel parameter 'weight' has no reference parameter 'w'"));
    EXPECT_THAT(error_of([&] {
                  check::check_gradients(check::subject(par), check::subject(reference_linear(4, 6, true, 0)), {x},
                                         check::GradCheckOptions(g).input_layouts({Layout(), Layout()}));
                }),
                HasSubstr("2 input layouts for 1 inputs"));
    EXPECT_THAT(
        error_of([&] {
          check::check_gradients(check::subject(par), check::subject(reference_linear(4, 6, true, 0)),
                                 {torch::ones({3, 4})},
                                 check::GradCheckOptions(g).input_layouts({Layout::partitioned(0)}));
        }),
        HasSubstr("check_gradients rank " + std::to_string(g.rank()) +
                  "/2 group 'world' (gloo): input 0 [3, 4]: dim 0 is not divisible by the tensor-parallel size 2"));
  });
}

TEST(TpLayerErrors, CheckerFindsAWrongLayer) {
  // A reference with different weights: the checker reports every mismatch
  // and its table says so.
  spawn_ranks(2, [](Group& g) {
    tp::RowParallelLinear par(tp::RowParallelLinearOptions(6, 5, g).seed(1));
    auto other = reference_linear(6, 5, true, 2);
    auto r = check::check_gradients(check::subject(par), check::subject(other), {seeded_randn({3, 6}, 3)},
                                    check::GradCheckOptions(g).title("wrong seed"));
    EXPECT_FALSE(r.ok());
    EXPECT_THAT(r.failures(), ::testing::Contains("weight"));
    EXPECT_THAT(r.failures(), ::testing::Contains("output"));
    EXPECT_THAT(r.table(), HasSubstr("commgrad::check wrong seed tp=2 float32"));
    EXPECT_THAT(r.table(), HasSubstr("MISMATCH"));
    EXPECT_THAT(r.table(), HasSubstr("tensors MISMATCH: output loss input.grad weight"));
  });
}

// ~~~ printing, initialisation, state dicts ~~~

TEST(TpLayerModules, PrettyPrint) {
  spawn_ranks(4, [](Group& g) {
    auto str = [](const torch::nn::Module& m) {
      std::ostringstream s;
      m.pretty_print(s);
      return s.str();
    };
    EXPECT_EQ(str(*tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(16, 32, g).gather_output(true))),
              "commgrad::tp::ColumnParallelLinear(in=16, out=32, tp=4, gather_output=true)");
    EXPECT_EQ(str(*tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(16, 32, g).bias(false))),
              "commgrad::tp::ColumnParallelLinear(in=16, out=32, tp=4, gather_output=false, bias=false)");
    EXPECT_EQ(str(*tp::RowParallelLinear(tp::RowParallelLinearOptions(32, 16, g).input_is_parallel(true))),
              "commgrad::tp::RowParallelLinear(in=32, out=16, tp=4, input_is_parallel=true)");
    EXPECT_EQ(str(*tp::ParallelMLP(tp::ParallelMLPOptions(16, 32, g).sequence_parallel(true))),
              "commgrad::tp::ParallelMLP(hidden=16, ffn=32, tp=4, sequence_parallel=true)");
    EXPECT_EQ(str(*tp::VocabParallelEmbedding(tp::VocabParallelEmbeddingOptions(64, 8, g))),
              "commgrad::tp::VocabParallelEmbedding(num_embeddings=64, embedding_dim=8, tp=4)");
  });
}

TEST(TpLayerModules, CloneKeepsShardsAndSpecs) {
  spawn_ranks(2, [](Group& g) {
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(6, 8, g).seed(5));
    auto copy = std::dynamic_pointer_cast<tp::ParallelMLPImpl>(mlp->clone());
    ASSERT_TRUE(copy);
    EXPECT_TRUE(torch::equal(copy->fc1->weight, mlp->fc1->weight));
    EXPECT_NE(copy->fc1->weight.data_ptr(), mlp->fc1->weight.data_ptr());
    auto specs = tp::shard_specs(*copy);
    EXPECT_EQ(specs["fc1.weight"].spec.describe(), "split(0)");
    EXPECT_EQ(specs["fc2.weight"].spec.describe(), "split(1)");
    EXPECT_EQ(specs["fc2.bias"].spec.describe(), "replicated");
  });
}

TEST(TpLayerModules, FullStateDictIsTheSameAtEveryTpSize) {
  for (int n : {1, 2, 4}) {
    spawn_ranks(n, [n](Group& g) {
      tp::ParallelMLP mlp(tp::ParallelMLPOptions(5, 4 * n, g).seed(8));
      auto full = tp::gather_full_state_dict(*mlp);
      ReferenceMLP ref(5, 4 * n, true, 8);
      auto ref_state = ref->named_parameters();
      ASSERT_EQ(full.size(), ref_state.size());
      for (const auto& item : ref_state) EXPECT_TRUE(torch::equal(full[item.key()], item.value())) << item.key();
      // Load it into a layer built from another seed: the shards come back.
      tp::ParallelMLP other(tp::ParallelMLPOptions(5, 4 * n, g).seed(9));
      EXPECT_FALSE(torch::equal(other->fc1->weight, mlp->fc1->weight));
      tp::load_full_state_dict(*other, full);
      for (const auto& p : mlp->named_parameters()) {
        EXPECT_TRUE(torch::equal(other->named_parameters()[p.key()], p.value())) << p.key();
      }
      // A wrong full shape is refused.
      auto bad = full;
      bad["fc1.weight"] = torch::zeros({4 * n + 1, 5});
      EXPECT_THAT(error_of([&] { tp::load_full_state_dict(*other, bad); }),
                  HasSubstr(c10::str("[commgrad] load_full_state_dict rank ", g.rank(), "/", n,
                                     " group 'world' (gloo): 'fc1.weight' is float32[")));
      auto missing = full;
      missing.erase("fc2.bias");
      EXPECT_THAT(error_of([&] { tp::load_full_state_dict(*other, missing); }),
                  HasSubstr(c10::str("[commgrad] load_full_state_dict rank ", g.rank(), "/", n,
                                     " group 'world' (gloo): the state dict has no entry 'fc2.bias'")));
      // Without a group (shard_tensor takes a rank and a size) the error names the op only.
      EXPECT_THAT(error_of([&] { tp::shard_tensor(torch::zeros({4}), tp::ShardSpec::partitioned(1), 0, 2); }),
                  HasSubstr("[commgrad] shard_tensor: partition dim 1 is out of range for float32[4]"));
      EXPECT_THAT(error_of([&] { tp::gather_shards(torch::zeros({4}), tp::ShardSpec::partitioned(1), g); }),
                  HasSubstr(c10::str("[commgrad] gather_shards rank ", g.rank(), "/", n,
                                     " group 'world' (gloo): partition dim 1 is out of range for float32[4]")));
    });
  }
}

TEST(TpLayerModules, StridedShards) {
  // A fused QKV weight [3h, h] split by heads: rank r holds [Q_r; K_r; V_r].
  for (int n : {1, 2, 3, 4}) {
    const int64_t h = 2 * n;
    auto full = torch::arange(3 * h * 2, torch::kFloat).view({3 * h, 2});
    const auto spec = tp::ShardSpec::partitioned(0, 3);
    std::vector<torch::Tensor> shards;
    for (int r = 0; r < n; ++r) {
      auto mine = tp::shard_tensor(full, spec, r, n);
      auto expected =
          torch::cat({full.narrow(0, 2 * r, 2), full.narrow(0, h + 2 * r, 2), full.narrow(0, 2 * h + 2 * r, 2)});
      EXPECT_TRUE(torch::equal(mine, expected)) << "n=" << n << " r=" << r;
      shards.push_back(mine);
    }
    EXPECT_TRUE(torch::equal(tp::unshard_tensors(shards, spec), full));
  }
  spawn_ranks(2, [](Group& g) {
    tp::ColumnParallelLinear qkv(tp::ColumnParallelLinearOptions(4, 12, g).stride(3).seed(4));
    auto full = tp::gather_full_state_dict(*qkv);
    EXPECT_TRUE(torch::equal(full["weight"], tp::init_linear(4, 12, true, 4).weight));
    EXPECT_TRUE(torch::equal(full["bias"], tp::init_linear(4, 12, true, 4).bias));
  });
}

}  // namespace
}  // namespace commgrad::testing
