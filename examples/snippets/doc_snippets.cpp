// The code docs/zero.md and docs/checkpoints.md quote, as a program that
// compiles and runs (on any number of ranks: `commgrad-run -n 2
// doc_snippets`). Each region between "// [name]" and "// [end name]" is
// quoted word for word (tests/util/snippets_test.cpp keeps them equal).

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>
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

}  // namespace

int main(int argc, char** argv) {
  const std::string root = argc > 1 ? argv[1] : "doc_snippets_ckpt";
  try {
    commgrad::init_process_group();
    zero_quick_start(batches_of_this_rank());
    loss_scaling(batches_of_this_rank(), root + "/scaler", 1);
    if (commgrad::world_size() % 2 == 0) {
      checkpoints_by_pieces(root + "/pieces", 1, 2);
      checkpoints_in_one_call(root + "/training", 1);
    }
    commgrad::destroy_process_group();
  } catch (const c10::Error& e) {
    std::cerr << "doc_snippets: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
