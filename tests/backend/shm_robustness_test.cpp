// The shm backend when things go wrong, and under load: ranks that call
// different collectives or reject their arguments, stuck ranks and
// timeouts, point-to-point mismatches, asynchronous work, several groups
// used at once, segment hygiene, and a seed-reproducible soak of thousands
// of random collectives, every result checked.

#include "backend/shm_harness.h"
#include "commgrad/util/error.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <random>
#include <thread>

namespace {

using namespace shm_test;
using Clock = std::chrono::steady_clock;

RunOptions quick(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  RunOptions o;
  o.shm.chunk_bytes(2048).mailbox_bytes(4096).timeout(timeout);
  return o;
}

/// A reusable barrier between the test's rank threads (not through shm).
class ThreadBarrier {
 public:
  explicit ThreadBarrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

void expect_group_usable(Rank& r) {
  std::vector<at::Tensor> t{at::full({5}, static_cast<float>(r.rank + 1))};
  r.shm->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(t[0], at::full({5}, r.size * (r.size + 1) / 2.0f))) << "the group is not usable afterwards";
}

TEST(ShmErrors, RanksCallingDifferentCollectivesAllFailAndTheGroupStaysUsable) {
  run_ranks(3, quick(), [](Rank& r) {
    std::vector<at::Tensor> t{at::ones({r.rank == 1 ? 12 : 10})};
    std::string message;
    if (r.rank == 2) {
      message = error_of([&] { r.shm->broadcast(t)->wait(); });
    } else {
      message = error_of([&] { r.shm->allreduce(t)->wait(); });
    }
    EXPECT_NE(message.find("called different collectives"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 1: allreduce #0 (Float, 48 bytes, SUM)"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 2: broadcast #0"), std::string::npos) << message;
    EXPECT_NE(message.find("rank " + std::to_string(r.rank) + "/3 group 'shm' (shm)"), std::string::npos) << message;
    std::vector<at::Tensor> other{at::ones({r.rank == 0 ? 10 : 7})};
    EXPECT_THROW(r.shm->allreduce(other)->wait(), commgrad::MismatchError)
        << "a disagreement is a MismatchError (DistBackendError in Python)";
    expect_group_usable(r);
  });
}

TEST(ShmErrors, ARankThatRejectsItsArgumentsFailsThePeersAtOnce) {
  run_ranks(3, quick(), [](Rank& r) {
    std::vector<at::Tensor> t{at::ones({4})};
    c10d::BroadcastOptions o;
    o.rootRank = r.rank == 1 ? 5 : 0;
    const auto start = Clock::now();
    const std::string message = error_of([&] { r.shm->broadcast(t, o)->wait(); });
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5)) << "peers waited for a timeout";
    if (r.rank == 1) {
      EXPECT_NE(message.find("root rank 5 is outside [0, 3)"), std::string::npos) << message;
    } else {
      EXPECT_NE(message.find("rank 1 rejected its arguments"), std::string::npos) << message;
      EXPECT_NE(message.find("root rank 5 is outside"), std::string::npos) << message;
    }
    expect_group_usable(r);
  });
}

TEST(ShmErrors, UnsupportedArgumentsAreClearErrors) {
  run_ranks(2, quick(), [](Rank& r) {
    auto reduce_with = [&](at::Tensor x, RedOpType op) {
      std::vector<at::Tensor> t{x};
      c10d::AllreduceOptions o;
      o.reduceOp = op;
      return error_of([&] { r.shm->allreduce(t, o)->wait(); });
    };
    EXPECT_NE(reduce_with(at::ones({3}, at::kBool), RedOpType::AVG).find("AVG is not defined for bool"),
              std::string::npos);
    EXPECT_NE(reduce_with(at::ones({3}), RedOpType::BAND).find("BAND needs an integer or bool tensor"),
              std::string::npos);
    EXPECT_NE(reduce_with(at::ones({3}, at::kComplexFloat), RedOpType::MAX).find("not defined for complex"),
              std::string::npos);
    EXPECT_NE(reduce_with(at::ones({3}).to_sparse(), RedOpType::SUM).find("strided layout"), std::string::npos);
    std::vector<at::Tensor> two{at::ones({3}), at::ones({3})};
    EXPECT_NE(error_of([&] { r.shm->allreduce(two)->wait(); }).find("exactly one tensor per call, got 2"),
              std::string::npos);
    // The whole message, for a tensor of a list (named with its index).
    std::vector<std::vector<at::Tensor>> gathered{{at::empty({3}), at::Tensor()}};
    std::vector<at::Tensor> mine{at::ones({3})};
    const std::string undefined = error_of([&] { r.shm->allgather(gathered, mine)->wait(); });
    EXPECT_NE(undefined.find("[commgrad] allgather rank " + std::to_string(r.rank) +
                             "/2 group 'shm' (shm): output 1 must be a defined CPU tensor with strided layout, "
                             "got an undefined tensor"),
              std::string::npos)
        << undefined;
    at::Tensor flat = at::empty({7});
    at::Tensor in = at::ones({3});
    EXPECT_NE(error_of([&] { r.shm->_allgather_base(flat, in)->wait(); }).find("expected world size x input = 2 x 3"),
              std::string::npos);
    at::Tensor odd = at::ones({3, 2});
    at::Tensor out = at::empty({3, 2});
    std::vector<int64_t> none;
    EXPECT_NE(error_of([&] { r.shm->alltoall_base(out, odd, none, none)->wait(); }).find("not divisible"),
              std::string::npos);
    std::vector<int64_t> bad_splits{1, 1};
    EXPECT_NE(error_of([&] { r.shm->alltoall_base(out, odd, none, bad_splits)->wait(); }).find("add up to 2"),
              std::string::npos);
    std::vector<at::Tensor> one{at::ones({2})};
    EXPECT_NE(error_of([&] { r.shm->send(one, r.rank, 0)->wait(); }).find("must be another rank"), std::string::npos);
    at::Tensor storage = at::ones({8});
    EXPECT_NE(error_of([&] {
                r.shm->allreduce_out(storage.narrow(0, 0, 5), storage.narrow(0, 3, 5))->wait();
              }).find("input and output overlap"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                at::Tensor gathered = at::zeros({8});
                at::Tensor shifted = gathered.narrow(0, 1, 4);  // neither apart nor this rank's part
                r.shm->_allgather_base(gathered, shifted)->wait();
              }).find("the input overlaps the output without being this rank's part of it"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                r.shm->allreduce_out(at::ones({4}), at::empty({5}))->wait();
              }).find("differ in dtype or number of elements"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                r.shm->allreduce_out(at::ones({4, 2}).t(), at::empty({2, 4}))->wait();
              }).find("needs contiguous tensors"),
              std::string::npos);
    expect_group_usable(r);
  });
}

