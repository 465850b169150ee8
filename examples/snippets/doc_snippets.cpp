// The code the docs quote (README.md's program is readme_all_reduce.cpp), as
// a program that compiles and runs (at 2 ranks in the tests: `commgrad-run
// -n 2 doc_snippets ROOT`; the layouts of two need an even number). Each region between
// "// [name]" and "// [end name]" is quoted word for word
// (tests/util/snippets_test.cpp keeps them equal); the code around a region
// defines what the quote takes as given and checks what it computed against
// one rank where that is cheap (the program exits 1 otherwise).

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

using Batches = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

Batches batches_of_this_rank() {
  Batches out;
  for (int k = 0; k < 3; ++k) out.emplace_back(torch::randn({4, 8}), torch::randn({4, 4}));
  return out;
}

void zero_quick_start(const Batches& my_shard_of_each_batch) {
  // [zero]
  auto model = std::make_shared<NetImpl>();
  commgrad::optim::ZeroOptimizer zero(
      model,
      [](std::vector<torch::Tensor> shards) {
        return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
      },
      commgrad::optim::ZeroOptimizerOptions().stage(2).max_grad_norm(1.0));  // groups: the layout's, or the world

  for (const auto& [x, y] : my_shard_of_each_batch) {
    const auto xs = x.chunk(2), ys = y.chunk(2);
    {
      auto guard = zero.no_sync();  // accumulate the first half locally
      torch::mse_loss(model->forward(xs[0]), ys[0]).backward();
    }
    torch::mse_loss(model->forward(xs[1]), ys[1]).backward();  // reduce-scatters in buckets
    zero.step();                                               // clip, step 1/N, all-gather
    zero.zero_grad();
  }
  // [end zero]
}

void loss_scaling(const Batches& my_shard_of_each_batch, const std::string& root, int64_t step) {
  // [loss_scaler]
  auto model = std::make_shared<NetImpl>();  // float16 parameters in practice: model->to(torch::kHalf)
  commgrad::dp::DistributedDataParallel ddp(model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  commgrad::optim::DynamicLossScaler scaler;  // 2^32, hysteresis 2, the layout's groups

  for (const auto& [x, y] : my_shard_of_each_batch) {
    opt.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(x), y)).backward();  // DDP reduces the scaled gradients
    if (!scaler.step(opt)) {                                         // unscale, agree, step unless inf/NaN, update
      std::cout << "skipped; scale now " << scaler.scale() << "\n";
    }
  }

  // In a checkpoint, next to the model:
  auto pieces = commgrad::checkpoint::module_pieces(*model);
  auto scaler_state = commgrad::checkpoint::loss_scaler_pieces(scaler);
  pieces.insert(pieces.end(), scaler_state.begin(), scaler_state.end());
  commgrad::checkpoint::save(root, step, pieces);
  // [end loss_scaler]
}

void checkpoints_by_pieces(const std::string& root, int64_t step, int epoch) {
  // [checkpoint_pieces]
  namespace ckpt = commgrad::checkpoint;
  auto state = commgrad::make_model_parallel(2, 1);  // TP=2 x DP=W/2 (W even)
  commgrad::tp::ParallelMLP model(commgrad::tp::ParallelMLPOptions(8, 32, state.tensor_parallel_group()).seed(1));
  auto tracker = commgrad::tp::rng_tracker();

  auto pieces = ckpt::module_pieces(*model, "model/");
  auto rng = ckpt::rng_pieces(tracker, state.tensor_parallel_group());
  pieces.insert(pieces.end(), rng.begin(), rng.end());
  ckpt::save(root, step, pieces, {{"epoch", epoch}}, ckpt::SaveOptions().keep(3));

  // later, under any layout (build the model at the new TP size first):
  auto to_load = ckpt::module_pieces(*model, "model/");
  auto rng_to_load = ckpt::rng_pieces(tracker, state.tensor_parallel_group());
  to_load.insert(to_load.end(), rng_to_load.begin(), rng_to_load.end());
  auto result = ckpt::load(root, to_load);          // the step `latest` names
  ckpt::restore_rng(tracker, rng_to_load, result);  // load() wrote into these pieces
  std::cout << "loaded step " << result.step << ", epoch " << result.metadata.at("epoch").get<int>() << "\n";
  // [end checkpoint_pieces]
}

