// ElasticGroup (collectives/elastic/elastic_group.h) with its ranks as threads over UCX and one
// MemoryStore: a toy data-parallel training whose gradient average runs over each round's
// replicate group. A rank of replica 1 "dies" mid-step (it reports itself lost, as the store's
// server does for a dead process, and aborts its communicators); the other replica redoes the step
// alone and trains on; a new incarnation of replica 1 joins, receives the state, and trains with
// identical parameters. Checked against a plain-loop reference of the same averages.

#include "collectives/elastic/elastic_group.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "collectives/store/memory_store.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace shardline {
namespace {

constexpr int kReplicas = 2;
constexpr int kShards = 2;
constexpr int kSteps = 6;
constexpr int kKillStep = 2;  // replica 1, shard 0, incarnation 0 dies in this step
constexpr float kLearningRate = 0.25f;

size_t Elements(int shard) { return 37 + 6 * static_cast<size_t>(shard); }

float Hashed(uint64_t a, uint64_t b, uint64_t i) {
  uint64_t x = (a << 48) ^ (b << 32) ^ i;
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / (1ull << 23) - 1.0);
}

std::vector<float> Initial(int shard) {
  std::vector<float> v(Elements(shard));
  for (size_t i = 0; i < v.size(); ++i) v[i] = Hashed(99, shard, i);
  return v;
}

// The gradient replica r computes for its shard at step `step` (its "data" differs by replica).
std::vector<float> Gradient(int64_t step, int replica, int shard) {
  std::vector<float> g(Elements(shard));
  for (size_t i = 0; i < g.size(); ++i) g[i] = Hashed(step + 1, replica * 16 + shard + 1, i);
  return g;
}

struct StepRecord {
  std::vector<int> replicas;
  std::vector<float> params;  // after the step's update
};

struct RankResult {
  absl::Status status;  // OK: trained to the end
  std::map<int64_t, StepRecord> steps;
  std::vector<ElasticRecovery> recoveries;
  bool joined = false;
};

class ElasticGroupTest : public ::testing::Test {
 protected:
  ElasticOptions Options(int replica, int shard, int incarnation) {
    ElasticOptions o;
    o.store = store_;
    o.replicas = kReplicas;
    o.shard_size = kShards;
    o.replica = replica;
    o.shard = shard;
    o.incarnation = incarnation;
    o.timeout = absl::Seconds(20);
    o.watch_liveness = false;
    return o;
  }

  // One rank's training loop. `dies_at`: the step in which this rank dies (-1: never).
  RankResult Train(int replica, int shard, int incarnation, int64_t dies_at) {
    RankResult result;
    const absl::Time deadline = absl::Now() + absl::Seconds(90);
    ElasticOptions options = Options(replica, shard, incarnation);
    if (replica == 0 && shard == 0) options.trace = &trace_;
    absl::StatusOr<std::unique_ptr<ElasticGroup>> joined = ElasticGroup::Join(options, deadline);
    if (!joined.ok()) {
      result.status = joined.status();
      return result;
    }
    ElasticGroup& group = **joined;
    std::vector<float> params = Initial(shard);
    int64_t step = 0;
    while (group.committed_steps() < kSteps) {
      // The survivors hold the next round until the restarted group has arrived, so that it
      // joins before training ends (the toy's steps take a millisecond): AwaitJoiner.
      if (replica == 0 && group.committed_steps() == kSteps / 2 + 1) {
        const absl::Status joiner = group.AwaitJoiner(absl::Now() + absl::Seconds(60));
        EXPECT_TRUE(joiner.ok()) << joiner;
      }
      absl::StatusOr<ElasticGroup::Round> round = group.BeginRound(deadline);
      if (!round.ok()) {
        result.status = round.status();
        break;
      }
      if (!round->joiners.empty()) {
        const StatePiece pieces[] = {{params.data(), params.size() * sizeof(float)},
                                     {&step, sizeof(step)}};
        result.joined |= round->joining;
        absl::Status moved = group.TransferState(pieces, deadline);
        if (!moved.ok()) {
          result.status = moved;
          break;
        }
      }
      EXPECT_EQ(step, round->step) << "rank (" << replica << ", " << shard << ")";
      // A failed collective poisons its stream for good: each round gets its own (as a rebuilt
      // scheduler gets new streams).
      absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "toy"});
      if (!stream.ok()) {
        result.status = stream.status();
        break;
      }
      if (round->step == dies_at) {
        // Death: the store would append `lost` when the process's connection closes; its
        // sockets closing reach the peers as errors.
        EXPECT_TRUE(group.ReportLost().ok());
        const absl::Status killed = absl::UnavailableError("killed");
        round->shard->Abort(killed);
        round->replicate->Abort(killed);
        result.status = killed;
        return result;
      }
      // The step: a loss summed over the shard group (as a gradient norm would be), and the
      // gradient averaged over the round's replicas.
      std::vector<float> grad = Gradient(round->step, replica, shard);
      float loss = grad[0];
      absl::Status status = [&]() -> absl::Status {
        SL_ASSIGN_OR_RETURN(Work sum, round->shard->AllReduce(&loss, &loss, 1, DType::kF32,
                                                              **stream, {.op = ReduceOp::kSum}));
        SL_ASSIGN_OR_RETURN(
            Work avg, round->replicate->AllReduce(grad.data(), grad.data(), grad.size(),
                                                  DType::kF32, **stream, {.op = ReduceOp::kAvg}));
        SL_RETURN_IF_ERROR(sum.Wait(deadline));
        return avg.Wait(deadline);
      }();
      if (!status.ok()) {
        // As the scheduler does: the peers blocked in this round's collectives fail at once.
        round->shard->Abort(status);
        round->replicate->Abort(status);
      }
      absl::StatusOr<bool> committed = group.EndRound(status, deadline);
      if (!committed.ok()) {
        result.status = committed.status();
        break;
      }
      if (!*committed) continue;  // the next round redoes round->step from the same params
      for (size_t i = 0; i < params.size(); ++i) params[i] -= kLearningRate * grad[i];
      ++step;
      result.steps[round->step] = {round->replicas, params};
      if (replica == 0 && round->step == kSteps / 2 && ++halfway_ranks_ == kShards) {
        replica0_halfway_.Notify();
      }
    }
    result.recoveries = group.recoveries();
    return result;
  }

  std::shared_ptr<MemoryStore> store_ = std::make_shared<MemoryStore>();
  TraceWriter trace_{/*rank=*/0};
  std::atomic<int> halfway_ranks_{0};
  absl::Notification replica0_halfway_;
};