// Staged, and with every all-to-all piece read straight from its sender.
class ShmSizeMismatch : public ::testing::TestWithParam<bool> {};

TEST_P(ShmSizeMismatch, NamesBothRanks) {
  RunOptions options = quick();
  if (GetParam()) options.shm.single_copy_piece_bytes(4);
  run_ranks(3, options, [](Rank& r) {
    // Rank 1 thinks rank 0 contributes 5 elements; rank 0 sends 4.
    std::vector<at::Tensor> in{at::ones({4})};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int q = 0; q < 3; ++q) out[0].push_back(at::empty({r.rank == 1 && q == 0 ? 5 : 4}));
    const std::string message = error_of([&] { r.shm->allgather(out, in)->wait(); });
    EXPECT_NE(message.find("rank 1 expects 20 bytes from rank 0, which sends 16 bytes"), std::string::npos) << message;
    // alltoall: rank 2 expects 2 rows from rank 0, which sends 1.
    at::Tensor a = at::ones({3});
    at::Tensor b = at::empty({r.rank == 2 ? 4 : 3});
    std::vector<int64_t> in_splits{1, 1, 1};
    std::vector<int64_t> out_splits = r.rank == 2 ? std::vector<int64_t>{2, 1, 1} : in_splits;
    const std::string m2 = error_of([&] { r.shm->alltoall_base(b, a, out_splits, in_splits)->wait(); });
    EXPECT_NE(m2.find("rank 0 sends 4 bytes to rank 2, which expects 8 bytes"), std::string::npos) << m2;
    // Rank 2 sends itself 2 rows but expects 1: its own piece, the last of
    // its output, is not copied (it would overrun the tensor).
    at::Tensor c = at::ones({r.rank == 2 ? 4 : 3});
    at::Tensor d = at::zeros({3});
    std::vector<int64_t> self_splits = r.rank == 2 ? std::vector<int64_t>{1, 1, 2} : in_splits;
    const std::string m3 = error_of([&] { r.shm->alltoall_base(d, c, in_splits, self_splits)->wait(); });
    EXPECT_NE(m3.find("rank 2 sends 8 bytes to rank 2, which expects 4 bytes"), std::string::npos) << m3;
    expect_group_usable(r);
  });
}

