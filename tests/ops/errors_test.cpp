// Bad input gets a clear error, never a hang and never garbage: local checks
// (always on), the cross-rank debug check (COMMGRAD_DEBUG / set_debug_checks),
// timeouts without it, and dtypes the transport lacks.

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <commgrad/ops.h>
#include <commgrad/util/error.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <thread>

namespace commgrad::ops {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::expect_error;

// Runs `f`, which must throw an E (a commgrad::Error), and returns a copy of
// its kind and site.
template <class E, class F>
std::pair<ErrorKind, ErrorSite> typed_error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    EXPECT_NE(c10_error, nullptr) << "every commgrad error is a c10::Error";
    return {e.kind(), e.site()};
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another type of error: " << e.what();
  }
  ADD_FAILURE() << "no error was raised";
  return {};
}

// After a local error the group still works: every rank all-reduces ones.
void expect_group_usable(Group& g) {
  auto y = all_reduce(at::ones({2}), {}, g);
  EXPECT_TRUE(at::equal(y, at::full({2}, static_cast<float>(g.size()))));
}

// ~~~ local checks ~~~

TEST(OpsErrors, DimOutOfRange) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error(
        [&] {
          all_gather(at::ones({2, 3}), AllGatherOptions().dim(2), g);
        },
        {"[commgrad] all_gather rank ", "/2 group 'world' (gloo)", "dim 2 is out of range for float32[2, 3]",
         "expected -2..1"});
    expect_error(
        [&] {
          reduce_scatter(at::ones({2, 4}), ReduceScatterOptions().dim(-3), g);
        },
        {"reduce_scatter", "dim -3 is out of range"});
    expect_error([&] { all_gather(at::ones({}), {}, g); }, {"the tensor is a scalar"});
    expect_group_usable(g);
  });
}

TEST(OpsErrors, IndivisibleSplit) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error(
        [&] {
          reduce_scatter(at::ones({5, 2}), {}, g);
        },
        {"reduce_scatter", "dim 0 of float32[5, 2] has size 5, which is not divisible by the group size 2"});
    expect_error([&] { scatter(at::ones({2, 3}), ScatterOptions().dim(1), g); }, {"scatter", "not divisible"});
    expect_error([&] { all_to_all(at::ones({3}), {}, g); }, {"all_to_all", "not divisible"});
    expect_group_usable(g);
  });
}

TEST(OpsErrors, SplitSizesDoNotAddUp) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error(
        [&] {
          all_to_all(at::ones({3, 2}), AllToAllOptions().input_splits({1, 1}).output_splits({1, 1}), g);
        },
        {"all_to_all", "input_splits [1, 1] add up to 2, but dim 0 of float32[3, 2] has size 3"});
    expect_error(
        [&] {
          all_to_all(at::ones({2}), AllToAllOptions().input_splits({1, 1, 0}), g);
        },
        {"input_splits [1, 1, 0] has 3 entries; expected one per rank (2)"});
    expect_error(
        [&] {
          all_to_all(at::ones({2}), AllToAllOptions().output_splits({1, 1}), g);
        },
        {"output_splits [1, 1] were given without input_splits"});
    expect_error(
        [&] {
          reduce_scatter(at::ones({4}), ReduceScatterOptions().sizes({1, 2}), g);
        },
        {"reduce_scatter", "sizes [1, 2] add up to 3, but dim 0 of float32[4] has size 4"});
    expect_error([&] { all_gather(at::ones({2}), AllGatherOptions().sizes({2, -1}), g); }, {"negative entry"});
    expect_error(
        [&] {
          all_gather(at::ones({2}), AllGatherOptions().sizes({3, 3}), g);
        },
        {"sizes [3, 3] say this rank brings 3 along dim 0, but its tensor is float32[2]"});
    expect_group_usable(g);
  });
}