TEST_F(ElasticGroupTest, AReplicaLostMidStepIsDroppedThenRejoinsWithIdenticalState) {
  // Ranks (replica, shard, incarnation) -> result.
  std::map<std::tuple<int, int, int>, RankResult> results;
  std::mutex mu;
  std::vector<std::thread> threads;
  auto start = [&](int replica, int shard, int incarnation, int64_t dies_at) {
    threads.emplace_back([&, replica, shard, incarnation, dies_at] {
      RankResult result = Train(replica, shard, incarnation, dies_at);
      std::lock_guard<std::mutex> lock(mu);
      results[{replica, shard, incarnation}] = std::move(result);
    });
  };
  for (int r = 0; r < kReplicas; ++r) {
    for (int s = 0; s < kShards; ++s) start(r, s, 0, r == 1 && s == 0 ? kKillStep : -1);
  }
  // The restarted replica group, once the survivors are halfway.
  std::thread restarter([&] {
    replica0_halfway_.WaitForNotificationWithTimeout(absl::Seconds(90));
    std::lock_guard<std::mutex> lock(mu);
    for (int s = 0; s < kShards; ++s) start(1, s, 1, -1);
  });
  restarter.join();
  for (size_t i = 0; i < threads.size(); ++i) threads[i].join();

  ASSERT_EQ(results.size(), 6u);
  EXPECT_EQ(results[std::make_tuple(1, 0, 0)].status.message(), "killed");
  // The dead rank's partner is told it is out.
  const absl::Status& partner = results[std::make_tuple(1, 1, 0)].status;
  EXPECT_TRUE(absl::IsAborted(partner)) << partner;
  // The dead rank was its group's leader: its partner learns at once that the group is out.
  EXPECT_TRUE(absl::StrContains(partner.message(), "leader of this replica group")) << partner;
  for (auto [replica, incarnation] : {std::pair{0, 0}, std::pair{1, 1}}) {
    for (int s = 0; s < kShards; ++s) {
      const RankResult& r = results[std::make_tuple(replica, s, incarnation)];
      EXPECT_TRUE(r.status.ok()) << "rank (" << replica << ", " << s << "): " << r.status;
      EXPECT_EQ(r.joined, replica == 1) << replica << "," << s;
    }
  }
  // The plain-loop reference: each step averages the gradients of the replicas that took part.
  for (int s = 0; s < kShards; ++s) {
    const RankResult& survivor = results[std::make_tuple(0, s, 0)];
    ASSERT_EQ(survivor.steps.size(), static_cast<size_t>(kSteps)) << "shard " << s;
    std::vector<float> expected = Initial(s);
    int64_t first_rejoined = -1;
    for (int64_t step = 0; step < kSteps; ++step) {
      const StepRecord& record = survivor.steps.at(step);
      if (step < kKillStep) {
        EXPECT_EQ(record.replicas, (std::vector<int>{0, 1})) << "step " << step;
      } else if (step == kKillStep) {
        EXPECT_EQ(record.replicas, std::vector<int>{0}) << "the redo runs without replica 1";
      } else if (record.replicas.size() == 2 && first_rejoined < 0) {
        first_rejoined = step;
      }
      std::vector<float> sum(expected.size(), 0.0f);
      for (int replica : record.replicas) {
        const std::vector<float> g = Gradient(step, replica, s);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
      }
      for (size_t i = 0; i < expected.size(); ++i) {
        expected[i] -= kLearningRate * (sum[i] / static_cast<float>(record.replicas.size()));
        ASSERT_NEAR(record.params[i], expected[i], 1e-5) << "shard " << s << " step " << step;
      }
    }
    ASSERT_GT(first_rejoined, kKillStep) << "replica 1 never rejoined";
    // From its first step on, the rejoined replica's parameters equal the survivor's, bit for bit.
    const RankResult& rejoined = results[std::make_tuple(1, s, 1)];
    ASSERT_FALSE(rejoined.steps.empty());
    EXPECT_EQ(rejoined.steps.begin()->first, first_rejoined);
    for (const auto& [step, record] : rejoined.steps) {
      EXPECT_EQ(record.params, survivor.steps.at(step).params) << "shard " << s << " step " << step;
    }
    // One recovery, detected and resumed well within the 20 s timeout.
    ASSERT_EQ(survivor.recoveries.size(), 1u);
    EXPECT_EQ(survivor.recoveries[0].step, kKillStep);
    EXPECT_LT(survivor.recoveries[0].detect, absl::Seconds(5));
    EXPECT_LT(survivor.recoveries[0].resume, absl::Seconds(5));
    EXPECT_EQ(survivor.recoveries[0].replicas_after, std::vector<int>{0});
  }
  // Rank (0, 0)'s trace: a span per round (the aborted one says why) and the recovery.
  const std::string trace = trace_.ToJson();
  EXPECT_TRUE(absl::StrContains(trace, "\"name\":\"recovery\"")) << trace;
  EXPECT_TRUE(absl::StrContains(trace, "rank (1, 0) incarnation 0 was lost")) << trace;
  EXPECT_TRUE(absl::StrContains(trace, absl::StrCat("(step ", kKillStep, ")"))) << trace;
  EXPECT_TRUE(absl::StrContains(trace, absl::StrCat("(step ", kSteps - 1, ")"))) << trace;
}

