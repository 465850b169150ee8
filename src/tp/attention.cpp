// ParallelSelfAttention (Megatron's ParallelAttention + CoreAttention).
//
// Heads are independent, so splitting them across the tensor-parallel group
// needs communication only where the head outputs are mixed again, in the
// output projection. The layer is therefore a column-parallel QKV projection,
// a local attention core over this rank's heads, and a row-parallel output
// projection:
//
//   x [s, b, h] --qkv (column, stride 3)--> [s, b, 3h/n] = [Q_r | K_r | V_r]
//     Q_r, K_r, V_r -> [b, H/n, s, d]
//     P = softmax(Q K^T / sqrt(d) + M)        M: -inf above the diagonal (causal)
//     P = dropout(P)                          tensor-parallel RNG stream
//     C = P V -> [s, b, h/n]                  heads of rank r, in head order
//   --dense (row, input_is_parallel)--> [s, b, h]   sum over ranks ("g")
//
// Weight layout. The unsplit layer's fused projection produces [Q | K | V],
// each h wide with heads in order. Splitting that output dim into n
// contiguous slices would give rank 0 all of Q and part of K; instead the
// column layer uses stride 3 (sharding.h): rank r holds rows r, r + n and
// r + 2n of the 3n blocks, i.e. [Q_r; K_r; V_r], the rows of its own heads.
// The shard of a head is then bit-for-bit that head's rows of the unsplit
// weight built from the same seed, at every TP size. The output projection
// takes its input features (the concatenated head outputs, in head order)
// split into n contiguous slices, which is exactly rank r's heads again.
//
// Sequence parallelism changes only the two projections: qkv all-gathers the
// sequence chunks before its matmul, dense reduce-scatters along the
// sequence instead of all-reducing. The core always sees the full sequence,
// so the causal mask is over global positions.
//
// Context parallelism changes only the core: q, k, v hold this rank's part
// of the sequence and cp::attention attends them across the
// context-parallel group (the projections are per token).
//
// Its reference, SelfAttentionReference (reference.h), is written
// independently, with einsum and an additive mask.

#include "commgrad/tp/attention.h"

#include "detail/common.h"

#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace commgrad::tp {

namespace {

void check_attention_input(const char* op, const Group& group, const at::Tensor& input, int64_t hidden_size) {
  COMMGRAD_CHECK(input.defined() && input.dim() == 3, op, group, "expected input [seq, batch, hidden=", hidden_size,
                 "], got ", input.defined() ? detail::describe(input) : std::string("an undefined tensor"));
  COMMGRAD_CHECK(input.size(2) == hidden_size, op, group, "expected input [seq, batch, hidden=", hidden_size, "], got ",
                 detail::describe(input));
  COMMGRAD_CHECK(input.is_floating_point(), op, group, "expected a floating-point input, got ",
                 detail::describe(input));
}

}  // namespace

// ~~~ ParallelSelfAttention ~~~

ParallelSelfAttentionOptions::ParallelSelfAttentionOptions(int64_t hidden_size, int64_t num_heads, Group group)
    : hidden_size_(hidden_size), num_heads_(num_heads), group_(std::move(group)) {}

ParallelSelfAttentionImpl::ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ParallelSelfAttentionImpl::reset() {
  const char* op = "ParallelSelfAttention";
  options.group(resolve_tp_group(options.group(), op));
  const Group& g = options.group();
  const int64_t h = options.hidden_size(), heads = options.num_heads();
  COMMGRAD_CHECK(h >= 1 && heads >= 1, op, g, "hidden_size (", h, ") and num_heads (", heads, ") must be positive");
  COMMGRAD_CHECK(h % heads == 0, op, g, "hidden_size (", h, ") is not divisible by num_heads (", heads, ")");
  COMMGRAD_CHECK(heads % g.size() == 0, op, g, "num_heads (", heads, ") is not divisible by the tensor-parallel size (",
                 g.size(), "): the heads are split across the ranks");
  COMMGRAD_CHECK(options.attention_dropout() >= 0.0 && options.attention_dropout() <= 1.0, op, g,
                 "attention_dropout must be in [0, 1], got ", options.attention_dropout());
  check_context_parallel(op, g);
  options.seed(resolve_seed(options.seed(), g));
  const uint64_t seed = *options.seed();
  qkv = register_module("qkv", ColumnParallelLinear(ColumnParallelLinearOptions(h, 3 * h, g)
                                                        .bias(options.bias())
                                                        .sequence_parallel(options.sequence_parallel())
                                                        .stride(3)
                                                        .seed(seed)));
  dense = register_module("dense", RowParallelLinear(RowParallelLinearOptions(h, h, g)
                                                         .bias(options.bias())
                                                         .input_is_parallel(true)
                                                         .sequence_parallel(options.sequence_parallel())
                                                         .seed(seed + 1)));
}

void ParallelSelfAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "commgrad::tp::ParallelSelfAttention(hidden=" << options.hidden_size()
         << ", heads=" << options.num_heads() << ", tp=" << options.group().size() << ", causal=" << options.causal();
  if (options.attention_dropout() > 0) stream << ", attention_dropout=" << options.attention_dropout();
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  if (options.recompute_core()) stream << ", recompute_core=true";
  if (!options.bias()) stream << ", bias=false";
  if (context_parallel()) {
    stream << ", cp=" << options.context_parallel()->group().size() << " ("
           << cp::mode_name(options.context_parallel()->mode()) << ")";
  }
  stream << ")";
}

bool ParallelSelfAttentionImpl::context_parallel() const {
  return options.context_parallel() && options.context_parallel()->group().size() > 1;
}

void ParallelSelfAttentionImpl::check_context_parallel(const char* op, const Group& g) const {
  if (!options.context_parallel()) return;
  const auto& o = *options.context_parallel();
  COMMGRAD_CHECK(o.group().defined(), op, g, "context_parallel() needs a defined context-parallel group");
  COMMGRAD_CHECK(options.attention_dropout() == 0.0, op, g, "attention_dropout (", options.attention_dropout(),
                 ") is not supported under context parallelism (cp=", o.group().size(), ", ", cp::mode_name(o.mode()),
                 "): the probabilities are never formed whole");
  const int64_t local_heads = options.num_heads() / g.size();
  COMMGRAD_CHECK(o.mode() != cp::AttentionMode::kUlysses || local_heads % o.group().size() == 0, op, g,
                 "context-parallel mode ulysses splits the ", local_heads, " heads of each tensor-parallel rank (",
                 options.num_heads(), " heads over TP=", g.size(), ") over CP=", o.group().size(),
                 ", which does not divide them; use allgather or ring");
}

int64_t ParallelSelfAttentionImpl::num_local_heads() const { return options.num_heads() / options.group().size(); }

int64_t ParallelSelfAttentionImpl::head_dim() const { return options.hidden_size() / options.num_heads(); }

at::Tensor ParallelSelfAttentionImpl::forward(const at::Tensor& input) {
  const Group& g = options.group();
  check_attention_input("ParallelSelfAttention", g, input, options.hidden_size());
  // [s, b, 3h/n]; under sequence parallelism qkv has gathered the sequence.
  const at::Tensor mixed = qkv(input);
  const int64_t s = mixed.size(0), b = mixed.size(1), nh = num_local_heads(), d = head_dim();
  const auto parts = mixed.chunk(3, -1);  // Q_r, K_r, V_r: [s, b, nh * d] each
  auto to_heads = [&](const at::Tensor& t) { return t.reshape({s, b, nh, d}).permute({1, 2, 0, 3}); };
  const at::Tensor q = to_heads(parts[0]), k = to_heads(parts[1]), v = to_heads(parts[2]);  // [b, nh, s, d]

  if (!options.recompute_core() || !is_training()) return dense(core(q, k, v));
  auto fn = [this](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{core(in[0], in[1], in[2])}; };
  return dense(recompute(fn, {q, k, v}, RecomputeOptions().name("ParallelSelfAttention core"))[0]);
}

at::Tensor ParallelSelfAttentionImpl::core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t b = q.size(0), nh = q.size(1), s = q.size(2), d = q.size(3);
  if (context_parallel()) {
    const auto o = cp::ContextParallelOptions(*options.context_parallel()).causal(options.causal());
    return cp::attention(q, k, v, o).permute({2, 0, 1, 3}).reshape({s, b, nh * d});
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(d)));
  if (options.causal()) {
    const at::Tensor future = at::ones({s, s}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(scores, -1);
  if (is_training() && options.attention_dropout() > 0) {
    // Each rank drops entries of its own heads: the tensor-parallel stream.
    const RngTracker tracker = rng_tracker();
    auto guard = tracker.fork(kModelParallelRng);
    probs = tp::dropout(probs, options.attention_dropout(), true, tracker);
  }
  return at::matmul(probs, v).permute({2, 0, 1, 3}).reshape({s, b, nh * d});
}

}  // namespace commgrad::tp