INSTANTIATE_TEST_SUITE_P(PiecesReadDirectly, ShmSizeMismatch, ::testing::Bool());

TEST(ShmErrors, AStuckRankIsNamedWithinTheTimeoutAndTheGroupIsAborted) {
  ThreadBarrier sync(3);
  run_ranks(3, quick(std::chrono::milliseconds(400)), [&](Rank& r) {
    std::vector<at::Tensor> t{at::ones({8})};
    std::string message;
    if (r.rank != 2) {
      const auto start = Clock::now();
      message = error_of([&] { r.shm->allreduce(t)->wait(); });
      const auto took = Clock::now() - start;
      EXPECT_GE(took, std::chrono::milliseconds(300));
      EXPECT_LT(took, std::chrono::seconds(5));
      // Whoever timed out first names rank 2; the other may see that rank's abort.
      EXPECT_NE(message.find("waiting for rank 2 (rank 2 has not entered any collective)"), std::string::npos)
          << message;
    }
    sync.wait();
    // The group is aborted: every later call fails at once, with the reason.
    message = error_of([&] { r.shm->allreduce(t)->wait(); });
    EXPECT_NE(message.find("aborted"), std::string::npos) << message;
    EXPECT_NE(message.find("Timed out"), std::string::npos) << message;
  });
}

TEST(ShmErrors, PointToPointMismatchIsAnErrorAndLaterMessagesStillArrive) {
  run_ranks(2, quick(), [](Rank& r) {
    std::vector<at::Tensor> t{at::full({3}, 5.0f)};
    if (r.rank == 0) {
      r.shm->send(t, 1, /*tag=*/1)->wait();
      r.shm->send(t, 1, /*tag=*/2)->wait();
    } else {
      std::vector<at::Tensor> in{at::empty({3})};
      const std::string message = error_of([&] { r.shm->recv(in, 0, /*tag=*/9)->wait(); });
      EXPECT_NE(message.find("has tag 1, 12 bytes of Float; this recv expects tag 9"), std::string::npos) << message;
      r.shm->recv(in, 0, /*tag=*/2)->wait();
      EXPECT_TRUE(at::equal(in[0], t[0]));
    }
    expect_group_usable(r);
  });
}