void checkpoints_in_one_call(const std::string& root, int64_t step) {
  // [checkpoint_training_state]
  commgrad::ScopedParallelState layout(commgrad::make_model_parallel(2, 1));  // or initialize_model_parallel(2)
  commgrad::tp::ParallelMLP model(commgrad::tp::ParallelMLPOptions(8, 32).seed(1));
  commgrad::optim::ZeroOptimizer zero(model.ptr(), [](std::vector<torch::Tensor> shards) {
    return std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(1e-3));
  });
  commgrad::checkpoint::save_training_state(root, step, *model, zero, {{"epoch", 3}});

  // later, under any layout: build the model and the optimizer, then
  const auto loaded = commgrad::checkpoint::load_training_state(root, *model, zero);
  std::cout << "resumed at step " << loaded.step << ", epoch " << loaded.metadata.at("epoch").get<int>() << "\n";

  // weights only (evaluation), from the same training checkpoint:
  commgrad::checkpoint::load_model_weights(root, *model);
  // [end checkpoint_training_state]
}

// Stops the program (exit 1) when `got` differs from `want`, the one-rank result.
void expect_close(const std::string& what, const torch::Tensor& got, const torch::Tensor& want) {
  if (!torch::allclose(got, want, /*rtol=*/1e-4, /*atol=*/1e-5)) {
    throw std::runtime_error(what + " differs from one rank's by " +
                             std::to_string((got - want).abs().max().item<double>()));
  }
}

torch::Tensor seeded_randn(at::IntArrayRef sizes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, gen);
}

// docs/context_parallel.md: the same sequences, q, k, v and input on every
// rank; each rank's part of the results against one rank's whole sequence.
void context_parallel(int tp_size) {
  const int64_t s = 16, heads = 4, hidden = 64;  // as the layer below
  const auto tokens = torch::arange(2 * s).reshape({2, s});
  // [cp_layout]
  namespace cp = commgrad::cp;
  namespace tp = commgrad::tp;
  auto state = commgrad::make_model_parallel(commgrad::ModelParallelOptions(tp_size).context_parallel_size(2));
  const auto& cp_group = state.context_parallel_group();

  // The data: this rank's part of every sequence (head-tail), positions too.
  auto ids = cp::shard_sequence(tokens, 1, cp::SequenceLayout::kHeadTail, cp_group);  // [b, s/W]
  auto pos = cp::local_positions(s, cp::SequenceLayout::kHeadTail, cp_group);         // int64 [s/W]
  // [end cp_layout]
  if (!torch::equal(ids, tokens.index_select(1, pos))) throw std::runtime_error("cp: ids are not the tokens at pos");
  const auto part = [&](const torch::Tensor& whole, int64_t dim) {
    return cp::shard_sequence(whole, dim, cp::SequenceLayout::kHeadTail, cp_group);
  };
  const auto q_full = seeded_randn({2, heads, s, 8}, 1), k_full = seeded_randn({2, heads, s, 8}, 2),
             v_full = seeded_randn({2, heads, s, 8}, 3), x_full = seeded_randn({s, 2, hidden}, 4);
  const auto q = part(q_full, 2), k = part(k_full, 2), v = part(v_full, 2);
  // [cp_attention]
  // The core alone: q, k, v [batch, heads, s/W, head_dim] -> [batch, heads, s/W, head_dim].
  auto out = cp::attention(q, k, v, cp::ContextParallelOptions(cp_group, cp::AttentionMode::kRing));

  // The layer: input [s/W, b, h] (or [s/(W tp), b, h] with SP).
  tp::ParallelSelfAttention attn(
      tp::ParallelSelfAttentionOptions(64, 4, state.tensor_parallel_group())
          .seed(1)  // the same weights on every CP rank
          .context_parallel(cp::ContextParallelOptions(cp_group, cp::AttentionMode::kAllGather)));
  // [end cp_attention]
  expect_close("cp::attention", out, part(cp::full_attention(q_full, k_full, v_full, /*causal=*/true), 2));
  tp::SelfAttentionReference reference(tp::ParallelSelfAttentionOptions(hidden, heads).seed(*attn->options.seed()));
  torch::NoGradGuard no_grad;
  expect_close("context-parallel attention layer", attn(part(x_full, 0)), part(reference(x_full), 0));
}

