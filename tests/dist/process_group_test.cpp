// Process groups: the world and sub-groups over real Gloo transports, one
// thread per rank (spawn_ranks), and the errors of misuse.

#include "harness/expect_error.h"
#include "commgrad/config.h"
#include "commgrad/dist/build_info.h"
#include "commgrad/dist/check.h"
#include "commgrad/dist/device.h"
#include "commgrad/dist/transport.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/dist/terminate_handler.h"
#include "commgrad/util/blas.h"
#include "harness/spawn_ranks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <sstream>
#include <thread>

namespace commgrad {
namespace {

using testing::error_of;
using ::testing::HasSubstr;
using testing::spawn_ranks;

class WorldSizes : public ::testing::TestWithParam<int> {};

TEST_P(WorldSizes, WorldGroupHasEveryRankAndItsTransportWorks) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    EXPECT_EQ(g.size(), n);
    EXPECT_TRUE(g.is_member());
    EXPECT_EQ(world(), g);
    EXPECT_EQ(rank(), g.rank());
    EXPECT_EQ(world_size(), n);
    EXPECT_EQ(g.name(), "world");
    EXPECT_EQ(g.backend_name(), "gloo");
    EXPECT_TRUE(g.single_host());
    EXPECT_EQ(g.describe(), c10::str("rank ", g.rank(), "/", n, " group 'world' (gloo)"));
    std::vector<at::Tensor> t{at::full({3}, g.rank() + 1.0)};
    g.transport().allreduce(t)->wait();
    EXPECT_TRUE(at::equal(t[0], at::full({3}, n * (n + 1) / 2.0)));
  });
}

TEST_P(WorldSizes, SubGroupsOfEvenAndOddRanks) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    std::vector<int> even, odd;
    for (int r = 0; r < n; ++r) (r % 2 ? odd : even).push_back(r);
    Group ge = new_group(even, NewGroupOptions().name("even"));
    Group go = odd.empty() ? Group() : new_group(odd, NewGroupOptions().name("odd"));
    Group mine = g.rank() % 2 ? go : ge;
    Group other = g.rank() % 2 ? ge : go;
    ASSERT_TRUE(mine.is_member());
    EXPECT_EQ(mine.rank(), g.rank() / 2);
    EXPECT_EQ(mine.global_rank(mine.rank()), g.rank());
    EXPECT_EQ(mine.group_rank_of(g.rank()), mine.rank());
    std::vector<at::Tensor> t{at::full({2}, double(g.rank()))};
    mine.transport().allreduce(t)->wait();
    double expect = 0;
    for (int r : mine.ranks()) expect += r;
    EXPECT_TRUE(at::equal(t[0], at::full({2}, expect)));
    if (other.defined()) {
      EXPECT_FALSE(other.is_member());
      EXPECT_EQ(other.rank(), -1);
      EXPECT_THAT(error_of([&] { check_member("all_reduce", other); }),
                  HasSubstr("this rank is not a member of the group"));
      EXPECT_THAT(
          error_of([&] { check_member("all_reduce", other); }),
          HasSubstr(c10::str("[commgrad] all_reduce rank ", g.rank(), " (not a member) group '", other.name(), "'")));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(ProcessGroup, WorldSizes, ::testing::Values(1, 2, 3, 4));

TEST(ProcessGroup, NewGroupRejectsBadRankLists) {
  spawn_ranks(2, [](Group& g) {
    EXPECT_THAT(error_of([] { new_group({0, 2}); }), HasSubstr("rank 2 is outside the world (0..1)"));
    EXPECT_THAT(error_of([] { new_group({1, 1}); }), HasSubstr("rank 1 appears twice"));
    EXPECT_THAT(error_of([] { new_group({}); }), HasSubstr("the rank list is empty"));
    // A valid group still works after the rejected calls (they did not desynchronise the ranks).
    Group both = new_group({1, 0});
    EXPECT_EQ(both.rank(), 1 - g.rank());
    std::vector<at::Tensor> t{at::ones({1})};
    both.transport().allreduce(t)->wait();
    EXPECT_EQ(t[0].item<float>(), 2.0f);
  });
}

TEST(ProcessGroup, GroupsWithTheSameNameDoNotCollide) {
  spawn_ranks(3, [](Group&) {
    Group a = new_group({0, 1}, NewGroupOptions().name("same"));
    Group b = new_group({1, 2}, NewGroupOptions().name("same"));
    for (Group* grp : {&a, &b}) {
      if (!grp->is_member()) continue;
      std::vector<at::Tensor> t{at::ones({1})};
      grp->transport().allreduce(t)->wait();
      EXPECT_EQ(t[0].item<float>(), 2.0f);
    }
  });
}

TEST(ProcessGroup, WorldBeforeInitIsAClearError) {
  std::string msg;
  std::thread([&] { msg = error_of([] { world(); }); }).join();
  EXPECT_THAT(msg, HasSubstr("call commgrad::init_process_group() first"));
}

TEST(ProcessGroup, EmptyGroupHandleIsAClearError) {
  EXPECT_THAT(error_of([] { Group().rank(); }), HasSubstr("use of an empty Group handle"));
  EXPECT_THAT(error_of([] { check_member("broadcast", Group()); }), HasSubstr("broadcast: the group handle is empty"));
}

// The handler is process-wide: ctest runs each case in a process of its own.
TEST(ProcessGroup, TerminateHandlerIsInstalledByInitUnlessTurnedOff) {
  if (terminate_handler_installed()) GTEST_SKIP() << "installed by an earlier test in this process";
  make_world_group(
      InitOptions().store(c10::make_intrusive<c10d::HashStore>()).rank(0).world_size(1).terminate_handler(false));
  EXPECT_FALSE(terminate_handler_installed());
  make_world_group(InitOptions().store(c10::make_intrusive<c10d::HashStore>()).rank(0).world_size(1));
  EXPECT_TRUE(terminate_handler_installed());
}

TEST(ProcessGroup, TransportsSayWhatTheyOfferBeyondC10d) {
  for (const std::string backend : {"gloo", "shm"}) {
    spawn_ranks(
        2,
        [&](Group& g) {
          const auto& caps = g.capabilities();
          const bool shm = backend == "shm";
          EXPECT_EQ(static_cast<bool>(caps.allreduce_out), shm) << backend;
          EXPECT_EQ(static_cast<bool>(caps.reduce_out), shm) << backend;
          EXPECT_EQ(static_cast<bool>(caps.reduce_scatter), shm) << backend;
          EXPECT_EQ(static_cast<bool>(caps.all_gather), shm) << backend;
          EXPECT_EQ(caps.reduces_16bit, shm) << backend;
          EXPECT_EQ(caps.completes_on_call_below > 0, shm) << backend;
          if (!shm) return;
          // The table reaches the transport it came with.
          auto in = at::full({4}, g.rank() + 1.0f);
          auto out = at::empty({4});
          caps.allreduce_out(in, out, c10d::AllreduceOptions())->wait();
          EXPECT_TRUE(at::equal(out, at::full({4}, 3.0f)));
          EXPECT_TRUE(at::equal(in, at::full({4}, g.rank() + 1.0f)));
          auto gathered = at::empty({2, 4});
          caps.all_gather(gathered, in, c10d::AllgatherOptions())->wait();
          EXPECT_TRUE(at::equal(gathered, at::stack({at::full({4}, 1.0f), at::full({4}, 2.0f)})));
        },
        testing::SpawnOptions().backend(backend));
  }
}

TEST(ProcessGroup, ExplicitStoreNeedsValidRankAndSize) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(error_of([&] { make_world_group(InitOptions().store(store).rank(2).world_size(2)); }),
              HasSubstr("needs rank in [0, world_size)"));
  EXPECT_THAT(error_of([&] { make_world_group(InitOptions().rank(0).world_size(2)); }),
              HasSubstr("rank and world_size options need an explicit store"));
}

