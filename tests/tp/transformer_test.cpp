// Tests of ParallelSelfAttention and ParallelTransformerLayer against their
// unsplit single-rank references (built from the same seed): outputs, input
// gradients and every parameter gradient, at TP 1, 2, 3, 4, float32 and
// float64, contiguous and non-contiguous inputs, sequence parallelism on and
// off, with odd per-rank sizes (3 heads of size 5, 13 tokens, 17 MLP
// features per rank) so that layout mistakes show.

#include "harness/expect_error.h"
#include "commgrad/check/gradient_check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/reference.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/transformer_layer.h"

#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::tp {
namespace {

using commgrad::testing::expect_error;
using commgrad::testing::spawn_ranks;

// Per-rank sizes: heads 3 (of size 5), sequence 13, MLP 17, batch 2.
constexpr int64_t kHeadsPerRank = 3, kHeadDim = 5, kSeqPerRank = 13, kFfnPerRank = 17, kBatch = 2;

struct Tolerance {
  double atol, rtol;
};

// float64: only summation order differs; float32: a few ulps of O(1) values
// accumulated over <= 60-wide dot products and a softmax.
Tolerance tolerance_for(at::ScalarType dtype) {
  return dtype == at::kDouble ? Tolerance{1e-10, 1e-9} : Tolerance{3e-5, 3e-4};
}

std::string max_errors(const at::Tensor& got, const at::Tensor& expected) {
  const auto diff = (got.to(at::kDouble) - expected.to(at::kDouble)).abs();
  const double max_abs = diff.max().item<double>();
  const double max_rel = (diff / expected.to(at::kDouble).abs().clamp_min(1e-30)).max().item<double>();
  std::ostringstream out;
  out << "max abs err " << max_abs << ", max rel err " << max_rel;
  return out.str();
}

bool close(const at::Tensor& got, const at::Tensor& expected, Tolerance tol) {
  return got.sizes() == expected.sizes() && at::allclose(got, expected, tol.rtol, tol.atol);
}

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& expected, Tolerance tol) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(close(got, expected, tol)) << what << ": " << max_errors(got, expected) << " (atol " << tol.atol
                                         << ", rtol " << tol.rtol << ")";
}