torch::nn::Linear pipeline_stage(int stage) {
  torch::nn::Linear layer(8, stage == 0 ? 8 : 4);
  torch::NoGradGuard no_grad;
  layer->weight.copy_(seeded_randn(layer->weight.sizes(), 10 + stage));
  layer->bias.copy_(seeded_randn(layer->bias.sizes(), 20 + stage));
  return layer;
}

// One step of docs/pipeline.md's runtime; the loss it reports.
double pipeline_step(torch::nn::Linear& my_stage, torch::optim::Optimizer& opt, const commgrad::Group& pp_group,
                     const torch::Tensor& inputs, const torch::Tensor& targets) {
  // [pipeline]
  commgrad::pp::Pipeline pipe(
      {[&](const at::Tensor& x) { return my_stage->forward(x); }},
      [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); },
      commgrad::pp::PipelineOptions(/*microbatches=*/8).schedule("1f1b").group(pp_group));
  opt.zero_grad();
  auto result = pipe.step(inputs, targets);  // inputs read on the first stage's rank, targets on the last's
  opt.step();                                // result.loss: the mean over microbatches, on every rank
  // [end pipeline]
  return result.loss;
}

// Two linear stages over a pipeline of two ranks, one SGD step, against the
// whole model stepped on one rank.
void pipeline_runtime() {
  auto state = commgrad::make_model_parallel(1, 2);  // TP=1, PP=2, DP=W/2
  const int stage = state.pipeline_parallel_rank();
  auto my_stage = pipeline_stage(stage);
  torch::optim::SGD opt(my_stage->parameters(), torch::optim::SGDOptions(0.1));
  const auto inputs = seeded_randn({16, 8}, 30), targets = seeded_randn({16, 4}, 31);
  const double loss = pipeline_step(my_stage, opt, state.pipeline_parallel_group(), inputs, targets);

  auto first = pipeline_stage(0), last = pipeline_stage(1);
  auto params = first->parameters();
  for (const auto& p : last->parameters()) params.push_back(p);
  torch::optim::SGD one_rank(params, torch::optim::SGDOptions(0.1));
  const auto one_rank_loss = torch::mse_loss(last(first(inputs)), targets);
  one_rank_loss.backward();
  one_rank.step();
  expect_close("pipeline loss", torch::scalar_tensor(loss, torch::kDouble), one_rank_loss.detach().to(torch::kDouble));
  expect_close("pipeline stage weight", my_stage->weight, (stage == 0 ? first : last)->weight);
}

struct TiedStageImpl : torch::nn::Module {
  TiedStageImpl() : embedding(register_module("embedding", torch::nn::Embedding(6, 4))) {
    torch::NoGradGuard no_grad;
    embedding->weight.copy_(seeded_randn({6, 4}, 40));
  }
  torch::nn::Embedding embedding;
};

// docs/pipeline.md's tied embedding: the first stage's gradient of the copy
// is 1, the last's 2; after one SGD step both copies moved by their sum.
void tied_embedding() {
  auto state = commgrad::make_model_parallel(1, 2);  // the embedding group: the two stages
  const auto& dp_group = state.data_parallel_group();
  auto model = std::make_shared<TiedStageImpl>();
  // [tied_embedding]
  auto options = commgrad::optim::ZeroOptimizerOptions(dp_group)
                     .tied_parameters({"embedding.weight"})  // on the first and the last stage's ranks
                     .tied_group(state.embedding_group());
  // [end tied_embedding]
  commgrad::optim::ZeroOptimizer zero(
      model,
      [](std::vector<torch::Tensor> shards) {
        return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(0.1));
      },
      options);
  (model->embedding->weight * (state.pipeline_parallel_rank() + 1.0)).sum().backward();
  zero.step();
  expect_close("tied embedding", model->named_parameters()["embedding.weight"].detach(),
               seeded_randn({6, 4}, 40) - 0.1 * 3.0);
}