// connect_group: what the "commgrad" torch.distributed backend (python/)
// builds for each of PyTorch's groups, over the store c10d hands it.
TEST(ProcessGroup, ConnectGroupPicksShmOnOneHostAndLeavesTheProcessAlone) {
  const int n = 3;
  const int threads_before = at::get_num_threads();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> backends(n), describes(n);
  std::vector<float> sums(n, 0.0f);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      Group g = connect_group(store, r, n, ConnectOptions().name("tp0"));
      backends[r] = g.backend_name();
      describes[r] = g.describe();
      std::vector<at::Tensor> t{at::full({4}, static_cast<float>(r + 1))};
      g.transport().allreduce(t)->wait();
      sums[r] = t[0][0].item<float>();
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(backends[r], "shm");
    EXPECT_EQ(describes[r], c10::str("rank ", r, "/", n, " group 'tp0' (shm)"));
    EXPECT_EQ(sums[r], 6.0f);
  }
  // No thread count, CUDA device or terminate handler is set for the caller.
  EXPECT_EQ(at::get_num_threads(), threads_before);
}

TEST(ProcessGroup, ConnectGroupRejectsBadRanksAndBackends) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(error_of([&] { connect_group(store, 2, 2, ConnectOptions().name("pg3")); }),
              HasSubstr("connect_group 'pg3': needs rank in [0, size)"));
  EXPECT_THAT(error_of([&] { connect_group(detail::StorePtr(), 0, 1); }), HasSubstr("the store is null"));
  EXPECT_THAT(error_of([&] { connect_group(store, 0, 1, ConnectOptions().backend("mpi2")); }),
              HasSubstr("backend 'mpi2' is not available"));
}

TEST(ProcessGroup, IntraOpThreadsAlsoLimitOpenBlasOwnPool) {
  using GetFn = int (*)();
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (get == nullptr) GTEST_SKIP() << "the BLAS in this process is not OpenBLAS: " << active_blas();
  set_blas_threads(2);  // as many as the machine allows (OpenBLAS caps it at its core count)
  auto store = c10::make_intrusive<c10d::HashStore>();
  make_world_group(InitOptions().store(store).rank(0).world_size(1).intra_op_threads(1));
  EXPECT_EQ(get(), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
}

TEST(ProcessGroup, UnknownBackendIsAClearError) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(error_of([&] { make_world_group(InitOptions().store(store).rank(0).world_size(1).backend("mpi2")); }),
              HasSubstr("backend 'mpi2' is not available in this build; available: auto, gloo"));
}

