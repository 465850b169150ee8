// Pipeline schedules in the simulator: every schedule at 1-8 ranks and
// several microbatch counts runs to the end under rendezvous sends (a send
// completes only when its receive is posted), every stage computes every
// microbatch once, and the idle share equals the closed form (also for the
// zero-bubble ZB-H1, whose backward is split into B and W). Plus the
// simulator's own errors: deadlocks, missing inputs, missing work.

#include "harness/expect_error.h"

#include <commgrad/pp/schedule.h>
#include <commgrad/pp/simulator.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::pp {
namespace {

using commgrad::testing::error_of;
using ::testing::HasSubstr;

TEST(ScheduleTest, GpipeAndOneFOneBHaveTheClosedFormBubble) {
  for (int p = 1; p <= 8; ++p) {
    for (int m : {p, p + 1, 2 * p + 1, 4 * p}) {
      for (const auto& s : {gpipe(p, m), one_f_one_b(p, m)}) {
        SCOPED_TRACE(s.name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
        EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true))) << s.describe();
        const auto r = simulate(s);
        EXPECT_DOUBLE_EQ(r.makespan, (m + p - 1) * 3.0);  // forward 1, backward 2
        EXPECT_NEAR(r.bubble_fraction, bubble_fraction_closed_form(p, m), 1e-12);
        for (int k = 0; k < p; ++k) EXPECT_DOUBLE_EQ(r.busy[k], 3.0 * m);
      }
    }
  }
}

TEST(ScheduleTest, OneFOneBKeepsAtMostRanksMicrobatchesInFlight) {
  for (int p = 2; p <= 6; ++p) {
    const int m = 3 * p;
    EXPECT_EQ(simulate(gpipe(p, m)).peak_in_flight, m);
    EXPECT_EQ(simulate(one_f_one_b(p, m)).peak_in_flight, p);
  }
}

TEST(ScheduleTest, InterleavedDividesTheBubbleByTheStagesPerRank) {
  for (int p = 2; p <= 6; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m : {p, 2 * p, 3 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m));
        const auto s = interleaved_one_f_one_b(p, m, v);
        EXPECT_EQ(s.stages(), p * v);
        EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true))) << s.describe();
        const auto r = simulate(s);
        EXPECT_NEAR(r.bubble_fraction, bubble_fraction_closed_form(p, m, v), 1e-12);
        EXPECT_LT(r.bubble_fraction, bubble_fraction_closed_form(p, m) + 1e-12);
      }
    }
  }
}

TEST(ScheduleTest, ZeroBubbleH1HasTheClosedFormBubbleAndOneFOneBsMemory) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = p; m <= 4 * p + 1; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const auto s = make_schedule("zbh1", p, m);
      ASSERT_TRUE(s.splits_backward());
      EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true))) << s.describe();
      // F, B and W cost 1 each (a whole backward 2, as for the other schedules).
      const auto r = simulate(s);
      EXPECT_DOUBLE_EQ(r.makespan, 3.0 * m + p - 1);
      EXPECT_NEAR(r.bubble_fraction, bubble_fraction_closed_form("zbh1", p, m), 1e-12);
      if (p > 1) {
        EXPECT_LT(r.bubble_fraction, bubble_fraction_closed_form(p, m) / 2);
      }
      for (int k = 0; k < p; ++k) EXPECT_DOUBLE_EQ(r.busy[k], 3.0 * m);
      EXPECT_LE(r.peak_in_flight, p);  // between F and B: as 1F1B
      EXPECT_LE(r.peak_awaiting_weight, p);
      // Each W comes after its own B, and each rank's Ws keep the microbatch order.
      for (int k = 0; k < p; ++k) {
        int next_w = 0;
        for (const auto& a : s.actions[k]) {
          if (a.kind == ActionKind::kBackwardWeight) {
            EXPECT_EQ(a.microbatch, next_w++) << s.describe();
          }
        }
        EXPECT_EQ(next_w, m);
      }
    }
  }
  // Other costs: the same order reaches the closed form while W <= B.
  for (const auto& costs : {SimulationOptions().forward(1.0).backward(2.2).backward_weight(0.8),
                            SimulationOptions().forward(54).backward(91).backward_weight(34),
                            SimulationOptions().forward(1.0).backward(2.0).backward_weight(0.5)}) {
    for (int p : {2, 3, 4, 8}) {
      for (int m : {p, 2 * p + 1, 4 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " W=" + std::to_string(costs.backward_weight()));
        const auto r = simulate(zero_bubble_h1(p, m), costs);
        EXPECT_NEAR(r.bubble_fraction, bubble_fraction_closed_form("zbh1", p, m, 1, costs), 1e-12);
        EXPECT_LT(r.bubble_fraction, simulate(one_f_one_b(p, m), costs).bubble_fraction);
      }
    }
  }
  EXPECT_EQ(simulate(one_f_one_b(4, 8)).peak_awaiting_weight, 0);
}