// docs/semantics.md's check of a layer of one's own.
int check_layer(commgrad::tp::ParallelMLP& parallel_layer, commgrad::tp::MLPReference& reference_layer,
                const torch::Tensor& x, const commgrad::Group& tp_group) {
  // [check_gradients]
  auto result = commgrad::check::check_gradients(
      commgrad::check::subject(parallel_layer), commgrad::check::subject(reference_layer), {x},
      commgrad::check::GradCheckOptions(tp_group)
          .input_layouts({commgrad::check::Layout::partitioned(0)})  // the layer takes a sequence chunk
          .output_layout(commgrad::check::Layout::partitioned(0)));
  if (commgrad::rank() == 0) std::cout << result;  // one line per tensor: max abs / rel error, ok or MISMATCH
  return result.ok() ? 0 : 1;
  // [end check_gradients]
}

void check_sequence_parallel_mlp() {
  auto state = commgrad::make_model_parallel(2, 1);
  const auto& tp_group = state.tensor_parallel_group();
  commgrad::tp::ParallelMLP mlp(commgrad::tp::ParallelMLPOptions(8, 32, tp_group).seed(3).sequence_parallel(true));
  commgrad::tp::MLPReference reference(commgrad::tp::ParallelMLPOptions(8, 32).seed(3));
  if (check_layer(mlp, reference, seeded_randn({4, 2, 8}, 50), tp_group) != 0) {
    throw std::runtime_error("check_gradients: the sequence-parallel MLP differs from its reference");
  }
}

// docs/moe.md: experts over EP=2 (TP=1, PP=1 at 2 and 4 ranks); y keeps x's shape.
void mixture_of_experts(int64_t tp, int64_t pp) {
  const auto x = seeded_randn({6, 64}, 60 + commgrad::rank());
  // [moe_layer]
  auto state = commgrad::make_model_parallel(commgrad::ModelParallelOptions(tp, pp).expert_parallel_size(2));
  commgrad::moe::MoELayer moe(
      commgrad::moe::MoELayerOptions(64, 128, /*experts=*/8, /*top_k=*/2, state.expert_parallel_group())
          .routing(
              commgrad::moe::RoutingOptions().aux_loss_coeff(1e-2).batch_group(state.data_context_parallel_group()))
          .seed(5));
  auto y = moe(x);  // x: this rank's tokens [..., 64]; y has x's shape
  // [end moe_layer]
  if (y.sizes() != x.sizes()) throw std::runtime_error("moe: y does not have x's shape");
  y.sum().backward();
}

// docs/recompute.md's three forms; the recomputed results against the same
// modules called without recompute (dropout off there: p only changes the mask).
void recompute_forms(const commgrad::Group& tp_group) {
  torch::nn::Linear fc1(8, 16), fc2(16, 8);
  torch::nn::Sequential mlp(fc1, fc2), block(fc1, fc2);
  const double scale = 0.5;
  const auto x = seeded_randn({4, 8}, 70).requires_grad_();
  const auto token_ids = torch::arange(4);
  // [recompute_api]
  namespace tp = commgrad::tp;

  // Tensors in, tensors out; non-tensor arguments are captured by the lambda.
  std::vector<at::Tensor> out = tp::recompute(
      [&](const std::vector<at::Tensor>& in) {
        auto h = tp::dropout(torch::gelu(fc1->forward(in[0])), 0.1, true);
        return std::vector<at::Tensor>{fc2->forward(h) * scale, in[1] + 1};
      },
      {x, token_ids}, tp::RecomputeOptions().name("mlp").parameters(mlp->parameters()));

  // One tensor in, one out.
  at::Tensor y = tp::recompute([&](const at::Tensor& x) { return block->forward(x); }, x);

  // The layer option.
  tp::ParallelTransformerLayer layer(tp::ParallelTransformerLayerOptions(1024, 16, 4096, tp_group)
                                         .hidden_dropout(0.1)
                                         .attention_dropout(0.1)
                                         .recompute(tp::RecomputeGranularity::kSelective));
  // [end recompute_api]
  if (!torch::equal(out[1], token_ids + 1)) throw std::runtime_error("recompute: in[1] + 1 differs");
  out[0].sum().backward();
  if (!fc1->weight.grad().defined()) throw std::runtime_error("recompute: fc1 has no gradient");
  x.mutable_grad().reset();
  y.sum().backward();
  const auto recomputed_grad = x.grad().clone();
  x.mutable_grad().reset();
  const auto direct = block->forward(x);
  direct.sum().backward();
  expect_close("recompute: y", y, direct);
  expect_close("recompute: dy/dx", recomputed_grad, x.grad());
}

