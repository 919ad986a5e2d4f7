// The elastic protocol's state machine (collectives/elastic/elastic_log.h), fed entries directly:
// when each round's quorum and outcome are decided, and what they are.

#include "collectives/elastic/elastic_log.h"

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace shardline::elastic {
namespace {

using Members = std::vector<std::pair<int, int>>;

void ArriveAll(ElasticLog& log, int64_t round, const std::vector<std::pair<int, int>>& replicas) {
  for (const auto& [replica, incarnation] : replicas) {
    for (int s = 0; s < log.shard_size(); ++s) {
      log.Apply(Entry::Arrive(round, replica, s, incarnation));
    }
  }
}

void VoteAll(ElasticLog& log, int64_t round, const std::vector<std::pair<int, int>>& replicas) {
  for (const auto& [replica, incarnation] : replicas) {
    for (int s = 0; s < log.shard_size(); ++s) {
      log.Apply(Entry::Vote(round, replica, s, incarnation, true));
    }
  }
}

TEST(ElasticLogTest, EntriesRoundTripAndGarbageIsRefused) {
  const std::vector<Entry> entries = {Entry::Arrive(3, 1, 0, 2),
                                      Entry::Vote(3, 1, 0, 2, true),
                                      Entry::Vote(4, 0, 1, 0, false),
                                      Entry::Lost(1, 1, 7),
                                      Entry::Timeout(5, Phase::kQuorum, 0, 1),
                                      Entry::Timeout(5, Phase::kCommit, 1, 0)};
  for (const Entry& entry : entries) {
    absl::StatusOr<Entry> back = Entry::Decode(entry.Encode());
    ASSERT_TRUE(back.ok()) << entry.Encode() << ": " << back.status();
    EXPECT_EQ(back->Encode(), entry.Encode());
  }
  EXPECT_EQ(Entry::Vote(3, 1, 0, 2, true).Encode(), "vote 3 1 0 2 ok");
  for (const char* garbage :
       {"", "arrive", "arrive 1 2 3", "arrive 1 2 3 x", "vote 1 2 3 4 maybe", "lost -1 0 0",
        "timeout 1 later 0 0", "arrive 1 2 3 4 5", "lost 1 0 99999999999"}) {
    EXPECT_FALSE(Entry::Decode(garbage).ok()) << "'" << garbage << "'";
  }
}

TEST(ElasticLogTest, AQuorumRoundTripsThroughItsText) {
  Quorum quorum;
  quorum.round = 7;
  quorum.step = 5;
  quorum.rebuild = true;
  quorum.members = {{0, 0}, {2, 3}};
  quorum.joiners = {2};
  quorum.reason = "every expected replica arrived or was lost";
  absl::StatusOr<Quorum> back = Quorum::Decode(quorum.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->round, 7);
  EXPECT_EQ(back->step, 5);
  EXPECT_TRUE(back->rebuild);
  EXPECT_EQ(back->members, quorum.members);
  EXPECT_EQ(back->joiners, quorum.joiners);
  EXPECT_EQ(back->reason, quorum.reason);
  Quorum empty;
  empty.rebuild = false;
  back = Quorum::Decode(empty.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->members.empty() && back->joiners.empty() && !back->rebuild);
  for (const char* garbage : {"", "1 2 3", "1 2 0 0-0 - x", "1 2 0 - a,b why", "x 2 0 - - why"}) {
    EXPECT_FALSE(Quorum::Decode(garbage).ok()) << garbage;
  }
}

TEST(ElasticLogTest, AFullRoundCommitsAndTheNextKeepsItsCommunicators) {
  ElasticLog log(/*replicas=*/2, /*shard_size=*/2);
  const Members all = {{0, 0}, {1, 0}};
  log.Apply(Entry::Arrive(0, 0, 0, 0));
  log.Apply(Entry::Arrive(0, 1, 1, 0));
  log.Apply(Entry::Arrive(0, 0, 1, 0));
  EXPECT_EQ(log.quorum(0), nullptr) << "replica 1 is still expected";
  log.Apply(Entry::Arrive(0, 1, 0, 0));
  ASSERT_NE(log.quorum(0), nullptr);
  EXPECT_EQ(log.quorum(0)->members, all);
  EXPECT_TRUE(log.quorum(0)->joiners.empty());
  EXPECT_TRUE(log.quorum(0)->rebuild);
  EXPECT_EQ(log.phase(), Phase::kCommit);
  log.Apply(Entry::Vote(0, 0, 0, 0, true));
  log.Apply(Entry::Vote(0, 0, 1, 0, true));
  log.Apply(Entry::Vote(0, 1, 0, 0, true));
  EXPECT_FALSE(log.outcome(0).has_value());
  log.Apply(Entry::Vote(0, 1, 1, 0, true));
  ASSERT_TRUE(log.outcome(0).has_value());
  EXPECT_TRUE(*log.outcome(0));
  EXPECT_EQ(log.committed_steps(), 1);
  EXPECT_EQ(log.round(), 1);
  ArriveAll(log, 1, all);
  ASSERT_NE(log.quorum(1), nullptr);
  EXPECT_FALSE(log.quorum(1)->rebuild);
  EXPECT_EQ(log.quorum(1)->step, 1);
}

TEST(ElasticLogTest, ALostRankAbortsTheRoundAndItsReplicaSitsOutTheRedo) {
  ElasticLog log(2, 2);
  const Members all = {{0, 0}, {1, 0}};
  ArriveAll(log, 0, all);
  log.Apply(Entry::Vote(0, 0, 0, 0, true));
  log.Apply(Entry::Lost(1, 0, 0));
  ASSERT_TRUE(log.outcome(0).has_value());
  EXPECT_FALSE(*log.outcome(0));
  EXPECT_EQ(log.abort_reason(0), "rank (1, 0) incarnation 0 was lost");
  // Late votes of the aborted round change nothing.
  log.Apply(Entry::Vote(0, 0, 1, 0, true));
  EXPECT_EQ(log.committed_steps(), 0);
  // The redo: replica 0 alone; the survivor of replica 1 arriving does not hold it up and is
  // not a member.
  log.Apply(Entry::Arrive(1, 1, 1, 0));
  log.Apply(Entry::Arrive(1, 0, 0, 0));
  EXPECT_EQ(log.quorum(1), nullptr);
  log.Apply(Entry::Arrive(1, 0, 1, 0));
  ASSERT_NE(log.quorum(1), nullptr);
  EXPECT_EQ(log.quorum(1)->members, (Members{{0, 0}}));
  EXPECT_FALSE(log.quorum(1)->IsMember(1, 0));
  EXPECT_TRUE(log.quorum(1)->rebuild);
  EXPECT_EQ(log.quorum(1)->step, 0) << "the aborted step is redone";
  VoteAll(log, 1, {{0, 0}});
  EXPECT_TRUE(*log.outcome(1));
  EXPECT_EQ(log.committed_steps(), 1);
}

TEST(ElasticLogTest, AFailVoteOrATimeoutAbortsAndTheMembersStay) {
  ElasticLog log(2, 1);
  const Members all = {{0, 0}, {1, 0}};
  ArriveAll(log, 0, all);
  log.Apply(Entry::Vote(0, 1, 0, 0, false));
  EXPECT_FALSE(*log.outcome(0));
  EXPECT_EQ(log.abort_reason(0), "rank (1, 0) voted fail");
  ArriveAll(log, 1, all);
  EXPECT_EQ(log.quorum(1)->members, all);
  EXPECT_TRUE(log.quorum(1)->rebuild) << "the aborted round's collectives were aborted";
  log.Apply(Entry::Vote(1, 0, 0, 0, true));
  log.Apply(Entry::Timeout(1, Phase::kCommit, 0, 0));
  EXPECT_FALSE(*log.outcome(1));
  EXPECT_EQ(log.abort_reason(1), "rank (0, 0) timed out waiting for the votes");
}

TEST(ElasticLogTest, AQuorumTimeoutDecidesWithTheCompleteReplicas) {
  ElasticLog log(3, 2);
  ArriveAll(log, 0, {{0, 0}, {2, 0}});
  log.Apply(Entry::Arrive(0, 1, 0, 0));
  EXPECT_EQ(log.quorum(0), nullptr);
  // A timeout of another round or phase does not count.
  log.Apply(Entry::Timeout(0, Phase::kCommit, 0, 0));
  log.Apply(Entry::Timeout(1, Phase::kQuorum, 0, 0));
  EXPECT_EQ(log.quorum(0), nullptr);
  log.Apply(Entry::Timeout(0, Phase::kQuorum, 2, 1));
  ASSERT_NE(log.quorum(0), nullptr);
  EXPECT_EQ(log.quorum(0)->members, (Members{{0, 0}, {2, 0}}));
  EXPECT_EQ(log.quorum(0)->reason, "rank (2, 1) timed out waiting for the quorum");
  // Replica 1 missed it: it is not expected again (the next quorum does not wait for it).
  VoteAll(log, 0, {{0, 0}, {2, 0}});
  ArriveAll(log, 1, {{0, 0}, {2, 0}});
  ASSERT_NE(log.quorum(1), nullptr);
  EXPECT_FALSE(log.quorum(1)->rebuild);
}

TEST(ElasticLogTest, ARestartedReplicaJoinsWithANewIncarnation) {
  ElasticLog log(2, 2);
  ArriveAll(log, 0, {{0, 0}, {1, 0}});
  log.Apply(Entry::Lost(1, 1, 0));
  EXPECT_FALSE(*log.outcome(0));
  // The restarted group arrives early, while the survivors still redo without it... only one
  // of its ranks so far: round 1 does not wait for it.
  log.Apply(Entry::Arrive(1, 1, 0, 1));
  ArriveAll(log, 1, {{0, 0}});
  ASSERT_NE(log.quorum(1), nullptr);
  EXPECT_EQ(log.quorum(1)->members, (Members{{0, 0}}));
  VoteAll(log, 1, {{0, 0}});
  // Round 2: both of its ranks arrive: it joins.
  ArriveAll(log, 2, {{1, 1}});
  EXPECT_EQ(log.quorum(2), nullptr) << "the members are expected first";
  ArriveAll(log, 2, {{0, 0}});
  ASSERT_NE(log.quorum(2), nullptr);
  EXPECT_EQ(log.quorum(2)->members, (Members{{0, 0}, {1, 1}}));
  EXPECT_EQ(log.quorum(2)->joiners, std::vector<int>{1});
  EXPECT_TRUE(log.quorum(2)->rebuild);
  EXPECT_EQ(log.quorum(2)->step, 1);
  VoteAll(log, 2, {{0, 0}, {1, 1}});
  ArriveAll(log, 3, {{0, 0}, {1, 1}});
  EXPECT_TRUE(log.quorum(3)->joiners.empty());
  EXPECT_FALSE(log.quorum(3)->rebuild);
}

TEST(ElasticLogTest, LosingEveryReplicaLeavesAQuorumWithoutMembers) {
  ElasticLog log(2, 1);
  ArriveAll(log, 0, {{0, 0}, {1, 0}});
  log.Apply(Entry::Lost(0, 0, 0));
  log.Apply(Entry::Lost(1, 0, 0));
  ASSERT_NE(log.quorum(1), nullptr);
  EXPECT_TRUE(log.quorum(1)->members.empty());
  EXPECT_TRUE(log.job_lost());
  // Final: a late arrival decides nothing.
  log.Apply(Entry::Arrive(2, 0, 0, 1));
  EXPECT_EQ(log.quorum(2), nullptr);
}

// Entries of ranks racing each other land in some order; whatever the order, every reader of
// one log decides the same, and a round's decision does not depend on entries after it.
TEST(ElasticLogTest, DecisionsDependOnlyOnThePrefixOfTheLog) {
  std::mt19937 rng(2026);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<Entry> entries;
    for (int r = 0; r < 3; ++r) {
      for (int s = 0; s < 2; ++s) entries.push_back(Entry::Arrive(0, r, s, 0));
    }
    for (int r = 0; r < 3; ++r) {
      for (int s = 0; s < 2; ++s) entries.push_back(Entry::Vote(0, r, s, 0, true));
    }
    entries.push_back(Entry::Lost(rng() % 3, rng() % 2, 0));
    std::shuffle(entries.begin(), entries.end(), rng);
    ElasticLog whole(3, 2);
    for (const Entry& entry : entries) whole.Apply(entry);
    // Replaying any prefix reproduces the decisions made within it.
    const size_t cut = rng() % (entries.size() + 1);
    ElasticLog prefix(3, 2);
    for (size_t i = 0; i < cut; ++i) prefix.Apply(entries[i]);
    if (prefix.quorum(0) != nullptr) {
      ASSERT_NE(whole.quorum(0), nullptr);
      EXPECT_EQ(prefix.quorum(0)->members, whole.quorum(0)->members);
    }
    if (prefix.outcome(0).has_value()) {
      EXPECT_EQ(*prefix.outcome(0), *whole.outcome(0));
    }
    // A round with a lost member never commits; one without every vote never does either.
    if (whole.outcome(0).has_value() && *whole.outcome(0)) {
      for (const auto& [replica, incarnation] : whole.quorum(0)->members) {
        for (int s = 0; s < 2; ++s) {
          if (whole.lost(replica, s, incarnation)) {
            // Lost after the commit was decided: allowed. Then the loss came after every vote.
            size_t lost_at = 0, last_vote = 0;
            for (size_t i = 0; i < entries.size(); ++i) {
              if (entries[i].kind == Entry::Kind::kLost) lost_at = i;
              if (entries[i].kind == Entry::Kind::kVote) last_vote = i;
            }
            EXPECT_GT(lost_at, last_vote);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardline::elastic
