// The failure model (scheduler/tune/failures.h) against closed forms computed here: the MTBF a
// published count implies and its scaling with the job, the work a checkpoint every N steps
// loses (N / 2, and a plain simulation of uniform failure times), restart and elastic costs term
// by term, the store traffic of the protocol's rounds, goodput; bad options and scenarios
// refused with the field named; and the scenario the simulator gives.
#include "scheduler/tune/failures.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>

#include "absl/strings/match.h"
#include "collectives/sim/topology.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"

namespace shardline {
namespace {

RecoveryScenario Scenario() {
  RecoveryScenario s;
  s.gpus = 96;
  s.shard_size = 8;
  s.devices_per_node = 8;
  s.step_s = 1.25;
  s.state_bytes = 3e11;
  s.link_bytes_per_s = 4e10;
  s.host_link_bytes_per_s = 5e10;
  s.checkpoint_every = {1, 40, 333};
  return s;
}

RecoveryOptions Options() {
  RecoveryOptions o;
  o.gpu_mtbf_hours = 20000;
  o.detect_s = 0.2;
  o.hang_fraction = 0.25;
  o.timeout_s = 100;
  o.relaunch_s = 50;
  o.init_s = 20;
  o.storage_bytes_per_s_per_node = 2e9;
  o.resume_base_s = 0.03;
  o.store_ops_per_s = 10000;
  o.crc_bytes_per_s = 1e10;
  return o;
}

TEST(FailuresTest, PublishedRatesGiveTheirMtbf) {
  ASSERT_GE(PublishedFailureRates().size(), 2u);
  const FailureSource& llama = PublishedFailureRates().front();
  EXPECT_EQ(llama.name, "llama3");
  // 16,384 GPUs x 54 days x 24 h / 419 unexpected interruptions.
  EXPECT_NEAR(llama.GpuMtbfHours(), 16384.0 * 54 * 24 / 419, 1e-9);
  EXPECT_NEAR(llama.GpuMtbfHours(), 50677, 1);
  absl::StatusOr<FailureSource> opt = FailureSourceByName("opt-175b");
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_NEAR(opt->GpuMtbfHours(), 992.0 * 60 * 24 / 35, 1e-9);
  absl::StatusOr<FailureSource> none = FailureSourceByName("bloom");
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::StrContains(none.status().message(), "unknown failure source 'bloom'"));
  EXPECT_TRUE(absl::StrContains(none.status().message(), "llama3, opt-175b"));
}

TEST(FailuresTest, JobMtbfScalesInverselyWithGpus) {
  RecoveryOptions o = Options();
  o.gpu_mtbf_hours = 0;  // the default source
  for (const int gpus : {16, 64, 1024}) {
    RecoveryScenario s = Scenario();
    s.gpus = gpus;
    absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
    ASSERT_TRUE(e.ok()) << e.status();
    const double mtbf = 16384.0 * 54 * 24 / 419;
    EXPECT_NEAR(e->gpu_mtbf_hours, mtbf, 1e-9);
    EXPECT_NEAR(e->job_mtbf_hours, mtbf / gpus, 1e-9);
    EXPECT_NEAR(e->failures_per_day, 24.0 * gpus / mtbf, 1e-12);
    EXPECT_EQ(e->replicas, gpus / 8);
    EXPECT_EQ(e->nodes, gpus / 8);
  }
  // At Llama 3's own scale the model gives back the count: 419 failures in 54 days.
  RecoveryScenario s = Scenario();
  s.gpus = 16384;
  absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->failures_per_day * 54, 419, 1e-9);
}

// The expected steps lost with a checkpoint every N steps, from a plain loop over uniformly
// drawn failure times: the committed steps since the last save plus the fraction of the step in
// flight.
double SimulatedLostSteps(int every, int trials) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> at(0, every);
  double lost = 0;
  for (int t = 0; t < trials; ++t) lost += at(rng);  // steps since the save, fraction included
  return lost / trials;
}

TEST(FailuresTest, CheckpointRestartCostsTermByTerm) {
  const RecoveryScenario s = Scenario();
  const RecoveryOptions o = Options();
  absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->checkpoint.size(), 3u);
  const double nodes = 12;
  const double detect = 0.75 * 0.2 + 0.25 * 100;
  const double lambda = 96 / (20000.0 * 3600);
  for (size_t i = 0; i < 3; ++i) {
    const CheckpointRestartCost& c = e->checkpoint[i];
    const int every = s.checkpoint_every[i];
    EXPECT_EQ(c.every, every);
    EXPECT_NEAR(c.write_s, 3e11 / (2e9 * nodes), 1e-9);
    EXPECT_NEAR(c.blocked_s, c.write_s, 1e-12);
    EXPECT_NEAR(c.steady, every * 1.25 / (every * 1.25 + 3e11 / 24e9), 1e-12);
    // Every replica (96 / 8 = 12) reads its copy of the state.
    EXPECT_NEAR(c.load_s, 12 * 3e11 / (2e9 * nodes), 1e-9);
    EXPECT_NEAR(c.restart_s, detect + 50 + 20 + c.load_s, 1e-9);
    EXPECT_DOUBLE_EQ(c.lost_steps, every / 2.0);
    EXPECT_NEAR(c.lost_steps, SimulatedLostSteps(every, 200000), 0.01 * every);
    EXPECT_NEAR(c.lost_s, c.restart_s + every / 2.0 * 1.25, 1e-9);
    EXPECT_NEAR(c.goodput, c.steady * (1 - lambda * c.lost_s), 1e-12);
  }
}