// Where CUDA tensors travel (the GPU itself is exercised by tests/cuda).
TEST(ProcessGroup, CudaTensorsGetNcclOnlyWhenEveryLocalRankHasAGpu) {
  EXPECT_EQ(resolve_cuda_backend("auto", 2, 0), "");  // no device: no CUDA transport
  EXPECT_EQ(resolve_cuda_backend("gloo", 1, 0), "");
  EXPECT_EQ(resolve_cuda_backend("auto", 2, 1), "gloo");  // two ranks share one GPU
  EXPECT_EQ(resolve_cuda_backend("auto", 4, 8), COMMGRAD_HAVE_NCCL ? "nccl" : "gloo");
  EXPECT_EQ(resolve_cuda_backend("gloo", 1, 8), "gloo");
  EXPECT_EQ(resolve_cuda_backend("shm", 1, 8), "gloo");  // shm carries CPU tensors only
  EXPECT_THAT(error_of([] { resolve_cuda_backend("nccl", 1, 0); }),
              HasSubstr("backend 'nccl' needs a CUDA device, and this process sees none"));
  if (COMMGRAD_HAVE_NCCL) {
    EXPECT_THAT(error_of([] { resolve_cuda_backend("nccl", 2, 1); }),
                HasSubstr("backend 'nccl' needs a GPU for each of the 2 ranks on this host, but this process sees 1"));
  }
}

TEST(ProcessGroup, CpuTensorsOfANcclJobTravelOnShmOrGloo) {
  EXPECT_EQ(resolve_backend("auto", {"a", "a"}), "shm");
  EXPECT_EQ(resolve_backend("auto", {"a", "b"}), "gloo");
  if (COMMGRAD_HAVE_NCCL) {
    EXPECT_EQ(resolve_backend("nccl", {"a", "a"}), "shm");  // c10d's "cpu:gloo,cuda:nccl", with shm on one host
    EXPECT_EQ(resolve_backend("nccl", {"a", "b"}), "gloo");
  } else {
    EXPECT_THAT(error_of([] { resolve_backend("nccl", {"a"}); }), HasSubstr("backend 'nccl' is not available"));
  }
}

TEST(ProcessGroup, ACudaTensorWithoutACudaDeviceIsAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device (tests/cuda covers it)";
  spawn_ranks(2, [](Group& g) {
    EXPECT_EQ(g.cuda_backend_name(), "");
    EXPECT_EQ(&g.transport(c10::DeviceType::CPU), &g.transport());
    EXPECT_THAT(error_of([&] { g.transport(c10::DeviceType::CUDA); }),
                HasSubstr("group 'world' (gloo): got a CUDA tensor, but this process saw no CUDA device"));
  });
}

TEST(ProcessGroup, BuildInfoNamesVersionLibTorchAndTransports) {
  const auto& info = build_info();
  EXPECT_EQ(info.version, COMMGRAD_VERSION_STRING);
  EXPECT_EQ(info.torch_version.rfind(c10::str(TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, "."), 0), 0u)
      << info.torch_version;
  EXPECT_EQ(info.cxx_standard, __cplusplus >= 202002L ? 20 : 17);  // the standard this test is compiled with
  EXPECT_EQ(info.to_string(), COMMGRAD_BUILD_INFO_STRING);
  std::ostringstream printed;
  printed << info;
  EXPECT_EQ(printed.str(), COMMGRAD_BUILD_INFO_STRING);
  EXPECT_EQ(available_backends(), info.transports);
  EXPECT_EQ(std::count(info.transports.begin(), info.transports.end(), "nccl"), COMMGRAD_HAVE_NCCL);
}

// commgrad compiles against the NCCL header of the NCCL that LibTorch loads
// (a CUDA toolkit on the include path may carry an older one).
TEST(ProcessGroup, NcclHeaderMatchesTheLibraryLibTorchLoads) {
  if (!COMMGRAD_HAVE_NCCL) GTEST_SKIP() << "this LibTorch has no NCCL (" << build_info().to_string() << ")";
  const auto v = detail::nccl_versions();
  ASSERT_GT(v.library, 0) << "ncclGetVersion not found in the process";
  EXPECT_EQ(v.header / 100, v.library / 100) << "nccl.h " << v.header << ", libnccl " << v.library;
}

TEST(ProcessGroup, CheckMacroNamesOpRankGroupAndShapes) {
  spawn_ranks(2, [](Group& g) {
    auto x = at::zeros({3, 5});
    const auto msg = error_of(
        [&] { COMMGRAD_CHECK(x.size(0) % 2 == 0, "all_gather", g, "expected dim 0 divisible by 2, got ", x.sizes()); });
    EXPECT_THAT(msg, HasSubstr(c10::str("[commgrad] all_gather rank ", g.rank(),
                                        "/2 group 'world' (gloo): expected dim 0 divisible by 2, got [3, 5]")));
  });
}

}  // namespace
}  // namespace commgrad