TEST(ScheduleTest, ZeroBubbleH1FillsTheCooldownWithW) {
  // Rank 1 runs W1.0 while the third activation is on its way, rank 0 its
  // Ws while it waits for gradients, and both end with the rest.
  EXPECT_EQ(zero_bubble_h1(2, 3).describe(),
            "rank 0: F0.0 sendA0.0 F0.1 [sendA0.1 recvG0.0] B0.0 F0.2 [sendA0.2 recvG0.1] B0.1 W0.0 W0.1 recvG0.2 "
            "B0.2 W0.2\n"
            "rank 1: recvA1.0 F1.0 B1.0 [sendG1.0 recvA1.1] F1.1 B1.1 sendG1.1 W1.0 recvA1.2 F1.2 B1.2 sendG1.2 W1.1 "
            "W1.2\n");
}

TEST(ScheduleTest, CommunicationIsDerivedAndBatched) {
  const auto s = one_f_one_b(2, 2);
  // Rank 0 posts each send with the receive its next computation needs.
  EXPECT_EQ(s.describe(),
            "rank 0: F0.0 sendA0.0 F0.1 [sendA0.1 recvG0.0] B0.0 recvG0.1 B0.1\n"
            "rank 1: recvA1.0 F1.0 B1.0 [sendG1.0 recvA1.1] F1.1 B1.1 sendG1.1\n");
}

TEST(ScheduleTest, BadSizesAreErrors) {
  EXPECT_THAT(
      error_of([] { one_f_one_b(4, 3); }),
      HasSubstr("1f1b: 3 microbatches for 4 pipeline ranks; a pipeline needs at least one microbatch per rank"));
  EXPECT_THAT(error_of([] { interleaved_one_f_one_b(4, 6, 2); }),
              HasSubstr("interleaved: 6 microbatches do not split into groups of 4"));
  EXPECT_THAT(error_of([] { make_schedule("zero-bubble", 2, 4); }),
              HasSubstr("unknown schedule \"zero-bubble\" (gpipe, 1f1b, interleaved, zbh1)"));
  EXPECT_THAT(error_of([] { make_schedule("gpipe", 2, 4, 2); }), HasSubstr("gpipe runs one stage per rank"));
  EXPECT_THAT(error_of([] { make_schedule("zbh1", 2, 4, 2); }), HasSubstr("zbh1 runs one stage per rank"));
  EXPECT_THAT(error_of([] { zero_bubble_h1(3, 2); }), HasSubstr("zbh1: 2 microbatches for 3 pipeline ranks"));
  EXPECT_THAT(error_of([] { bubble_fraction_closed_form("zb", 2, 4); }), HasSubstr("unknown schedule \"zb\""));
  EXPECT_THAT(error_of([] { simulate(zero_bubble_h1(2, 2), SimulationOptions().backward_weight(3)); }),
              HasSubstr("backward_weight (3.000000) must lie between 0 and backward (2.000000)"));
}