// A rank with other settings unlinks the segment itself and tells the
// others, which fail at once naming the mismatch (not after the timeout:
// under a launcher they would be stopped before they could unlink it).
TEST(ShmErrors, DifferentSegmentSettingsFailConstructionAtOnceNamingThemAndLeaveNothingBehind) {
  // Rank 1 differs in chunk_bytes (the segment's size), then in the single-copy settings (its header).
  const std::vector<ShmOptions> rank1 = {ShmOptions().chunk_bytes(2048),
                                         ShmOptions().chunk_bytes(1024).single_copy_bytes(4096),
                                         ShmOptions().chunk_bytes(1024).single_copy_piece_bytes(4096)};
  for (size_t k = 0; k < rank1.size(); ++k) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        errors[r] = error_of([&] {
          ShmOptions o = r == 0 ? ShmOptions().chunk_bytes(1024) : rank1[k];
          ShmProcessGroup pg(store, r, 2, o.timeout(std::chrono::seconds(20)));
        });
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_NE(errors[0].find("a peer could not join the shared-memory segment: "), std::string::npos) << errors[0];
    EXPECT_NE(errors[0].find("all ranks must use the same"), std::string::npos) << errors[0];
    EXPECT_EQ(errors[0].find("within"), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find("all ranks must use the same"), std::string::npos) << errors[1];
    if (k == 1) {
      EXPECT_NE(errors[1].find("single_copy_bytes 0 to"), std::string::npos) << errors[1];
    }
    if (k == 2) {
      EXPECT_NE(errors[1].find("single_copy_piece_bytes 4096 ("), std::string::npos) << errors[1];
    }
    const auto key = store->get("shm/1/segment");
    const std::string name(key.begin(), key.end());
    EXPECT_NE(access(("/dev/shm" + name).c_str(), F_OK), 0) << name << " was left in /dev/shm";
  }
}

// streaming_stores outside 0..2, set or from the environment, is named at construction.
TEST(ShmErrors, AStreamingStoresValueOutsideItsRangeIsNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string set = error_of([&] { ShmProcessGroup pg(store, 0, 1, ShmOptions().streaming_stores(3)); });
  EXPECT_NE(set.find("shm group 'shm': streaming_stores is 3"), std::string::npos) << set;
  EXPECT_NE(set.find("expected 0 (ordinary stores), 1 (streaming) or 2"), std::string::npos) << set;
  ::setenv("COMMGRAD_SHM_STREAMING_STORES", "7", 1);
  const std::string env = error_of([&] { ShmProcessGroup pg(store, 0, 1, ShmOptions()); });
  ::unsetenv("COMMGRAD_SHM_STREAMING_STORES");
  EXPECT_NE(env.find("shm group 'shm': $COMMGRAD_SHM_STREAMING_STORES is 7; expected 0"), std::string::npos) << env;
}