at::Tensor random_tensor(at::IntArrayRef sizes, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// Replaces every LayerNorm parameter with random values, so that their
// gradients (and the model's use of them) are not hidden by ones and zeros.
void randomize_layernorms(torch::nn::Module& module, uint64_t seed) {
  torch::NoGradGuard no_grad;
  uint64_t k = 0;
  for (auto& p : module.named_parameters()) {
    if (p.key().rfind("ln", 0) != 0) continue;
    const auto noise = random_tensor(p.value().sizes(), seed + k++, p.value().scalar_type());
    p.value().copy_(p.key().find("weight") != std::string::npos ? 1 + 0.3 * noise : 0.3 * noise);
  }
}

// A parallel module and its reference, with a shared forward signature.
struct ModulePair {
  std::shared_ptr<torch::nn::Module> parallel, reference;
  std::function<at::Tensor(const at::Tensor&)> parallel_forward, reference_forward;
};

enum class Kind { kAttention, kTransformer };

ModulePair make_pair(Kind kind, const Group& tp, bool sequence_parallel, uint64_t seed) {
  const int64_t n = tp.size();
  const int64_t heads = kHeadsPerRank * n, hidden = heads * kHeadDim;
  ModulePair pair;
  if (kind == Kind::kAttention) {
    auto options = ParallelSelfAttentionOptions(hidden, heads, tp).sequence_parallel(sequence_parallel).seed(seed);
    ParallelSelfAttention par(options);
    SelfAttentionReference ref(options);
    pair = {par.ptr(), ref.ptr(), [par](const at::Tensor& x) mutable { return par(x); },
            [ref](const at::Tensor& x) mutable { return ref(x); }};
  } else {
    auto options = ParallelTransformerLayerOptions(hidden, heads, kFfnPerRank * n, tp)
                       .sequence_parallel(sequence_parallel)
                       .seed(seed);
    ParallelTransformerLayer par(options);
    TransformerLayerReference ref(options);
    pair = {par.ptr(), ref.ptr(), [par](const at::Tensor& x) mutable { return par(x); },
            [ref](const at::Tensor& x) mutable { return ref(x); }};
  }
  return pair;
}

// Runs one comparison on every rank of `tp`: the parallel module on its part
// of the input, the reference on the whole input, loss = sum(output * w).
void check_against_reference(Kind kind, const Group& tp, bool sp, at::ScalarType dtype, bool noncontiguous) {
  SCOPED_TRACE(::testing::Message() << "tp " << tp.size() << (sp ? " sp" : "") << " " << dtype
                                    << (noncontiguous ? " non-contiguous" : ""));
  const int64_t n = tp.size(), r = tp.rank();
  const Tolerance tol = tolerance_for(dtype);
  ModulePair pair = make_pair(kind, tp, sp, /*seed=*/11);
  pair.parallel->to(dtype);
  pair.reference->to(dtype);

  // A layer built from seed s holds exactly its shard of the reference built from s.
  const auto full = gather_full_state_dict(*pair.parallel);
  const auto ref_params = pair.reference->named_parameters();
  ASSERT_EQ(full.size(), ref_params.size());
  for (const auto& p : ref_params) {
    ASSERT_TRUE(full.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(full[p.key()], p.value())) << "initial " << p.key();
  }
  randomize_layernorms(*pair.reference, 5);
  load_full_state_dict(*pair.parallel, pair.reference->named_parameters());

  const int64_t seq = kSeqPerRank * n, hidden = kHeadsPerRank * n * kHeadDim;
  const at::Tensor x_full = random_tensor({seq, kBatch, hidden}, 100, dtype);
  const at::Tensor w_full = random_tensor({seq, kBatch, hidden}, 101, dtype);

  // Reference.
  const at::Tensor xr = x_full.clone().requires_grad_();
  const at::Tensor yr = pair.reference_forward(xr);
  (yr * w_full).sum().backward();

  // Parallel: the whole input, or this rank's chunk of the sequence under SP.
  const int64_t local_seq = sp ? seq / n : seq;
  const at::Tensor x_local = sp ? x_full.narrow(0, r * local_seq, local_seq) : x_full;
  const at::Tensor w_local = sp ? w_full.narrow(0, r * local_seq, local_seq) : w_full;
  // Non-contiguous: the leaf is [b, s, h] and the layer sees its transpose.
  const at::Tensor leaf = (noncontiguous ? x_local.transpose(0, 1).contiguous() : x_local.clone()).requires_grad_();
  const at::Tensor x = noncontiguous ? leaf.transpose(0, 1) : leaf;
  ASSERT_EQ(x.is_contiguous(), !noncontiguous);
  const at::Tensor y = pair.parallel_forward(x);
  ASSERT_EQ(y.sizes(), x.sizes());
  (y * w_local).sum().backward();

  const ShardSpec seq_split = ShardSpec::partitioned(0);
  const at::Tensor y_full = sp ? gather_shards(y.detach(), seq_split, tp) : y.detach();
  expect_close("output", y_full, yr.detach(), tol);
  const at::Tensor dx = noncontiguous ? leaf.grad().transpose(0, 1) : leaf.grad();
  expect_close("input grad", sp ? gather_shards(dx.contiguous(), seq_split, tp) : dx, xr.grad(), tol);

  const auto specs = shard_specs(*pair.parallel);
  if (sp && n > 1) {
    // Before the all-reduce, every sequence-parallel gradient is this rank's
    // part only: wrong, and the parts sum to the right value.
    int partial = 0;
    for (const auto& p : pair.parallel->named_parameters()) {
      if (!specs[p.key()].spec.partial_grad) continue;
      ++partial;
      const at::Tensor expected = pair.reference->named_parameters()[p.key()].grad();
      EXPECT_FALSE(close(p.value().grad(), expected, tol)) << p.key() << " is already complete before the all-reduce";
      const at::Tensor summed = ops::raw::all_reduce(p.value().grad(), {}, tp).wait();
      expect_close("sum of partial " + p.key(), summed, expected, tol);
    }
    // ln1/ln2 weight and bias, attention.dense.bias (attention: only the latter).
    EXPECT_EQ(partial, kind == Kind::kTransformer ? 6 : 1);
  }
  allreduce_sequence_parallel_grads(*pair.parallel);
  for (const auto& p : pair.parallel->named_parameters()) {
    const ParameterShard& s = specs[p.key()];
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    const at::Tensor grad =
        s.spec.is_partitioned() ? gather_shards(p.value().grad(), s.spec, s.group) : p.value().grad();
    expect_close("grad " + p.key() + " (" + s.spec.describe() + ")", grad,
                 pair.reference->named_parameters()[p.key()].grad(), tol);
  }
}

// ~~~ agreement with the unsplit reference ~~~

struct Params {
  Kind kind;
  int tp;
  bool sp;
};

void PrintTo(const Params& p, std::ostream* out) {
  *out << (p.kind == Kind::kAttention ? "attention" : "transformer") << " tp=" << p.tp << " sp=" << p.sp;
}

std::string param_name(const ::testing::TestParamInfo<Params>& info) {
  return std::string(info.param.kind == Kind::kAttention ? "Attention" : "Transformer") + "Tp" +
         std::to_string(info.param.tp) + (info.param.sp ? "SequenceParallel" : "");
}

class TpTransformerReference : public ::testing::TestWithParam<Params> {};

TEST_P(TpTransformerReference, MatchesUnsplitReference) {
  const Params p = GetParam();
  spawn_ranks(p.tp, [&](Group& world) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      for (bool noncontiguous : {false, true}) check_against_reference(p.kind, world, p.sp, dtype, noncontiguous);
    }
  });
}

