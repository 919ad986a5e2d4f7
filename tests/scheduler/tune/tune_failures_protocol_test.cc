// The failure model's store traffic (scheduler/tune/failures.h: each round of the elastic
// protocol costs n appends and n^2 reads per phase) against ElasticGroup itself
// (collectives/elastic/elastic_group.h): n ranks as threads over one MemoryStore, wrapped to count
// the operations on the protocol's log, run steady rounds; the reads are exactly what the model
// counts, the successful appends too, and what the model leaves out (compare-and-set retries of
// contending appends, the catch-up checks) only adds to it.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "collectives/elastic/elastic_group.h"
#include "collectives/store/memory_store.h"
#include "collectives/store/store.h"
#include "scheduler/tune/failures.h"

namespace shardline {
namespace {

// Forwards to a MemoryStore and counts the operations on keys of the elastic log.
class CountingStore final : public Store {
 public:
  std::atomic<int64_t> gets{0}, compare_sets{0}, appended{0}, checks{0}, other{0};

 protected:
  absl::Status DoSet(absl::string_view key, absl::string_view value) override {
    Count(key, other);
    return inner_->Set(key, value);
  }
  absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) override {
    Count(key, gets);
    return inner_->Get(key, deadline);
  }
  absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) override {
    Count(key, other);
    return inner_->Add(key, delta);
  }
  absl::StatusOr<std::string> DoCompareSet(absl::string_view key, absl::string_view expected,
                                           absl::string_view desired) override {
    Count(key, compare_sets);
    absl::StatusOr<std::string> after = inner_->CompareSet(key, expected, desired);
    if (after.ok() && *after == desired && IsLog(key)) ++appended;
    return after;
  }
  absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) override {
    for (const std::string& key : keys) Count(key, other);
    return inner_->Wait(keys, deadline);
  }
  absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) override {
    for (const std::string& key : keys) Count(key, checks);
    return inner_->Check(keys);
  }
  absl::StatusOr<bool> DoDelete(absl::string_view key) override { return inner_->Delete(key); }
  absl::StatusOr<int64_t> DoNumKeys() override { return inner_->NumKeys(); }

 private:
  // The job log, the groups' logs and the leaders' decisions.
  static bool IsLog(absl::string_view key) {
    return absl::StrContains(key, "/log/") || absl::StrContains(key, "/decisions/");
  }
  static void Count(absl::string_view key, std::atomic<int64_t>& counter) {
    if (IsLog(key)) ++counter;
  }
  std::shared_ptr<MemoryStore> inner_ = std::make_shared<MemoryStore>();
};

TEST(FailuresProtocolTest, StoreTrafficPerRoundIsTheModels) {
  constexpr int kReplicas = 3;
  constexpr int kShards = 2;
  constexpr int kRounds = 4;
  constexpr int n = kReplicas * kShards;
  auto store = std::make_shared<CountingStore>();
  std::vector<absl::Status> results(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kReplicas; ++r) {
    for (int s = 0; s < kShards; ++s) {
      ranks.emplace_back([&, r, s] {
        absl::Status& result = results[r * kShards + s];
        const absl::Time deadline = absl::Now() + absl::Seconds(60);
        ElasticOptions o;
        o.store = store;
        o.replicas = kReplicas;
        o.shard_size = kShards;
        o.replica = r;
        o.shard = s;
        o.timeout = absl::Seconds(30);
        o.watch_liveness = false;
        absl::StatusOr<std::unique_ptr<ElasticGroup>> group = ElasticGroup::Join(o, deadline);
        if (!group.ok()) {
          result = group.status();
          return;
        }
        while ((*group)->committed_steps() < kRounds) {
          absl::StatusOr<ElasticGroup::Round> round = (*group)->BeginRound(deadline);
          if (!round.ok()) {
            result = round.status();
            return;
          }
          absl::StatusOr<bool> committed = (*group)->EndRound(absl::OkStatus(), deadline);
          if (!committed.ok() || !*committed) {
            result = committed.ok() ? absl::AbortedError("a round aborted") : committed.status();
            return;
          }
        }
      });
    }
  }
  for (std::thread& t : ranks) t.join();
  for (const absl::Status& status : results) ASSERT_TRUE(status.ok()) << status;

  // Every round, per phase (arrive, vote): every rank appends to its group's log, each leader
  // reads its group's entries, appends to the job log, reads every leader's entry there, and
  // appends its decision, which the group's other ranks read.
  constexpr int R = kReplicas;
  EXPECT_EQ(store->appended.load(), kRounds * 2 * (n + 2 * R));
  EXPECT_EQ(store->gets.load(), kRounds * 2 * (n + R * R + (n - R)));
  EXPECT_GE(store->compare_sets.load(), kRounds * 2 * n);  // plus retries where appends contend
  EXPECT_GE(store->checks.load(), kRounds * R);            // the leaders' catch-up
  EXPECT_EQ(store->other.load(), 0);
  std::printf(
      "%d ranks, %d rounds: %lld gets, %lld compare-and-sets (%lld appended), %lld checks\n", n,
      kRounds, static_cast<long long>(store->gets.load()),
      static_cast<long long>(store->compare_sets.load()),
      static_cast<long long>(store->appended.load()), static_cast<long long>(store->checks.load()));

  // The model's figure for the same job (StoreReads::kTwoLevel, the default).
  RecoveryScenario scenario;
  scenario.gpus = n;
  scenario.shard_size = kShards;
  scenario.step_s = 1;
  scenario.state_bytes = 1e9;
  scenario.link_bytes_per_s = 1e9;
  RecoveryOptions options;
  options.store_ops_per_s = 1;  // protocol_s then counts operations
  absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(scenario, options);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_DOUBLE_EQ(e->elastic.protocol_s * kRounds,
                   static_cast<double>(store->appended.load() + store->gets.load()));
}

}  // namespace
}  // namespace shardline
