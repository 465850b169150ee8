// The C++ side of the cross-check against Python's FSDP2
// (python/tests/test_fsdp2_cross_check.py): the model of
// python/tests/workers/fsdp2_peer.py, from the same initial weights and data
// (a safetensors file), sharded by commgrad::fsdp one unit per Linear and
// trained with Adam; rank 0 writes the losses and the final parameters.
//
//   commgrad-run -n 2 fsdp2_peer_job INIT.safetensors OUT.safetensors

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>

namespace fsdp = commgrad::fsdp;

namespace {

// nn.Sequential(Linear, ReLU, Linear, ReLU, Linear), with Python's names.
struct PeerImpl : torch::nn::Module {
  PeerImpl(int64_t in, int64_t hidden, int64_t out) {
    fc0 = register_module("0", torch::nn::Linear(in, hidden));
    fc2 = register_module("2", torch::nn::Linear(hidden, hidden));
    fc4 = register_module("4", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::call(fc4, torch::relu(fsdp::call(fc2, torch::relu(fsdp::call(fc0, x)))));
  }
  torch::nn::Linear fc0{nullptr}, fc2{nullptr}, fc4{nullptr};
};
TORCH_MODULE(Peer);

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: fsdp2_peer_job INIT.safetensors OUT.safetensors\n";
    return 2;
  }
  try {
    commgrad::init_process_group();
    const int rank = commgrad::rank(), n = commgrad::world_size();
    auto init = commgrad::checkpoint::read_safetensors(argv[1]);
    const auto& x = init["x"];  // [steps, batch, in]
    const auto& y = init["y"];  // [steps, batch, out]
    Peer model(x.size(2), init["0.weight"].size(0), y.size(2));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) p.value().copy_(init[p.key()]);
    }
    for (auto* layer : {&model->fc0, &model->fc2, &model->fc4}) fsdp::fully_shard(*layer);
    auto sharded = fsdp::fully_shard(model);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    std::vector<torch::Tensor> losses;
    for (int64_t step = 0; step < x.size(0); ++step) {
      opt.zero_grad();
      auto loss = torch::mse_loss(fsdp::call(model, x[step].chunk(n, 0)[rank]), y[step].chunk(n, 0)[rank]);
      loss.backward();
      opt.step();
      losses.push_back(commgrad::ops::raw::all_reduce(loss.detach().reshape({1}),
                                                      commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kAvg))
                           .wait());
    }
    auto out = sharded.full_state_dict();
    out.insert("losses", torch::cat(losses));
    if (rank == 0) commgrad::checkpoint::write_safetensors(argv[2], out);
    commgrad::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp2_peer_job: " << e.what() << "\n";
    return 1;
  }
}