std::vector<Params> all_params() {
  std::vector<Params> out;
  for (Kind kind : {Kind::kAttention, Kind::kTransformer}) {
    for (int tp : {1, 2, 3, 4}) {
      for (bool sp : {false, true}) out.push_back({kind, tp, sp});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, TpTransformerReference, ::testing::ValuesIn(all_params()), param_name);

// Two tensor-parallel groups of two inside a world of four (Megatron's rank
// order), the layer taking its group from the installed parallel state.
TEST(TpTransformer, UsesTheParallelStateGroup) {
  spawn_ranks(4, [](Group& world) {
    ScopedParallelState scope(make_model_parallel(2, 1, world));
    const Group tp = tensor_parallel_group();
    ASSERT_EQ(tp.size(), 2);
    EXPECT_EQ(tp.ranks(), (std::vector<int>{world.rank() / 2 * 2, world.rank() / 2 * 2 + 1}));
    ParallelTransformerLayer layer(ParallelTransformerLayerOptions(30, 6, 34));
    EXPECT_EQ(layer->options.group(), tp);
    check_against_reference(Kind::kTransformer, tp, /*sp=*/true, at::kDouble, false);
  });
  // The same through initialize_model_parallel() on each rank's (per-thread) world.
  spawn_ranks(4, [](Group& world) {
    const ParallelState state = initialize_model_parallel(2);
    ParallelSelfAttention attention(ParallelSelfAttentionOptions(30, 6));
    EXPECT_EQ(attention->options.group(), state.tensor_parallel_group());
    EXPECT_EQ(attention->num_local_heads(), 3);
    destroy_model_parallel();
    EXPECT_FALSE(model_parallel_is_initialized());
    (void)world;
  });
}

// The same agreement through the public gradient checker (commgrad::check):
// a per-tensor table of output, input gradient, parameters and parameter
// gradients. Under sequence parallelism, skipping the all-reduce of the
// partial gradients is exactly what the checker must catch.
void run_gradient_checker(int n) {
  {
    spawn_ranks(n, [&](Group& tp) {
      for (Kind kind : {Kind::kAttention, Kind::kTransformer}) {
        for (bool sp : {false, true}) {
          for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
            SCOPED_TRACE(::testing::Message() << (kind == Kind::kAttention ? "attention" : "transformer") << " tp " << n
                                              << (sp ? " sp " : " ") << dtype);
            ModulePair pair = make_pair(kind, tp, sp, /*seed=*/23);
            pair.parallel->to(dtype);
            pair.reference->to(dtype);
            randomize_layernorms(*pair.reference, 8);
            load_full_state_dict(*pair.parallel, pair.reference->named_parameters());
            const int64_t hidden = kHeadsPerRank * n * kHeadDim;
            // Non-contiguous [s, b, h]: the transpose of a [b, s, h] tensor.
            const at::Tensor x = random_tensor({kBatch, kSeqPerRank * n, hidden}, 31, dtype).transpose(0, 1);
            auto options = check::GradCheckOptions(tp).title(kind == Kind::kAttention ? "ParallelSelfAttention"
                                                                                      : "ParallelTransformerLayer");
            if (sp) options.input_layouts({check::Layout::partitioned(0)}).output_layout(check::Layout::partitioned(0));
            const check::Subject par{
                pair.parallel, [&](const std::vector<at::Tensor>& in) { return pair.parallel_forward(in.at(0)); }};
            const check::Subject ref{
                pair.reference, [&](const std::vector<at::Tensor>& in) { return pair.reference_forward(in.at(0)); }};
            const auto result = check::check_gradients(par, ref, {x}, options);
            EXPECT_TRUE(result.ok()) << result;
            if (tp.rank() == 0 && n == 2 && kind == Kind::kTransformer && sp && dtype == at::kFloat) {
              std::cout << result;
            }
            if (sp) {
              // Forgetting allreduce_sequence_parallel_grads(): the replicated
              // LayerNorm and row-bias gradients are partial.
              pair.parallel->zero_grad();
              pair.reference->zero_grad();
              const auto unsynced = check::check_gradients(par, ref, {x}, options.sync_sequence_parallel_grads(false));
              std::vector<std::string> expected = {"dense.bias.grad"};
              if (kind == Kind::kTransformer) {
                expected = {"ln1.weight.grad", "ln1.bias.grad", "attention.dense.bias.grad",
                            "ln2.weight.grad", "ln2.bias.grad", "mlp.fc2.bias.grad"};
              }
              auto failures = unsynced.failures();
              std::sort(failures.begin(), failures.end());
              std::sort(expected.begin(), expected.end());
              EXPECT_EQ(failures, expected) << unsynced;
            }
          }
        }
      }
    });
  }
}

TEST(TpTransformer, GradientCheckerTp2) { run_gradient_checker(2); }
TEST(TpTransformer, GradientCheckerTp4) { run_gradient_checker(4); }

// ~~~ dropout and the RNG streams ~~~

// With dropout, TP ranks must still agree on every replicated activation (the
// output of a layer without sequence parallelism: hidden dropout from the
// replicated stream, attention dropout from the per-rank stream inside the
// heads), and a run is reproducible from the seed, with or without sequence
// parallelism. (That the per-rank stream differs between ranks is TpRandom's.)
TEST(TpTransformer, DropoutFollowsTheRngStreams) {
  constexpr int n = 2;
  auto run = [](bool sp, uint64_t seed) {
    std::vector<at::Tensor> outputs(n);
    spawn_ranks(n, [&](Group& tp) {
      ScopedRngTracker scoped{RngTracker()};
      model_parallel_manual_seed(seed, tp);
      ParallelTransformerLayer layer(ParallelTransformerLayerOptions(30, 6, 34, tp)
                                         .hidden_dropout(0.3)
                                         .attention_dropout(0.3)
                                         .sequence_parallel(sp)
                                         .seed(1));
      const at::Tensor x = random_tensor({26, 2, 30}, 7, at::kFloat);
      const at::Tensor input = sp ? x.narrow(0, tp.rank() * 13, 13) : x;
      outputs[tp.rank()] = layer(input).detach();
    });
    return outputs;
  };
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "replicated");
    const auto a = run(sp, 42), b = run(sp, 42), c = run(sp, 43);
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(torch::equal(a[r], b[r])) << "not reproducible on rank " << r;
      EXPECT_FALSE(torch::equal(a[r], c[r])) << "the seed does not matter on rank " << r;
    }
    if (!sp) {
      EXPECT_TRUE(torch::equal(a[0], a[1])) << "replicated outputs differ across TP ranks";
    }
  }
}

