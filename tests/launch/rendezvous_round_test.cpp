// The rules of one round of commgrad-run's elastic rendezvous (--nnodes
// MIN:MAX; tools/run/rendezvous_round.h): when a round closes, when it fails,
// and the lines the node agents exchange. The sockets are tested end to end
// in elastic_test.cpp.

#include "rendezvous_round.h"

#include <gtest/gtest.h>

namespace commgrad::run {
namespace {

TEST(RendezvousRound, ClosesAtOnceWhenMaxNodesJoined) {
  RoundState round(RoundRule{1, 2, 600, 30}, 0);
  round.joined(0);
  EXPECT_EQ(round.decide(0).verdict, RoundVerdict::kWait);
  round.joined(1);
  EXPECT_EQ(round.decide(1).verdict, RoundVerdict::kClose);
  EXPECT_EQ(round.nodes(), 2);
}

TEST(RendezvousRound, WithMinNodesWaitsOutTheLastCallFromWhenMinWasReached) {
  RoundState round(RoundRule{2, 4, 600, 10}, 0);
  round.joined(0);
  round.joined(5);  // MIN reached at 5: the last call runs until 15
  RoundDecision d = round.decide(6);
  EXPECT_EQ(d.verdict, RoundVerdict::kWait);
  EXPECT_DOUBLE_EQ(d.wait_s, 9);
  round.joined(7);  // a third node does not extend it
  EXPECT_EQ(round.decide(14.9).verdict, RoundVerdict::kWait);
  EXPECT_EQ(round.decide(15).verdict, RoundVerdict::kClose);
  EXPECT_EQ(round.nodes(), 3);
}

TEST(RendezvousRound, ANodeThatLeavesBelowMinRestartsTheLastCall) {
  RoundState round(RoundRule{2, 3, 600, 10}, 0);
  round.joined(0);
  round.joined(1);
  round.left(2);  // below MIN again
  EXPECT_EQ(round.decide(20).verdict, RoundVerdict::kWait);
  round.joined(30);
  EXPECT_EQ(round.decide(39).verdict, RoundVerdict::kWait);
  EXPECT_EQ(round.decide(40).verdict, RoundVerdict::kClose);
}

TEST(RendezvousRound, FailsWhenFewerThanMinJoinWithinTheJoinTimeout) {
  RoundState round(RoundRule{2, 2, 5, 30}, 100);
  round.joined(100);
  RoundDecision d = round.decide(101);
  EXPECT_EQ(d.verdict, RoundVerdict::kWait);
  EXPECT_DOUBLE_EQ(d.wait_s, 4);
  EXPECT_EQ(round.decide(105).verdict, RoundVerdict::kFail);
  EXPECT_EQ(round.failure(), "1 of at least 2 nodes joined within --rdzv-join-timeout 5s");
}

TEST(RendezvousRound, ALastCallOfZeroClosesAsSoonAsMinJoined) {
  RoundState round(RoundRule{1, 8, 600, 0}, 0);
  round.joined(0);
  EXPECT_EQ(round.decide(0).verdict, RoundVerdict::kClose);
}

TEST(RendezvousRound, JoinLinesOfAnotherJobOrAnotherRankCountAreRefused) {
  EXPECT_EQ(refusal(join_line("job_a", 2), "job_a", 2), std::nullopt);
  EXPECT_EQ(refusal(join_line("", 2), "", 2), std::nullopt);
  EXPECT_EQ(*refusal(join_line("job_b", 2), "job_a", 2),
            "the rendezvous belongs to another job (--rdzv-id 'job_a'; this node has 'job_b')");
  EXPECT_EQ(*refusal(join_line("job_a", 4), "job_a", 2),
            "every node must start the same number of ranks: the rendezvous host has -n 2, this node -n 4");
  EXPECT_EQ(*refusal("GET / HTTP/1.1", "job_a", 2), "not a commgrad-run of this version (it sent 'GET / HTTP/1.1')");
}

TEST(RendezvousRound, AnswersRoundTrip) {
  std::string error;
  const auto a = parse_answer(assignment_line({3, 1, 2, 29500}), &error);
  ASSERT_TRUE(a) << error;
  EXPECT_EQ(a->round, 3);
  EXPECT_EQ(a->node_rank, 1);
  EXPECT_EQ(a->nodes, 2);
  EXPECT_EQ(a->port, 29500);
  EXPECT_FALSE(parse_answer(failure_line("1 of at least 2 nodes joined"), &error));
  EXPECT_EQ(error, "1 of at least 2 nodes joined");
  EXPECT_FALSE(parse_answer(assignment_line({1, 2, 2, 29500}), &error));  // node rank outside the round
  EXPECT_EQ(error, "the rendezvous answered 'commgrad-rdzv 1 round 1 2 2 29500', which is not a round");
  EXPECT_FALSE(parse_answer("hello", &error));
  EXPECT_EQ(error, "the rendezvous answered 'hello' (not a commgrad-run of this version?)");
}

}  // namespace
}  // namespace commgrad::run
