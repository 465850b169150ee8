// CUDA tensors through commgrad: each rank on cuda:LOCAL_RANK, CUDA tensors on
// the group's CUDA transport (NCCL when every rank has a GPU, Gloo where
// ranks share one), CPU tensors still on shm/Gloo, and the Family 1 ops on
// CUDA tensors equal to the same ops on CPU tensors. Every test skips, naming
// the reason, on a machine without a CUDA device.

#include "commgrad/commgrad.h"
#include "harness/spawn_ranks.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad {
namespace {

using ::testing::HasSubstr;
using testing::spawn_ranks;
using testing::SpawnOptions;

#define SKIP_WITHOUT_CUDA()                                                              \
  if (cuda_device_count() == 0)                                                          \
  GTEST_SKIP() << "no CUDA device visible to this process (" << build_info().to_string() \
               << "); scripts/gpu_check.sh runs these tests on a GPU machine"

// What carries CUDA tensors for `ranks` ranks on this host.
std::string expected_cuda_backend(int ranks) {
  return COMMGRAD_HAVE_NCCL && ranks <= cuda_device_count() ? "nccl" : "gloo";
}

TEST(Cuda, EachRankUsesTheGpuOfItsLocalRank) {
  SKIP_WITHOUT_CUDA();
  spawn_ranks(2, [](Group& g) {
    const int devices = cuda_device_count();
    EXPECT_EQ(device(), c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(g.rank() % devices)));
    EXPECT_EQ(g.cuda_backend_name(), "gloo");  // the world's backend is Gloo: it carries both
    EXPECT_EQ(&g.transport(c10::DeviceType::CUDA), &g.transport());
  });
}

TEST(Cuda, CudaTensorsHaveTheirOwnTransportNextToShm) {
  SKIP_WITHOUT_CUDA();
  spawn_ranks(
      2,
      [](Group& g) {
        EXPECT_EQ(g.backend_name(), "shm");
        EXPECT_EQ(g.cuda_backend_name(), expected_cuda_backend(2));
        EXPECT_NE(&g.transport(c10::DeviceType::CUDA), &g.transport());
        EXPECT_THAT(g.describe(), HasSubstr("(shm, cuda: " + expected_cuda_backend(2) + ")"));
        // CPU tensors keep the CPU transport.
        auto cpu = ops::all_reduce(at::full({3}, 1.0f));
        EXPECT_TRUE(cpu.is_cpu());
        EXPECT_TRUE(at::equal(cpu, at::full({3}, 2.0f)));
      },
      SpawnOptions().backend("auto"));
}

TEST(Cuda, NcclCarriesCudaTensorsInAWorldOfOne) {
  SKIP_WITHOUT_CUDA();
  if (!COMMGRAD_HAVE_NCCL) GTEST_SKIP() << "this LibTorch has no NCCL (" << build_info().to_string() << ")";
  spawn_ranks(
      1,
      [](Group& g) {
        EXPECT_EQ(g.cuda_backend_name(), "nccl");
        std::vector<at::Tensor> t{at::full({5}, 3.0f, at::TensorOptions().device(device()))};
        g.transport(c10::DeviceType::CUDA).allreduce(t)->wait();  // the raw call: world-of-one ops skip the wire
        EXPECT_TRUE(at::equal(t[0].cpu(), at::full({5}, 3.0f)));
      },
      SpawnOptions().backend("nccl"));
}

class CudaWorlds : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// The Family 1 ops (forward and every input gradient) on CUDA tensors give
// the numbers the same ops give on CPU tensors; results stay on the GPU.
TEST_P(CudaWorlds, FamilyOneOpsOnCudaTensorsEqualTheCpuOps) {
  SKIP_WITHOUT_CUDA();
  const auto [n, backend] = GetParam();
  spawn_ranks(
      n,
      [n](Group& g) {
        const auto cpu_x = at::arange(6 * n, at::kFloat).view({2 * n, 3}) + g.rank();
        auto run = [&](const at::Device& dev) {
          auto x = cpu_x.to(dev).requires_grad_(true);
          std::vector<at::Tensor> outs{ops::all_reduce(x), ops::all_gather(x), ops::reduce_scatter(x),
                                       ops::broadcast(x, ops::BroadcastOptions().src(n - 1))};
          at::Tensor loss = at::zeros({}, x.options());
          for (size_t i = 0; i < outs.size(); ++i) loss = loss + (outs[i] * static_cast<double>(i + 1)).sum();
          loss.backward();
          outs.push_back(x.grad());
          return outs;
        };
        const auto on_cpu = run(at::Device(at::kCPU));
        const auto on_gpu = run(device());
        ASSERT_EQ(on_cpu.size(), on_gpu.size());
        for (size_t i = 0; i < on_cpu.size(); ++i) {
          EXPECT_TRUE(on_gpu[i].is_cuda()) << i;
          EXPECT_TRUE(at::allclose(on_gpu[i].detach().cpu(), on_cpu[i].detach())) << "output " << i;
        }
      },
      SpawnOptions().backend(backend));
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaWorlds,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values("gloo", "shm")));

// The founding example with --device cuda, as separate processes: x.grad is
// [n, n, n, n] on the GPU.
TEST(Cuda, FoundingExampleOnCudaTensorsUnderCommgradRun) {
  SKIP_WITHOUT_CUDA();
  for (int n : {1, 2}) {
    auto r = testing::run_process({testing::launcher_path(), "-n", std::to_string(n), "--timeout", "120",
                                   testing::build_path("bin/tp_autograd_comm"), "--device", "cuda"},
                                  testing::clean_env(), std::chrono::seconds(150));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const std::string v = std::to_string(n) + ".";
    EXPECT_THAT(r.out, HasSubstr("[0] x.grad = tensor([" + v + ", " + v + ", " + v + ", " + v + "], device='cuda:0')"));
    EXPECT_THAT(r.out, HasSubstr("CUDA tensors over " + expected_cuda_backend(n)));
  }
}

}  // namespace
}  // namespace commgrad