TEST(TpTransformer, EvalModeNeedsNoRngStreamAndMatchesReference) {
  spawn_ranks(2, [](Group& tp) {
    ScopedRngTracker scoped{RngTracker()};  // not seeded: no model-parallel stream
    auto options = ParallelTransformerLayerOptions(30, 6, 34, tp).hidden_dropout(0.5).attention_dropout(0.5).seed(3);
    ParallelTransformerLayer layer(options);
    TransformerLayerReference ref(options);
    layer->eval();
    ref->eval();
    const at::Tensor x = random_tensor({5, 2, 30}, 9, at::kDouble);
    layer->to(at::kDouble);
    ref->to(at::kDouble);
    expect_close("eval output", layer(x), ref(x), tolerance_for(at::kDouble));
    // In training mode the stream is required, and the error says how to get it.
    layer->train();
    try {
      layer(x);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("model_parallel_manual_seed"), std::string::npos) << e.what();
    }
  });
}

// ~~~ construction, errors, printing ~~~

TEST(TpTransformer, ClearErrors) {
  spawn_ranks(2, [](Group& tp) {
    // Heads not divisible by the TP size: named op, rank and group.
    expect_error([&] { ParallelSelfAttention(ParallelSelfAttentionOptions(15, 3, tp)); },
                 {"ParallelSelfAttention rank " + std::to_string(tp.rank()) + "/2 group 'world'"});
    expect_error([&] { ParallelSelfAttention(ParallelSelfAttentionOptions(15, 3, tp)); },
                 {"num_heads (3) is not divisible by the tensor-parallel size (2)"});
    expect_error([&] { ParallelTransformerLayer(ParallelTransformerLayerOptions(30, 3, 34, tp)); },
                 {"num_heads (3) is not divisible"});
    expect_error([&] { ParallelSelfAttention(ParallelSelfAttentionOptions(16, 6, tp)); },
                 {"hidden_size (16) is not divisible by num_heads (6)"});
    expect_error([&] { ParallelTransformerLayer(ParallelTransformerLayerOptions(30, 6, 33, tp)); },
                 {"not divisible by the tensor-parallel size"});
    expect_error([&] { ParallelTransformerLayer(ParallelTransformerLayerOptions(30, 6, 34, tp).hidden_dropout(2)); },
                 {"hidden_dropout must be in [0, 1]"});
    ParallelSelfAttention attention(ParallelSelfAttentionOptions(30, 6, tp));
    expect_error([&] { attention(torch::zeros({4, 30})); }, {"expected input [seq, batch, hidden=30], got "});
    expect_error([&] { attention(torch::zeros({4, 2, 31})); }, {"[4, 2, 31]"});
    ParallelTransformerLayer layer(ParallelTransformerLayerOptions(30, 6, 34, tp));
    expect_error([&] { layer(torch::zeros({4, 2, 29})); }, {"expected input [seq, batch, hidden=30]"});
    // No group and no parallel state.
    expect_error([] { ParallelSelfAttention(ParallelSelfAttentionOptions(30, 6)); }, {"ParallelSelfAttention"});
  });
}