struct LayeredImpl : torch::nn::Module {
  LayeredImpl() : head(register_module("head", torch::nn::Linear(8, 4))) {
    for (int k = 0; k < 2; ++k)
      layers.push_back(register_module("layers" + std::to_string(k), torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = commgrad::fsdp::call(layer, x);
    return head(torch::relu(x));
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head;
};
TORCH_MODULE(Layered);

// docs/fsdp.md: the quick start, loss scaling and a checkpoint of the pieces.
void fully_sharded(const Batches& my_shard_of_each_batch, const std::string& root, int64_t step) {
  namespace checkpoint = commgrad::checkpoint;
  Layered model;
  // [fsdp]
  namespace fsdp = commgrad::fsdp;

  for (auto& layer : model->layers) fsdp::fully_shard(layer);  // one unit per layer
  auto sharded = fsdp::fully_shard(model);                     // the root: the rest
  torch::optim::AdamW opt(model->parameters(), 1e-3);          // this rank's pieces

  // In Model::forward:  for (auto& layer : layers) x = fsdp::call(layer, x);
  for (auto& [x, y] : my_shard_of_each_batch) {
    auto loss = torch::mse_loss(fsdp::call(model, x), y);
    loss.backward();               // reduce-scatters, overlapped with backward
    sharded.clip_grad_norm_(1.0);  // over every shard (and TP/PP groups if given)
    opt.step();                    // steps 1/N of every parameter
    opt.zero_grad();
  }
  // [end fsdp]
  const auto& [x, y] = my_shard_of_each_batch.front();
  auto loss = torch::mse_loss(fsdp::call(model, x), y);
  // [fsdp_loss_scaler]
  commgrad::optim::DynamicLossScaler scaler;  // inf/NaN agreed over the layout's DP, TP, PP
  scaler.scale(loss).backward();
  std::vector<at::Tensor> grads;
  for (auto& p : model->parameters())
    if (p.grad().defined()) grads.push_back(p.grad());
  scaler.step(grads, [&] {
    sharded.clip_grad_norm_(1.0);
    opt.step();
  });  // skipped on every rank together
  // [end fsdp_loss_scaler]
  // [fsdp_checkpoint]
  auto pieces = checkpoint::fsdp_pieces(sharded);
  auto optim = checkpoint::fsdp_optimizer_pieces(sharded, opt);
  pieces.insert(pieces.end(), optim.begin(), optim.end());
  checkpoint::save(root, step, pieces);
  // [end fsdp_checkpoint]
}

}  // namespace

int main(int argc, char** argv) {
  const std::string root = argc > 1 ? argv[1] : "doc_snippets_ckpt";
  try {
    commgrad::init_process_group();
    zero_quick_start(batches_of_this_rank());
    loss_scaling(batches_of_this_rank(), root + "/scaler", 1);
    fully_sharded(batches_of_this_rank(), root + "/fsdp", 1);
    if (commgrad::world_size() % 2 == 0) {
      checkpoints_by_pieces(root + "/pieces", 1, 2);
      checkpoints_in_one_call(root + "/training", 1);
      context_parallel(commgrad::world_size() % 4 == 0 ? 2 : 1);  // TP=2 x CP=2 on 4 ranks, TP=1 x CP=2 on 2
      pipeline_runtime();
      tied_embedding();
      check_sequence_parallel_mlp();
      mixture_of_experts(1, 1);
      recompute_forms(commgrad::make_model_parallel(2, 1).tensor_parallel_group());
    }
    commgrad::destroy_process_group();
  } catch (const c10::Error& e) {
    std::cerr << "doc_snippets: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "doc_snippets: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