TEST(OpsErrors, PeerOutsideGroup) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error([&] { broadcast(at::ones({2}), BroadcastOptions().src(2), g); },
                 {"broadcast", "src 2 is outside the group (group ranks 0..1; src is a rank within the group"});
    expect_error([&] { reduce(at::ones({2}), ReduceOptions().dst(-1), g); }, {"reduce", "dst -1 is outside"});
    expect_error([&] { scatter(at::ones({2}), ScatterOptions().src(7), g); }, {"src 7 is outside"});
    expect_error([&] { gather(at::ones({2}), GatherOptions().dst(3), g); }, {"dst 3 is outside"});
    expect_error([&] { send(at::ones({2}), SendOptions(5), g); }, {"send", "dst 5 is outside"});
    expect_error([&] { recv({2}, RecvOptions(g.rank()), g); }, {"recv", "is this rank itself"});
    expect_error([&] { send(at::ones({2}), SendOptions(1 - g.rank()).tag(-1), g); }, {"tag -1 is outside"});
    expect_group_usable(g);
  });
}

TEST(OpsErrors, GradientsThatDoNotExist) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error([&] { recv({2}, RecvOptions(1 - g.rank()).dtype(at::kLong).requires_grad(true), g); },
                 {"recv", "requires_grad(true) needs a floating-point dtype", "integer tensors cannot have gradients"});
    expect_error([&] { all_reduce(at::ones({2}, at::kInt), AllReduceOptions().op(ReduceOp::kAvg), g); },
                 {"AVG needs a floating-point tensor, got int32"});
    // PRODUCT: the forward works, asking for the gradient does not.
    auto x = at::full({2}, 2.0, at::kDouble).requires_grad_(true);
    auto y = all_reduce(x, AllReduceOptions().op(ReduceOp::kProduct), g);
    EXPECT_TRUE(at::equal(y.detach(), at::full({2}, 4.0, at::kDouble)));
    expect_error([&] { y.sum().backward(); }, {"all_reduce", "PRODUCT has no gradient in commgrad"});
    auto z = reduce(x, ReduceOptions().op(ReduceOp::kMax), g);
    expect_error([&] { z.sum().backward(); }, {"reduce", "max has no gradient in commgrad"});
    expect_group_usable(g);
  });
}

TEST(OpsErrors, NonMemberRank) {
  testing::spawn_ranks(3, [](Group& world) {
    auto pair = new_group({0, 2}, NewGroupOptions().name("pair"));
    if (world.rank() == 1) {
      EXPECT_FALSE(pair.is_member());
      expect_error([&] { all_reduce(at::ones({2}), {}, pair); },
                   {"all_reduce", "group 'pair'", "this rank is not a member of the group; only ranks [0, 2]"});
      expect_error([&] { barrier(pair); }, {"barrier", "not a member"});
    } else {
      auto y = all_reduce(at::ones({2}), {}, pair);
      EXPECT_TRUE(at::equal(y, at::full({2}, 2.0f)));
    }
    expect_group_usable(world);
  });
}

TEST(OpsErrors, UnsupportedDtypes) {
  testing::spawn_ranks(2, [](Group& g) {
    expect_error([&] { all_reduce(at::ones({2}, at::kBool), {}, g); },
                 {"reductions of bool tensors are not supported"});
    expect_error([&] { all_reduce(at::ones({2}, at::kComplexFloat), AllReduceOptions().op(ReduceOp::kMax), g); },
                 {"max is not defined for complex tensors"});
    expect_group_usable(g);
  });
}

// ~~~ float16 / bfloat16 and other dtypes Gloo lacks ~~~