// The module's own line (operator<< also prints the children).
template <typename Holder>
std::string header(const Holder& module) {
  std::ostringstream out;
  module->pretty_print(out);
  return out.str();
}

TEST(TpTransformer, PrettyPrint) {
  spawn_ranks(2, [](Group& tp) {
    EXPECT_EQ(header(ParallelSelfAttention(ParallelSelfAttentionOptions(30, 6, tp))),
              "commgrad::tp::ParallelSelfAttention(hidden=30, heads=6, tp=2, causal=true)");
    EXPECT_EQ(
        header(ParallelSelfAttention(
            ParallelSelfAttentionOptions(30, 6, tp).causal(false).attention_dropout(0.25).sequence_parallel(true))),
        "commgrad::tp::ParallelSelfAttention(hidden=30, heads=6, tp=2, causal=false, attention_dropout=0.25, "
        "sequence_parallel=true)");
    EXPECT_EQ(header(ParallelTransformerLayer(ParallelTransformerLayerOptions(30, 6, 34, tp).sequence_parallel(true))),
              "commgrad::tp::ParallelTransformerLayer(hidden=30, heads=6, ffn=34, tp=2, sequence_parallel=true)");
    EXPECT_EQ(header(TransformerLayerReference(ParallelTransformerLayerOptions(30, 6, 34))),
              "commgrad::tp::TransformerLayerReference(hidden=30, heads=6, ffn=34)");
    EXPECT_EQ(header(SelfAttentionReference(ParallelSelfAttentionOptions(30, 6))),
              "commgrad::tp::SelfAttentionReference(hidden=30, heads=6, causal=true)");
  });
}

TEST(TpTransformer, ShardSpecsAndClone) {
  spawn_ranks(2, [](Group& tp) {
    for (bool sp : {false, true}) {
      ParallelTransformerLayer layer(ParallelTransformerLayerOptions(30, 6, 34, tp).sequence_parallel(sp).seed(4));
      const auto specs = shard_specs(*layer);
      EXPECT_EQ(specs["ln1.weight"].spec.partial_grad, sp);
      EXPECT_EQ(specs["ln2.bias"].spec.partial_grad, sp);
      EXPECT_EQ(specs["attention.qkv.weight"].spec.dim, 0);
      EXPECT_EQ(specs["attention.qkv.weight"].spec.stride, 3);
      EXPECT_EQ(specs["attention.dense.weight"].spec.dim, 1);
      EXPECT_EQ(specs["mlp.fc1.bias"].spec.dim, 0);
      EXPECT_EQ(specs["attention.dense.bias"].spec.partial_grad, sp);
      EXPECT_EQ(layer->attention->num_local_heads(), 3);
      EXPECT_EQ(layer->attention->head_dim(), 5);
      // A clone is an independent copy with the same values and layout.
      auto copy = std::dynamic_pointer_cast<ParallelTransformerLayerImpl>(layer->clone());
      ASSERT_TRUE(copy);
      const at::Tensor x = random_tensor({sp ? 3 : 6, 2, 30}, 1, at::kFloat);
      EXPECT_TRUE(torch::equal(copy->forward(x), layer(x)));
      EXPECT_FALSE(copy->ln1->weight.is_same(layer->ln1->weight));
      EXPECT_EQ(shard_specs(*copy)["ln1.weight"].spec.partial_grad, sp);
    }
  });
}

}  // namespace
}  // namespace commgrad::tp