// Rank 1 announced itself (pid and pid namespace, as every rank does first)
// and died before it mapped the segment: rank 0 names it at once and removes
// the name, instead of waiting out the timeout (or being stopped first).
TEST(ShmSegment, ARankThatDiedBeforeMappingIsNamedAtOnceAndLeavesNothingBehind) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  waitpid(child, nullptr, 0);
  struct stat ns {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &ns), 0);
  const std::string announced = std::to_string(child) + " " + std::to_string(ns.st_ino);
  store->set("shm/1/pid/1", std::vector<uint8_t>(announced.begin(), announced.end()));
  const auto start = std::chrono::steady_clock::now();
  const std::string error =
      error_of([&] { ShmProcessGroup pg(store, 0, 2, ShmOptions().timeout(std::chrono::seconds(20))); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(error.find("rank 1 (pid " + std::to_string(child) + ") exited before it mapped the shared-memory segment"),
            std::string::npos)
      << error;
  const auto key = store->get("shm/1/segment");
  const std::string name(key.begin(), key.end());
  EXPECT_NE(access(("/dev/shm" + name).c_str(), F_OK), 0) << name << " was left in /dev/shm";
}

TEST(ShmSegment, TheNameIsRandomAndUnlinkedOnceEveryRankHasMappedIt) {
  std::vector<std::string> names(2);
  run_ranks(2, quick(), [&](Rank& r) {
    names[r.rank] = r.shm->segment_name();
    EXPECT_EQ(names[r.rank].rfind("/commgrad-shm-", 0), 0u) << names[r.rank];
    EXPECT_EQ(names[r.rank].size(), std::string("/commgrad-shm-").size() + 32);
    EXPECT_NE(access(("/dev/shm" + names[r.rank]).c_str(), F_OK), 0) << "still in /dev/shm";
    std::ifstream maps("/proc/self/maps");
    std::string line;
    bool mapped = false;
    while (std::getline(maps, line)) {
      if (line.find(names[r.rank].substr(1)) != std::string::npos && line.find("(deleted)") != std::string::npos) {
        mapped = true;
      }
    }
    EXPECT_TRUE(mapped) << "the segment is not mapped as a deleted file";
  });
  EXPECT_EQ(names[0], names[1]);
}

TEST(ShmAsync, WorkHandlesAndFuturesCompleteInIssueOrder) {
  RunOptions o = quick();
  o.shm.async_bytes(0);  // every collective on the worker thread
  run_ranks(3, o, [](Rank& r) {
    std::vector<std::vector<at::Tensor>> tensors;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < 20; ++i) tensors.push_back({at::full({100 + i}, static_cast<float>(i + r.rank))});
    for (int i = 0; i < 20; ++i) works.push_back(r.shm->allreduce(tensors[i]));
    for (int i = 19; i >= 0; --i) {
      works[i]->wait();
      EXPECT_TRUE(works[i]->isCompleted());
      EXPECT_TRUE(at::equal(tensors[i][0], at::full({100 + i}, static_cast<float>(3 * i + 3))));
    }
    std::vector<at::Tensor> t{at::ones({4})};
    auto future = r.shm->allreduce(t)->getFuture();
    future->wait();
    EXPECT_TRUE(at::equal(future->value().toTensorList().get(0), at::full({4}, 3.0f)));
    // Destroying the group drains what is still queued.
    for (int i = 0; i < 5; ++i) works[i] = r.shm->allreduce(tensors[i]);
    r.shm.reset();
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(works[i]->isCompleted());
  });
}

// wait(timeout) gives up after its own timeout, not the group's (the job is
// not run inside the wait), and the collective still completes when the
// late rank arrives; eager and lazy workers alike.
TEST(ShmAsync, WaitWithATimeoutGivesUpAfterIt) {
  for (const int eager : {0, 1}) {
    SCOPED_TRACE(eager ? "eager worker" : "lazy worker");
    RunOptions o = quick(std::chrono::seconds(20));
    o.shm.async_bytes(0).eager_worker(eager);
    run_ranks(2, o, [eager](Rank& r) {
      const std::string key = "rank 0 gave up " + std::to_string(eager);
      std::vector<at::Tensor> t{at::full({8}, r.rank + 1.0f)};
      if (r.rank == 0) {
        auto work = r.shm->allreduce(t);
        const auto start = Clock::now();
        const std::string message = error_of([&] { work->wait(std::chrono::milliseconds(300)); });
        const auto took = Clock::now() - start;
        EXPECT_NE(message.find("timed out"), std::string::npos) << message;
        EXPECT_GE(took, std::chrono::milliseconds(250));
        EXPECT_LT(took, std::chrono::seconds(3));
        r.store->set(key, std::vector<uint8_t>{1});
        work->wait();
      } else {
        r.store->wait({key});
        r.shm->allreduce(t)->wait();
      }
      EXPECT_TRUE(at::equal(t[0], at::full({8}, 3.0f)));
      expect_group_usable(r);
    });
  }
}