TEST(OpsDtypes, HalfAndBFloat16) {
  testing::spawn_ranks(3, [](Group& g) {
    const int n = g.size();
    for (auto dtype : {at::kHalf, at::kBFloat16}) {
      SCOPED_TRACE(c10::toString(dtype));
      auto base = at::arange(6, at::kFloat).add(g.rank()).div(4);
      auto x = base.to(dtype);
      // Reductions run in float32 and are cast back once.
      auto sum = all_reduce(x, {}, g);
      EXPECT_EQ(sum.scalar_type(), dtype);
      auto want = (at::arange(6, at::kFloat).mul(n).add(n * (n - 1) / 2)).div(4);
      EXPECT_TRUE(at::equal(sum, want.to(dtype)));
      EXPECT_TRUE(at::equal(all_reduce(x, AllReduceOptions().op(ReduceOp::kMax), g),
                            (at::arange(6, at::kFloat).add(n - 1).div(4)).to(dtype)));
      auto rs = reduce_scatter(x, {}, g);
      EXPECT_TRUE(at::equal(rs, want.to(dtype).chunk(n)[g.rank()]));
      // Data movement carries the bytes unchanged.
      auto gathered = all_gather(x, {}, g);
      std::vector<at::Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(at::arange(6, at::kFloat).add(r).div(4).to(dtype));
      EXPECT_TRUE(at::equal(gathered, at::cat(parts)));
      EXPECT_TRUE(at::equal(broadcast(x, BroadcastOptions().src(2), g), parts[2]));
      // Gradients come back in the input's dtype.
      auto leaf = x.detach().clone().requires_grad_(true);
      all_gather(leaf, {}, g).sum().backward();
      EXPECT_EQ(leaf.grad().scalar_type(), dtype);
      EXPECT_TRUE(at::equal(leaf.grad(), at::full({6}, static_cast<float>(n)).to(dtype)));
    }
    // bool, int16 and complex travel too.
    auto flags = at::arange(4).add(g.rank()).remainder(2).to(at::kBool);
    EXPECT_TRUE(at::equal(all_gather(flags, {}, g).to(at::kLong), all_gather(flags.to(at::kLong), {}, g)));
    auto shorts = at::full({3}, g.rank(), at::kShort);
    EXPECT_TRUE(at::equal(broadcast(shorts, BroadcastOptions().src(1), g), at::full({3}, 1, at::kShort)));
    auto c = at::complex(at::ones({2}), at::full({2}, static_cast<float>(g.rank())));
    auto csum = all_reduce(c, {}, g);
    EXPECT_TRUE(at::equal(at::imag(csum), at::full({2}, static_cast<float>(n * (n - 1) / 2))));
  });
}

TEST(OpsErrors, ErrorsAreTypesThatCarryTheirSite) {
  testing::spawn_ranks(2, [](Group& g) {
    auto [kind, site] = typed_error_of<InvalidArgumentError>([&] { reduce_scatter(at::ones({5}), {}, g); });
    EXPECT_EQ(kind, ErrorKind::kInvalidArgument);
    EXPECT_EQ(site.op, "reduce_scatter");
    EXPECT_EQ(site.rank, g.rank());
    EXPECT_EQ(site.group, "world");
    EXPECT_EQ(site.group_size, 2);
    EXPECT_EQ(site.where, g.describe());
    try {
      all_gather(at::ones({}), {}, g);
    } catch (const commgrad::Error& e) {
      EXPECT_TRUE(e.group_usable());
      EXPECT_NE(e.detail().find("the tensor is a scalar"), std::string::npos) << e.detail();
      EXPECT_EQ(e.message(), "[commgrad] all_gather " + g.describe() + ": " + e.detail());
    }
    expect_group_usable(g);
  });
  EXPECT_STREQ(to_string(ErrorKind::kTimeout), "timeout");
}

// ~~~ debug mode: cross-rank fingerprints ~~~

class OpsDebug : public ::testing::Test {
 protected:
  void SetUp() override { set_debug_checks(true); }
  void TearDown() override { set_debug_checks(std::nullopt); }
};

