// Pipeline schedules in the simulator: every schedule at 1-8 ranks and
// several microbatch counts runs to the end under rendezvous sends (a send
// completes only when its receive is posted), every stage computes every
// microbatch once, and the idle share equals the closed form. Plus the
// simulator's own errors: deadlocks, missing inputs, missing work.

#include <commgrad/pp/schedule.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::pp {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

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

TEST(ScheduleTest, CommunicationIsDerivedAndBatched) {
  const auto s = one_f_one_b(2, 2);
  // Rank 0 posts each send with the receive its next computation needs.
  EXPECT_EQ(s.describe(),
            "rank 0: F0.0 sendA0.0 F0.1 [sendA0.1 recvG0.0] B0.0 recvG0.1 B0.1\n"
            "rank 1: recvA1.0 F1.0 B1.0 [sendG1.0 recvA1.1] F1.1 B1.1 sendG1.1\n");
}

TEST(ScheduleTest, BadSizesAreErrors) {
  EXPECT_THAT(error_of([] { one_f_one_b(4, 3); }),
              HasSubstr("1f1b: 3 microbatches for 4 pipeline ranks; a pipeline needs at least one microbatch per rank"));
  EXPECT_THAT(error_of([] { interleaved_one_f_one_b(4, 6, 2); }),
              HasSubstr("interleaved: 6 microbatches do not split into groups of 4"));
  EXPECT_THAT(error_of([] { make_schedule("zero-bubble", 2, 4); }),
              HasSubstr("unknown schedule \"zero-bubble\" (gpipe, 1f1b, interleaved)"));
  EXPECT_THAT(error_of([] { make_schedule("gpipe", 2, 4, 2); }), HasSubstr("gpipe runs one stage per rank"));
}

TEST(ScheduleTest, TheSimulatorFindsDeadlocks) {
  // Both ranks receive before they send: each waits for the other.
  auto s = gpipe(2, 2);
  s.actions[0] = {{ActionKind::kForward, 0, 0}, {ActionKind::kRecvGradient, 0, 0}, {ActionKind::kSendActivation, 0, 0},
                  {ActionKind::kBackward, 0, 0}};
  s.actions[1] = {{ActionKind::kSendGradient, 1, 0}};
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("sends a gradient not computed yet"));
  s.actions[1] = {{ActionKind::kRecvActivation, 1, 0}, {ActionKind::kForward, 1, 0}, {ActionKind::kBackward, 1, 0},
                  {ActionKind::kSendGradient, 1, 0}};
  EXPECT_THAT(error_of([&] { simulate(s); }),
              HasSubstr("the schedule deadlocks:\n  rank 0 action 1 (recvG0.0) waits\n  rank 1 action 0 (recvA1.0) waits"));
  // Two sends first: buffered they pass, unbuffered each waits for the other.
  s.actions[0] = {{ActionKind::kForward, 0, 0}, {ActionKind::kSendActivation, 0, 0}, {ActionKind::kRecvGradient, 0, 0},
                  {ActionKind::kBackward, 0, 0}};
  s.actions[1] = {{ActionKind::kRecvActivation, 1, 0}, {ActionKind::kForward, 1, 0}, {ActionKind::kBackward, 1, 0},
                  {ActionKind::kSendGradient, 1, 0}};
  s.microbatches = 1;
  EXPECT_NO_THROW(simulate(s, SimulationOptions().rendezvous_sends(true)));
  s.actions[1] = {{ActionKind::kForward, 1, 0}};
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("(F1.0) runs before its activation was received"));
}

TEST(ScheduleTest, TheSimulatorFindsMissingInputsAndWork) {
  auto s = one_f_one_b(2, 2);
  s.actions[1].erase(s.actions[1].begin());  // rank 1 computes before receiving
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("rank 1 action 0 (F1.0) runs before its activation was received"));
  auto t = gpipe(1, 2);
  t.actions[0].pop_back();
  EXPECT_THAT(error_of([&] { simulate(t); }), HasSubstr("no rank runs B0.1"));
  auto u = gpipe(1, 1);
  u.actions[0].push_back({ActionKind::kBackward, 0, 0});
  EXPECT_THAT(error_of([&] { simulate(u); }), HasSubstr("runs twice"));
  auto w = gpipe(2, 2);
  w.actions[0][0].stage = 1;
  EXPECT_THAT(error_of([&] { simulate(w); }), HasSubstr("rank 0 action 0 (F1.0) is not a stage of this rank"));
}

}  // namespace
}  // namespace commgrad::pp