TEST(FailuresTest, AsyncCheckpointsBlockForTheSnapshotAndAnyBacklog) {
  RecoveryScenario s = Scenario();
  RecoveryOptions o = Options();
  o.async_checkpoint = true;
  absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
  ASSERT_TRUE(e.ok()) << e.status();
  const double write = 3e11 / 24e9;         // 12.5 s
  const double snapshot = 3e11 / 8 / 5e10;  // a rank's share over its host link
  // N = 1: a 1.25 s interval cannot hide a 12.5 s write.
  EXPECT_NEAR(e->checkpoint[0].blocked_s, snapshot + (write - 1.25), 1e-9);
  // N = 40, 333: the write fits behind the steps.
  EXPECT_NEAR(e->checkpoint[1].blocked_s, snapshot, 1e-12);
  EXPECT_NEAR(e->checkpoint[2].blocked_s, snapshot, 1e-12);
  s.host_link_bytes_per_s = 0;
  absl::StatusOr<RecoveryEstimate> none = EstimateRecovery(s, o);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::StrContains(none.status().message(), "host_link_bytes_per_s"));
}

TEST(FailuresTest, ElasticCostsTermByTerm) {
  const RecoveryScenario s = Scenario();
  RecoveryOptions o = Options();
  const double n = 96;
  const double replicas = 12;
  const double detect = 0.75 * 0.2 + 0.25 * 100;
  const double lambda = n / (20000.0 * 3600);
  const double share = 3e11 / 8;
  const double transfer = share / 4e10 + share / 1e10;
  // Store operations per phase of a round: as built (two levels), 3n + R + R^2; the first design,
  // n appends and n reads by each of n ranks; batched, one read per rank; leaders relaying, one
  // append and one read per replica group.
  const std::pair<StoreReads, double> variants[] = {
      {StoreReads::kTwoLevel, 3.0 * n + replicas + static_cast<double>(replicas) * replicas},
      {StoreReads::kPerEntry, n + n * n},
      {StoreReads::kBatched, 2 * n},
      {StoreReads::kLeaders, 2 * replicas}};
  for (const auto& [reads, ops] : variants) {
    o.store_reads = reads;
    absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
    ASSERT_TRUE(e.ok()) << e.status();
    const ElasticCost& el = e->elastic;
    const double phase = ops / 10000;
    EXPECT_NEAR(el.detect_s, detect, 1e-12);
    EXPECT_NEAR(el.quorum_s, phase, 1e-12) << StoreReadsName(reads);
    EXPECT_NEAR(el.resume_s, detect + 0.03 + phase, 1e-12);
    EXPECT_NEAR(el.next_commit_s, el.resume_s + 1.25, 1e-12);
    EXPECT_DOUBLE_EQ(el.lost_steps, 0.5);
    EXPECT_NEAR(el.degraded_s, 70, 1e-12);
    EXPECT_NEAR(el.transfer_s, transfer, 1e-9);
    EXPECT_NEAR(el.rejoin_s, 70 + 0.03 + transfer, 1e-9);
    EXPECT_NEAR(el.lost_s, el.resume_s + 0.625 + 70 / replicas + 0.03 + transfer, 1e-9);
    EXPECT_NEAR(el.protocol_s, 2 * phase, 1e-12);
    EXPECT_NEAR(el.steady, 1.25 / (1.25 + 2 * phase), 1e-12);
    EXPECT_NEAR(el.goodput, el.steady * (1 - lambda * el.lost_s), 1e-12);
    // The restart waits for the relaunch, the initialisation and the load.
    EXPECT_TRUE(e->elastic_resumes_faster);
  }
  // Without those, a slow store makes the elastic resume the slower one.
  o.store_reads = StoreReads::kPerEntry;
  o.relaunch_s = 0;
  o.init_s = 0;
  o.store_ops_per_s = 50;
  absl::StatusOr<RecoveryEstimate> slow = EstimateRecovery(s, o);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_FALSE(slow->elastic_resumes_faster);
}

TEST(FailuresTest, GoodputFormula) {
  EXPECT_DOUBLE_EQ(Goodput(1, 0, 100), 1);
  EXPECT_DOUBLE_EQ(Goodput(0.9, 1.0 / 3600, 360), 0.9 * 0.9);
  EXPECT_DOUBLE_EQ(Goodput(0.9, 1.0 / 3600, 3600), 0);
  EXPECT_DOUBLE_EQ(Goodput(0.9, 1.0 / 3600, 7200), 0);  // floored: no progress
}