TEST_F(OpsDebug, ShapeMismatchRaisesOnEveryRankWithBothSides) {
  testing::spawn_ranks(2, [](Group& g) {
    ASSERT_TRUE(debug_checks());
    auto x = at::ones({g.rank() == 0 ? 4 : 5});
    const std::string other = g.rank() == 0 ? "rank 1" : "rank 0";
    expect_error([&] { all_reduce(x, {}, g); },
                 {"ranks disagree on collective #0", "this rank (" + std::to_string(g.rank()) + ") calls",
                  "all_reduce(float32[4], op=sum)", "all_reduce(float32[5], op=sum)", other});
    EXPECT_EQ(typed_error_of<MismatchError>([&] { all_reduce(x, {}, g); }).first, ErrorKind::kMismatch);
    expect_group_usable(g);  // nothing mismatched reached the transport
  });
}

TEST_F(OpsDebug, DtypeAndOpMismatch) {
  testing::spawn_ranks(3, [](Group& g) {
    auto x = at::ones({4}, g.rank() == 2 ? at::kDouble : at::kFloat);
    expect_error([&] { all_reduce(x, {}, g); }, {"float32[4]", "float64[4]", "ranks disagree"});
    // Different ops on different ranks.
    expect_error(
        [&] {
          if (g.rank() == 1) {
            all_gather(at::ones({4}), {}, g);
          } else {
            all_reduce(at::ones({4}), AllReduceOptions().op(ReduceOp::kMax), g);
          }
        },
        {"all_gather(float32[4], dim=0)", "all_reduce(float32[4], op=max)", "#1"});
    // Different options of the same op.
    expect_error([&] { broadcast(at::ones({2}), BroadcastOptions().src(g.rank() == 0 ? 1 : 0), g); },
                 {"broadcast(float32[2], src=1)", "broadcast(float32[2], src=0)"});
    expect_group_usable(g);
  });
}

TEST_F(OpsDebug, ListMismatches) {
  testing::spawn_ranks(2, [](Group& g) {
    // Uneven all_gather with different size lists on the two ranks.
    auto sizes = g.rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 1};
    expect_error([&] { all_gather(at::ones({sizes[g.rank()]}), AllGatherOptions().sizes(sizes), g); },
                 {"ranks disagree", "[1, 2]", "[1, 1]"});
    // all_to_all: rank 0 sends 2 rows to rank 1, which expects 1.
    auto in = g.rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 1};
    auto out = std::vector<int64_t>{1, 1};
    const int64_t rows = in[0] + in[1];
    expect_error([&] { all_to_all(at::ones({rows}), AllToAllOptions().input_splits(in).output_splits(out), g); },
                 {"rank 0 sends 2 to rank 1 (input_splits [1, 2]), but rank 1 expects 1 from rank 0"});
    expect_group_usable(g);
  });
}

// The header check never breaks a correct program: two ranks that both
// send first, a ring of sends at 2, 3 and 4 ranks (ring attention), and two
// messages in a row on one tag whose sends are waited last (a pipeline's
// header and data), over Gloo and shm.
TEST_F(OpsDebug, CorrectPointToPointPatternsPass) {
  for (const char* backend : {"gloo", "shm"}) {
    for (int n : {2, 3, 4}) {
      testing::spawn_ranks(
          n,
          [&](Group& g) {
            if (std::getenv("NODEBUG")) set_debug_checks(false);
            const int next = (g.rank() + 1) % n, prev = (g.rank() + n - 1) % n;
            auto sent = raw::send(at::full({3}, float(g.rank())), SendOptions(next).tag(5), g);
            auto got = raw::recv({3}, RecvOptions(prev).tag(5), g).wait();
            sent.wait();
            EXPECT_TRUE(at::equal(got, at::full({3}, float(prev))));
            if (g.rank() == 0) {
              auto header = raw::send(at::full({2}, int64_t{7}), SendOptions(1).tag(2), g);
              auto data = raw::send(at::ones({4, 3}), SendOptions(1).tag(2), g);
              header.wait();
              data.wait();
            } else if (g.rank() == 1) {
              EXPECT_TRUE(at::equal(raw::recv({2}, RecvOptions(0).tag(2).dtype(at::kLong), g).wait(),
                                    at::full({2}, int64_t{7})));
              EXPECT_TRUE(at::equal(raw::recv({4, 3}, RecvOptions(0).tag(2), g).wait(), at::ones({4, 3})));
            }
          },
          testing::SpawnOptions().backend(backend).timeout(std::chrono::seconds(10)));
    }
  }
}