// A step that fails on every try ends the job after max_consecutive_aborts rounds instead of
// looping; each retry gets new communicators.
TEST_F(ElasticGroupTest, AStepThatAlwaysFailsEndsAfterMaxConsecutiveAborts) {
  ElasticOptions o = Options(0, 0, 0);
  o.replicas = 1;
  o.shard_size = 1;
  o.max_consecutive_aborts = 3;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ElasticGroup>> group = ElasticGroup::Join(o, deadline);
  ASSERT_TRUE(group.ok()) << group.status();
  const absl::Status broken = absl::InternalError("the step is broken");
  for (int attempt = 1; attempt <= 3; ++attempt) {
    absl::StatusOr<ElasticGroup::Round> round = (*group)->BeginRound(deadline);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(round->step, 0);
    EXPECT_TRUE(round->rebuilt) << "attempt " << attempt;
    absl::StatusOr<bool> committed = (*group)->EndRound(broken, deadline);
    if (attempt < 3) {
      ASSERT_TRUE(committed.ok()) << committed.status();
      EXPECT_FALSE(*committed);
    } else {
      EXPECT_TRUE(absl::IsAborted(committed.status())) << committed.status();
      EXPECT_TRUE(absl::StrContains(committed.status().message(), "3 rounds in a row"))
          << committed.status();
      EXPECT_TRUE(absl::StrContains(committed.status().message(), "the step is broken"))
          << committed.status();
    }
  }
  EXPECT_EQ((*group)->committed_steps(), 0);
  EXPECT_EQ((*group)->recoveries().size(), 3u);
}

TEST_F(ElasticGroupTest, BadOptionsAreNamed) {
  ElasticOptions o = Options(0, 0, 0);
  o.shard = 2;
  absl::StatusOr<std::unique_ptr<ElasticGroup>> group =
      ElasticGroup::Join(o, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsInvalidArgument(group.status())) << group.status();
  EXPECT_TRUE(absl::StrContains(group.status().message(), "shard 2 is not in [0, 2)"));
  o = Options(0, 0, 0);
  o.watch_liveness = true;  // a MemoryStore cannot watch a process
  group = ElasticGroup::Join(o, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsUnimplemented(group.status())) << group.status();
}

}  // namespace
}  // namespace shardline