TEST(ScheduleTest, TheSimulatorFindsDeadlocks) {
  // Both ranks receive before they send: each waits for the other.
  auto s = gpipe(2, 2);
  s.actions[0] = {{ActionKind::kForward, 0, 0},
                  {ActionKind::kRecvGradient, 0, 0},
                  {ActionKind::kSendActivation, 0, 0},
                  {ActionKind::kBackward, 0, 0}};
  s.actions[1] = {{ActionKind::kSendGradient, 1, 0}};
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("sends a gradient not computed yet"));
  s.actions[1] = {{ActionKind::kRecvActivation, 1, 0},
                  {ActionKind::kForward, 1, 0},
                  {ActionKind::kBackward, 1, 0},
                  {ActionKind::kSendGradient, 1, 0}};
  EXPECT_THAT(
      error_of([&] { simulate(s); }),
      HasSubstr("the schedule deadlocks:\n  rank 0 action 1 (recvG0.0) waits\n  rank 1 action 0 (recvA1.0) waits"));
  // Two sends first: buffered they pass, unbuffered each waits for the other.
  s.actions[0] = {{ActionKind::kForward, 0, 0},
                  {ActionKind::kSendActivation, 0, 0},
                  {ActionKind::kRecvGradient, 0, 0},
                  {ActionKind::kBackward, 0, 0}};
  s.actions[1] = {{ActionKind::kRecvActivation, 1, 0},
                  {ActionKind::kForward, 1, 0},
                  {ActionKind::kBackward, 1, 0},
                  {ActionKind::kSendGradient, 1, 0}};
  s.microbatches = 1;
  EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true)));
  s.actions[1] = {{ActionKind::kForward, 1, 0}};
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("(F1.0) runs before its activation was received"));
}

TEST(ScheduleTest, TheSimulatorFindsDeadlocksOfSendsThatWaitForTheirReceive) {
  // Each rank sends before it receives, in batches of their own: rank 0
  // sends microbatch 1's activation while rank 1 sends microbatch 0's
  // gradient. Buffered, both sends complete and the schedule runs; when a
  // send completes only once received, each waits for the other.
  using K = ActionKind;
  auto s = gpipe(2, 2);
  s.actions[0] = {{K::kForward, 0, 0},        {K::kSendActivation, 0, 0}, {K::kForward, 0, 1},
                  {K::kSendActivation, 0, 1}, {K::kRecvGradient, 0, 0},   {K::kBackward, 0, 0},
                  {K::kRecvGradient, 0, 1},   {K::kBackward, 0, 1}};
  s.actions[1] = {{K::kRecvActivation, 1, 0}, {K::kForward, 1, 0}, {K::kBackward, 1, 0}, {K::kSendGradient, 1, 0},
                  {K::kRecvActivation, 1, 1}, {K::kForward, 1, 1}, {K::kBackward, 1, 1}, {K::kSendGradient, 1, 1}};
  const auto buffered = simulate(s);
  EXPECT_GT(buffered.makespan, 0);
  EXPECT_THAT(error_of([&] { simulate(s, SimulationOptions().rendezvous_sends(true)); }),
              HasSubstr("the schedule deadlocks when sends complete only once received:\n  rank 0 action 3 (sendA0.1) "
                        "waits\n  rank 1 action 3 (sendG1.0) waits"));
  // Posted together with the receive that follows (as the generated
  // schedules post them), the same order runs under both rules.
  s.actions[0][3].batched_with_next = true;
  s.actions[1][3].batched_with_next = true;
  EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true)));
}

TEST(ScheduleTest, TheSimulatorFindsMissingInputsAndWork) {
  auto s = one_f_one_b(2, 2);
  s.actions[1].erase(s.actions[1].begin());  // rank 1 computes before receiving
  EXPECT_THAT(error_of([&] { simulate(s); }),
              HasSubstr("rank 1 action 0 (F1.0) runs before its activation was received"));
  auto t = gpipe(1, 2);
  t.actions[0].pop_back();
  EXPECT_THAT(error_of([&] { simulate(t); }), HasSubstr("no rank runs B0.1"));
  auto u = gpipe(1, 1);
  u.actions[0].push_back({ActionKind::kBackward, 0, 0});
  EXPECT_THAT(error_of([&] { simulate(u); }), HasSubstr("runs twice"));
  auto z = zero_bubble_h1(1, 2);
  std::swap(z.actions[0][1], z.actions[0][2]);  // F0.0 W0.0 B0.0 ...
  EXPECT_THAT(error_of([&] { simulate(z); }), HasSubstr("(W0.0) runs before the backward of the same microbatch"));
  z = zero_bubble_h1(1, 2);
  z.actions[0].pop_back();
  EXPECT_THAT(error_of([&] { simulate(z); }), HasSubstr("no rank runs W0.1"));
  auto w = gpipe(2, 2);
  w.actions[0][0].stage = 1;
  EXPECT_THAT(error_of([&] { simulate(w); }), HasSubstr("rank 0 action 0 (F1.0) is not a stage of this rank"));
}

}  // namespace
}  // namespace commgrad::pp