TEST_F(OpsDebug, SendRecvMismatch) {
  testing::spawn_ranks(2, [](Group& g) {
    // The receiver finds it (the sender's send completes: the same bytes).
    if (g.rank() == 0) {
      send(at::ones({4, 3}), SendOptions(1), g);
    } else {
      expect_error(
          [&] {
            recv({3, 4}, RecvOptions(0), g);
          },
          {"recv rank 1/2", "this rank (1) receives float32[3, 4]", "rank 0 sends float32[4, 3]"});
    }
    // A matching pair still goes through.
    if (g.rank() == 0) {
      send(at::full({2}, 3.0f), SendOptions(1), g);
    } else {
      EXPECT_TRUE(at::equal(recv({2}, RecvOptions(0), g), at::full({2}, 3.0f)));
    }
  });
}

TEST_F(OpsDebug, CorrectProgramsPass) {
  testing::spawn_ranks(3, [](Group& g) {
    auto x = at::arange(6, at::kDouble).add(g.rank()).requires_grad_(true);
    auto y = all_to_all(all_gather(x, {}, g), {}, g);
    auto z = reduce_scatter(y, {}, g);
    z.sum().backward();
    EXPECT_TRUE(x.grad().defined());
    std::vector<int64_t> in{static_cast<int64_t>(g.rank()), 1, 0};
    auto w = all_to_all(at::ones({g.rank() + 1}), AllToAllOptions().input_splits(in), g);
    EXPECT_EQ(w.size(0), g.rank() == 2 ? 0 : 3);  // rank 0 gets 0+1+2 rows, rank 1 one from each
  });
}

// ~~~ without debug mode: errors within the timeout, not hangs ~~~

TEST(OpsTimeouts, MissingPeerEndsWithinTheTimeout) {
  // Rank 1 never joins the collective (a peer that is late, stuck, or calls
  // something else): rank 0 gets an error within the group timeout.
  set_debug_checks(false);
  const auto timeout = seconds(2);
  testing::spawn_ranks(
      2,
      [&](Group& g) {
        if (g.rank() == 0) {
          const auto start = std::chrono::steady_clock::now();
          expect_error([&] { all_reduce(at::ones({4}), {}, g); },
                       {"[commgrad] all_reduce rank 0/2 group 'world' (gloo): collective #0",
                        "did not complete within the group timeout (2s)", "COMMGRAD_DEBUG=1"});
          const auto elapsed = std::chrono::steady_clock::now() - start;
          EXPECT_LT(elapsed, timeout + seconds(3));
        } else {
          std::this_thread::sleep_for(timeout + seconds(1));
        }
      },
      testing::SpawnOptions().timeout(timeout));
  set_debug_checks(std::nullopt);
}

TEST(OpsTimeouts, AsyncHandleReportsTheFailure) {
  set_debug_checks(false);
  testing::spawn_ranks(
      2,
      [&](Group& g) {
        if (g.rank() == 0) {
          auto pending = all_gather_async(at::ones({2}), {}, g);
          expect_error([&] { pending.wait(); }, {"all_gather", "collective #0"});
          // And again, the same error of the same type: Gloo says nothing of
          // a timeout, but the wait lasted the group's timeout.
          auto [kind, site] = typed_error_of<TimeoutError>([&] { pending.wait(); });
          EXPECT_EQ(kind, ErrorKind::kTimeout);
          EXPECT_EQ(site.op, "all_gather");
          EXPECT_EQ(site.collective, 0);
          EXPECT_EQ(site.group, "world");
        } else {
          std::this_thread::sleep_for(seconds(3));
        }
      },
      testing::SpawnOptions().timeout(seconds(2)));
  set_debug_checks(std::nullopt);
}

}  // namespace
}  // namespace commgrad::ops