// Work nobody waits for still completes, eager or lazy: rank 0 blocks on
// the store until rank 1 has finished an all_reduce that needs rank 0's
// part, so only rank 0's worker thread can run it; and a caller that polls
// isCompleted() instead of waiting sees its collective finish.
TEST(ShmAsync, WorkNobodyWaitsForStillCompletes) {
  for (const int eager : {0, 1}) {
    SCOPED_TRACE(eager ? "eager worker" : "lazy worker");
    RunOptions o = quick();
    o.shm.async_bytes(0).eager_worker(eager);
    run_ranks(2, o, [eager](Rank& r) {
      const std::string key = "rank 1 done " + std::to_string(eager);
      std::vector<at::Tensor> t{at::full({8}, r.rank + 1.0f)};
      auto work = r.shm->allreduce(t);
      if (r.rank == 0) {
        r.store->wait({key});
      } else {
        work->wait();
        r.store->set(key, std::vector<uint8_t>{1});
      }
      work->wait();
      EXPECT_TRUE(at::equal(t[0], at::full({8}, 3.0f)));
      std::vector<at::Tensor> u{at::full({8}, r.rank + 1.0f)};
      auto polled = r.shm->allreduce(u);
      while (!polled->isCompleted()) std::this_thread::yield();
      EXPECT_TRUE(at::equal(u[0], at::full({8}, 3.0f)));
      // A Future's callbacks run without anyone waiting.
      std::vector<at::Tensor> v{at::full({8}, r.rank + 1.0f)};
      std::atomic<bool> called{false};
      r.shm->allreduce(v)->getFuture()->addCallback([&called](c10::ivalue::Future&) { called = true; });
      while (!called) std::this_thread::yield();
      EXPECT_TRUE(at::equal(v[0], at::full({8}, 3.0f)));
    });
  }
}

// A small call issued while a large one is still queued does not run
// inline ahead of it: it queues behind, and waiting for it runs both, in
// order; then small calls run inline again. The small call broadcasts the
// head of the large one's tensor, so running it first would leave 2 there
// instead of 3. Eager and lazy workers alike.
TEST(ShmAsync, SmallCallsQueueBehindALargeOne) {
  for (const int eager : {0, 1}) {
    SCOPED_TRACE(eager ? "eager worker" : "lazy worker");
    RunOptions o = quick();
    o.shm.async_bytes(1024).eager_worker(eager);  // 1 KiB and more on the worker thread
    run_ranks(2, o, [](Rank& r) {
      for (int round = 0; round < 20; ++round) {
        at::Tensor x = at::full({4096}, r.rank + 1.0f);
        std::vector<at::Tensor> large{x};
        std::vector<at::Tensor> head{x.narrow(0, 0, 8)};
        auto queued = r.shm->allreduce(large);
        auto behind = r.shm->broadcast(head);  // root 0
        behind->wait();
        EXPECT_TRUE(queued->isCompleted());
        queued->wait();
        EXPECT_TRUE(at::equal(x, at::full({4096}, 3.0f))) << "round " << round;
        std::vector<at::Tensor> alone{at::full({8}, r.rank + 1.0f)};
        r.shm->allreduce(alone)->wait();  // inline, once the worker let go of the last job
        EXPECT_TRUE(at::equal(alone[0], at::full({8}, 3.0f)));
      }
    });
  }
}

TEST(ShmAsync, SeveralGroupsUsedFromSeveralThreadsAtOnce) {
  run_ranks(3, quick(), [](Rank& r) {
    auto second =
        c10::make_intrusive<ShmProcessGroup>(c10::make_intrusive<c10d::PrefixStore>("second", r.store), r.rank, r.size,
                                             ShmOptions().chunk_bytes(1024).group_name("second"));
    auto hammer = [&](ShmProcessGroup& pg, float scale) {
      for (int i = 0; i < 200; ++i) {
        std::vector<at::Tensor> t{at::full({1 + i * 13}, scale * (r.rank + 1))};
        pg.allreduce(t)->wait();
        EXPECT_TRUE(at::equal(t[0], at::full({1 + i * 13}, scale * 6))) << pg.describe() << " iteration " << i;
      }
    };
    std::thread other([&] { hammer(*second, 2.0f); });
    hammer(*r.shm, 1.0f);
    other.join();
  });
}

// ~~~ soak ~~~