TEST(FailuresTest, BadInputNamesTheField) {
  struct Case {
    void (*change)(RecoveryScenario&, RecoveryOptions&);
    const char* expected;
  };
  const Case cases[] = {
      {[](RecoveryScenario&, RecoveryOptions& o) { o.gpu_mtbf_hours = -1; }, "gpu_mtbf_hours"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.detect_s = NAN; }, "detect_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.hang_fraction = 1.5; }, "hang_fraction"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.timeout_s = -2; }, "timeout_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.relaunch_s = -1; }, "relaunch_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.init_s = INFINITY; }, "init_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.storage_bytes_per_s_per_node = 0; },
       "storage_bytes_per_s_per_node"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.resume_base_s = -0.1; }, "resume_base_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.store_ops_per_s = 0; }, "store_ops_per_s"},
      {[](RecoveryScenario&, RecoveryOptions& o) { o.crc_bytes_per_s = -1; }, "crc_bytes_per_s"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.gpus = 0; }, "gpus must be >= 1"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.shard_size = 7; },
       "shard_size must divide gpus (96), got 7"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.step_s = 0; }, "step_s"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.state_bytes = -1; }, "state_bytes"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.link_bytes_per_s = 0; }, "link_bytes_per_s"},
      {[](RecoveryScenario& s, RecoveryOptions&) {
         s.checkpoint_every = {10, 0};
       },
       "checkpoint_every"},
      {[](RecoveryScenario& s, RecoveryOptions&) { s.devices_per_node = 0; }, "devices_per_node"},
  };
  for (const Case& c : cases) {
    RecoveryScenario s = Scenario();
    RecoveryOptions o = Options();
    c.change(s, o);
    absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(s, o);
    ASSERT_FALSE(e.ok()) << c.expected;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_TRUE(absl::StrContains(e.status().message(), c.expected)) << e.status();
  }
  RecoveryScenario one = Scenario();
  one.shard_size = 96;
  absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(one, Options());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(e.status().message(), "at least 2 replica groups")) << e.status();
}

constexpr char kTopology[] = R"({
  "name": "fail-4x4", "nodes": 4, "devices_per_node": 4, "device_memory_GiB": 80,
  "compute_TFLOPs": 100, "host_link_GBps": 20,
  "intra_node": {"bandwidth_GBps": 200, "latency_us": 1},
  "inter_node": {"nics_per_node": 2, "nic_bandwidth_GBps": 25, "latency_us": 5}
})";

TEST(FailuresTest, SimulatedScenarioTakesTheSimulatorsStep) {
  absl::StatusOr<Topology> topology = ParseTopology(kTopology);
  ASSERT_TRUE(topology.ok()) << topology.status();
  auto shared = std::make_shared<const Topology>(*topology);
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster = CreateTopologyCluster(shared);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  TransformerConfig config = Llama3_8B({.seq_len = 512});
  config.layers = 2;
  absl::StatusOr<ModelDescription> model = TransformerModel(config);
  ASSERT_TRUE(model.ok()) << model.status();

  absl::StatusOr<RecoveryScenario> s =
      SimulatedScenario(*model, **cluster, {.gpus = 16, .shard_size = 4});
  ASSERT_TRUE(s.ok()) << s.status();
  SimulationConfig direct{.world_size = 16, .ranks = RankMode::kAuto};
  direct.strategy = ShardingStrategy::kHybridShard;
  direct.shard_size = 4;
  absl::StatusOr<SimulationReport> report = Simulate(*model, direct, **cluster);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_DOUBLE_EQ(s->step_s, absl::ToDoubleSeconds(*report->step_time));
  EXPECT_GT(s->step_s, 0);
  // f32 master weights and AdamW's 8 bytes per parameter.
  EXPECT_DOUBLE_EQ(s->state_bytes, 12.0 * model->ParameterCount());
  EXPECT_DOUBLE_EQ(s->link_bytes_per_s, 25e9 * 2 / 4);
  EXPECT_DOUBLE_EQ(s->host_link_bytes_per_s, 20e9);
  EXPECT_EQ(s->devices_per_node, 4);

  absl::StatusOr<RecoveryScenario> big =
      SimulatedScenario(*model, **cluster, {.gpus = 32, .shard_size = 4});
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(absl::StrContains(big.status().message(), "topology 'fail-4x4' has 16 devices"));
  absl::StatusOr<RecoveryScenario> odd =
      SimulatedScenario(*model, **cluster, {.gpus = 16, .shard_size = 3});
  ASSERT_FALSE(odd.ok());
  EXPECT_TRUE(absl::StrContains(odd.status().message(), "shard size 3 does not divide 16"));
}

}  // namespace
}  // namespace shardline