uint64_t soak_seed() {
  const char* v = std::getenv("COMMGRAD_SHM_SOAK_SEED");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 20240601;
}

void soak(int n, int collectives, bool async = false) {
  const uint64_t seed = soak_seed();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::cout << "soak: " << n << " ranks, " << collectives << " collectives, COMMGRAD_SHM_SOAK_SEED=" << seed
            << std::endl;
  const auto start = Clock::now();
  RunOptions options = quick();
  if (async) options.shm.async_bytes(0).eager_worker(1);  // every collective through the worker thread
  run_ranks(n, options, [&](Rank& r) {
    std::mt19937_64 rng(seed);  // the same sequence on every rank
    const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kByte};
    int failures = 0;
    for (int i = 0; i < collectives && failures < 5; ++i) {
      const uint64_t salt = seed * 31 + i;
      const int kind = static_cast<int>(rng() % 7);
      const auto dtype = dtypes[rng() % dtypes.size()];
      const int64_t numel = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 3000) : static_cast<int64_t>(rng() % 40);
      const int root = static_cast<int>(rng() % n);
      std::vector<at::Tensor> all;
      for (int q = 0; q < n; ++q) all.push_back(make_input(numel, dtype, q, salt));
      bool ok = true;
      const std::string what = c10::str("soak #", i, " kind ", kind, " ", dtype, " numel ", numel, " root ", root);
      if (kind == 0 || kind == 1) {  // allreduce SUM / MAX
        const RedOpType op = kind == 0 ? RedOpType::SUM : RedOpType::MAX;
        std::vector<at::Tensor> t{all[r.rank].clone()};
        c10d::AllreduceOptions o;
        o.reduceOp = op;
        r.shm->allreduce(t, o)->wait();
        ok = same_bits(t[0], reference_reduce(all, op));
      } else if (kind == 2) {
        std::vector<at::Tensor> t{all[r.rank].clone()};
        c10d::BroadcastOptions o;
        o.rootRank = root;
        r.shm->broadcast(t, o)->wait();
        ok = same_bits(t[0], all[root]);
      } else if (kind == 3) {
        at::Tensor flat = at::empty({numel * n}, at::TensorOptions().dtype(dtype));
        r.shm->_allgather_base(flat, all[r.rank])->wait();
        ok = same_bits(flat, at::cat(all));
      } else if (kind == 4) {
        // Rank x's input is all[x] repeated n times; everyone gets the sum of one piece.
        at::Tensor in = all[r.rank].repeat({n});
        at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(dtype));
        r.shm->_reduce_scatter_base(out, in)->wait();
        ok = same_bits(out, reference_reduce(all, RedOpType::SUM));
      } else if (kind == 5) {
        std::vector<at::Tensor> t{all[r.rank].clone()};
        c10d::ReduceOptions o;
        o.rootRank = root;
        r.shm->reduce(t, o)->wait();
        ok = r.rank != root || same_bits(t[0], reference_reduce(all, RedOpType::SUM));
      } else {
        at::Tensor in = all[r.rank].repeat({n});
        at::Tensor out = at::empty({numel * n}, at::TensorOptions().dtype(dtype));
        std::vector<int64_t> none;
        r.shm->alltoall_base(out, in, none, none)->wait();
        ok = same_bits(out, at::cat(all));
      }
      if (!ok) {
        ++failures;
        ADD_FAILURE() << "rank " << r.rank << ": " << what;
      }
    }
  });
  std::cout << "soak: done in " << std::chrono::duration<double>(Clock::now() - start).count() << "s" << std::endl;
}

TEST(ShmSoak, ThreeRanksThousandsOfRandomCollectives) { soak(3, 5000); }
TEST(ShmSoak, FourRanksThroughTheWorkerThread) { soak(4, 2000, /*async=*/true); }
TEST(ShmSoak, EightRanksOnTwoCoresDoNotCrawl) { soak(8, 1500); }

}  // namespace
