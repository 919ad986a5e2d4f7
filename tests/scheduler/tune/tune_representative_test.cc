// The representative-rank shortcut of the simulation driver (scheduler/tune/simulate.h,
// RankMode): one rank standing for a symmetric world gives the same figures as simulating every
// rank. Checked at 64 ranks on a flat cluster and on a topology of 8 nodes x 8 devices (two link
// levels, size-efficiency curves, contention; and as a host-memory machine whose nodes' 3 cores
// are shared by the memory ops and collective copies of their 8 ranks, with and without
// lock-step collectives), across strategies (full,
// shard-grad-op, no shard, hybrid with shard groups inside a node, across two nodes and several per
// node), prefetch depths, budgets, checkpointing and host lead: step time, exposed communication,
// communication time, rank 0's collectives and ring bytes, the bytes per link level, every memory
// figure and rank 0's issue log must be equal (exactly: the representative's collectives complete
// at the same virtual times as the full run's, whose ranks all arrive together). Where the
// placement is not symmetric, kRepresentative is refused and kAuto runs every rank.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "scheduler/tune/simulate.h"

namespace shardline {
namespace {

// 8 nodes of 8 devices, distinct intra/inter figures and curves (so placement matters).
// host_cores > 0: a host-memory machine whose memory ops and collective copies share each node's
// cores (fewer than its ranks, so that they contend).
std::shared_ptr<const Topology> TestTopology(double host_cores = 0, bool lockstep = false) {
  Topology t;
  t.name = "test-8x8";
  t.nodes = 8;
  t.devices_per_node = 8;
  t.device_memory_bytes = 1ull << 30;
  t.compute_flops_per_s = 37e12;
  t.intra_node = {
      .bandwidth_bytes_per_s = 150e9,
      .latency_s = 2.5e-6,
      .efficiency = {{.bytes = 4096, .efficiency = 0.2}, {.bytes = 1 << 20, .efficiency = 0.9}}};
  t.nics_per_node = 4;
  t.inter_node = {
      .bandwidth_bytes_per_s = 25e9,
      .latency_s = 7e-6,
      .efficiency = {{.bytes = 8192, .efficiency = 0.1}, {.bytes = 4 << 20, .efficiency = 0.85}}};
  t.collectives = DefaultCollectiveAlgorithms();
  t.host_cores = host_cores;
  t.host_lockstep = lockstep;
  if (host_cores > 0) {
    t.name = "test-8x8-host";
    // Memory ops slow enough to matter beside the collectives.
    t.memory_ops = {.copy_bytes_per_s = 20e9,
                    .cast_bytes_per_s = 10e9,
                    .reduce_bytes_per_s = 15e9,
                    .fill_bytes_per_s = 30e9,
                    .op_overhead_s = 4e-6};
  }
  return std::make_shared<const Topology>(std::move(t));
}

std::vector<std::unique_ptr<SimCluster>> Clusters() {
  std::vector<std::unique_ptr<SimCluster>> out;
  absl::StatusOr<std::unique_ptr<SimCluster>> flat = CreateFlatCluster(
      {.network = {.latency = absl::Microseconds(3), .bandwidth_bytes_per_s = 20e9},
       .compute_flops_per_s = 50e12,
       .device_memory_bytes = 1ull << 30});
  EXPECT_TRUE(flat.ok()) << flat.status();
  out.push_back(*std::move(flat));
  absl::StatusOr<std::unique_ptr<SimCluster>> topo = CreateTopologyCluster(TestTopology());
  EXPECT_TRUE(topo.ok()) << topo.status();
  out.push_back(*std::move(topo));
  absl::StatusOr<std::unique_ptr<SimCluster>> host = CreateTopologyCluster(TestTopology(3));
  EXPECT_TRUE(host.ok()) << host.status();
  out.push_back(*std::move(host));
  absl::StatusOr<std::unique_ptr<SimCluster>> lockstep =
      CreateTopologyCluster(TestTopology(3, true));
  EXPECT_TRUE(lockstep.ok()) << lockstep.status();
  out.push_back(*std::move(lockstep));
  return out;
}

// Units of odd sizes (layouts pad), the first used again at the end (a tied embedding).
ModelDescription TestModel() {
  ModelDescription m;
  m.name = "rep";
  m.optimizer_state_bytes_per_param = 12;
  m.tokens_per_micro_batch = 2048;
  for (int u = 0; u < 5; ++u) {
    const int64_t n = 200'003 + 90'001 * u;
    m.units.push_back({.name = absl::StrCat("u", u),
                       .tensors = {{.name = "w", .shape = {n}}, {.name = "b", .shape = {5 + u}}}});
    m.forward.push_back({.unit = u,
                         .forward_flops = 3'000'000'001ull * (u + 1),
                         .backward_flops = 6'000'000'007ull * (u + 1),
                         .activation_bytes = 1'000'003ull * (u + 2),
                         .checkpointed_activation_bytes = 100'019ull * (u + 1)});
  }
  m.forward.push_back({.unit = 0,
                       .forward_flops = 5'000'000'000ull,
                       .backward_flops = 10'000'000'000ull,
                       .activation_bytes = 555'557,
                       .checkpointed_activation_bytes = 555'557});
  return m;
}

void ExpectSameFigures(const SimulationReport& full, const SimulationReport& rep,
                       const std::string& what) {
  EXPECT_EQ(full.ranks_simulated, full.world_size) << what;
  EXPECT_FALSE(full.representative) << what;
  EXPECT_EQ(rep.ranks_simulated, 1) << what;
  EXPECT_TRUE(rep.representative) << what;
  EXPECT_EQ(rep.world_size, full.world_size) << what;
  ASSERT_TRUE(full.step_time.has_value() && rep.step_time.has_value()) << what;
  EXPECT_EQ(*rep.step_time, *full.step_time) << what;
  EXPECT_EQ(rep.exposed_communication, full.exposed_communication) << what;
  EXPECT_EQ(rep.communication_time, full.communication_time) << what;
  EXPECT_EQ(rep.compute_time, full.compute_time) << what;
  EXPECT_EQ(rep.step_flops, full.step_flops) << what;
  EXPECT_EQ(rep.tokens_per_s_per_device, full.tokens_per_s_per_device) << what;
  EXPECT_EQ(rep.ring_sent_bytes_per_rank, full.ring_sent_bytes_per_rank) << what;
  EXPECT_EQ(rep.intra_node_bytes_per_device, full.intra_node_bytes_per_device) << what;
  EXPECT_EQ(rep.inter_node_bytes_per_device, full.inter_node_bytes_per_device) << what;
  ASSERT_EQ(rep.collectives.size(), full.collectives.size()) << what;
  for (const auto& [key, tally] : full.collectives) {
    auto it = rep.collectives.find(key);
    ASSERT_NE(it, rep.collectives.end()) << what;
    EXPECT_EQ(it->second.calls, tally.calls) << what;
    EXPECT_EQ(it->second.payload_bytes, tally.payload_bytes) << what;
    EXPECT_EQ(it->second.ring_sent_bytes_times_size, tally.ring_sent_bytes_times_size) << what;
  }
  const MemoryReport& a = full.memory;
  const MemoryReport& b = rep.memory;
  EXPECT_EQ(b.master_shards, a.master_shards) << what;
  EXPECT_EQ(b.sharded_grads, a.sharded_grads) << what;
  EXPECT_EQ(b.optimizer_state, a.optimizer_state) << what;
  EXPECT_EQ(b.unsharded_params_peak, a.unsharded_params_peak) << what;
  EXPECT_EQ(b.grad_buffers_peak, a.grad_buffers_peak) << what;
  EXPECT_EQ(b.activations_peak, a.activations_peak) << what;
  EXPECT_EQ(b.total_peak, a.total_peak) << what;
  EXPECT_EQ(b.unsharded_params_requested_peak, a.unsharded_params_requested_peak) << what;
  EXPECT_EQ(rep.fits, full.fits) << what;
  EXPECT_EQ(rep.metrics.peak_inflight_bytes, full.metrics.peak_inflight_bytes) << what;
  ASSERT_EQ(rep.event_logs.size(), 1u) << what;
  ASSERT_EQ(full.event_logs.size(), static_cast<size_t>(full.world_size)) << what;
  EXPECT_EQ(rep.event_logs[0], full.event_logs[0]) << what;
}

TEST(TuneRepresentativeTest, OneRankGivesTheFiguresOfEveryRankAt64) {
  const ModelDescription m = TestModel();
  struct Case {
    std::string name;
    SimulationConfig config;
  };
  const std::vector<Case> cases = {
      {"full shard", {.world_size = 64}},
      {"full shard, prefetch 2/2, budget 2 units, checkpointing, whole-step lead",
       {.world_size = 64,
        .forward_prefetch = 2,
        .backward_prefetch_depth = 2,
        .budget_units = 2,
        .activation_checkpointing = {.mode = CheckpointMode::kFull},
        .host_lead = HostLead::kWholeStep}},
      {"shard-grad-op, bf16 reductions",
       {.world_size = 64,
        .strategy = ShardingStrategy::kShardGradOp,
        .reduce_dtype = DType::kBF16}},
      {"no shard", {.world_size = 64, .strategy = ShardingStrategy::kNoShard}},
      {"hybrid 8 (one node)",
       {.world_size = 64, .strategy = ShardingStrategy::kHybridShard, .shard_size = 8}},
      {"hybrid 16 (two nodes), after-grad prefetch",
       {.world_size = 64,
        .strategy = ShardingStrategy::kHybridShard,
        .shard_size = 16,
        .backward_prefetch = BackwardPrefetch::kAfterGrad}},
      {"hybrid 4 (two groups per node), budget bytes",
       {.world_size = 64,
        .strategy = ShardingStrategy::kHybridShard,
        .shard_size = 4,
        .forward_prefetch = 3,
        .budget_bytes = 9'000'000}},
  };
  for (const std::unique_ptr<SimCluster>& cluster : Clusters()) {
    for (const Case& c : cases) {
      const std::string what = absl::StrCat(cluster->Describe(), ", ", c.name);
      SimulationConfig full_config = c.config;
      full_config.ranks = RankMode::kAll;
      absl::StatusOr<SimulationReport> full = Simulate(m, full_config, *cluster);
      ASSERT_TRUE(full.ok()) << what << ": " << full.status();
      SimulationConfig rep_config = c.config;
      rep_config.ranks = RankMode::kRepresentative;
      absl::StatusOr<SimulationReport> rep = Simulate(m, rep_config, *cluster);
      ASSERT_TRUE(rep.ok()) << what << ": " << rep.status();
      ExpectSameFigures(*full, *rep, what);
      // The step is not trivially the compute: communication shows.
      EXPECT_GT(*rep->step_time, rep->compute_time) << what;
    }
  }
}

// Host sharing changes the step where cores are scarce, and nothing where they are plentiful
// (every rank's memory ops and collective copies then run at their speed alone).
TEST(TuneRepresentativeTest, HostCoresSlowTheStepOnlyWhenScarce) {
  const ModelDescription m = TestModel();
  SimulationConfig config{.world_size = 64, .forward_prefetch = 2, .backward_prefetch_depth = 2};
  config.ranks = RankMode::kAll;
  auto step = [&](double cores) {
    absl::StatusOr<std::unique_ptr<SimCluster>> c = CreateTopologyCluster(TestTopology(cores));
    EXPECT_TRUE(c.ok()) << c.status();
    absl::StatusOr<SimulationReport> r = Simulate(m, config, **c);
    EXPECT_TRUE(r.ok()) << r.status();
    return absl::ToDoubleSeconds(r.ok() ? *r->step_time : absl::ZeroDuration());
  };
  Topology unshared = *TestTopology(3);
  unshared.host_cores = 0;
  absl::StatusOr<std::unique_ptr<SimCluster>> c0 =
      CreateTopologyCluster(std::make_shared<const Topology>(unshared));
  ASSERT_TRUE(c0.ok());
  absl::StatusOr<SimulationReport> r0 = Simulate(m, config, **c0);
  ASSERT_TRUE(r0.ok()) << r0.status();
  const double alone = absl::ToDoubleSeconds(*r0->step_time);
  // Plenty of cores: the same step (up to the clock's rounding of re-rated flows).
  EXPECT_NEAR(step(1000), alone, 1e-8);
  // 3 cores for 8 ranks: slower; 1 core: slower still.
  const double three = step(3), one = step(1);
  EXPECT_GT(three, alone * 1.01);
  EXPECT_GT(one, three * 1.01);
}

TEST(TuneRepresentativeTest, TopologyClusterCountsBothLinkLevels) {
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster = CreateTopologyCluster(TestTopology());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const ModelDescription m = TestModel();
  // Hybrid 8: the shard collectives stay in the node, the replicate all-reduce crosses it.
  absl::StatusOr<SimulationReport> r = Simulate(m,
                                                {.world_size = 64,
                                                 .ranks = RankMode::kRepresentative,
                                                 .strategy = ShardingStrategy::kHybridShard,
                                                 .shard_size = 8},
                                                **cluster);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->intra_node_bytes_per_device, 0);
  EXPECT_GT(r->inter_node_bytes_per_device, 0);
  // Compute: FLOPs / the topology's achieved throughput.
  // (A sum of per-use durations, each rounded to a quarter nanosecond.)
  EXPECT_NEAR(absl::ToDoubleSeconds(r->compute_time),
              absl::ToDoubleSeconds(ComputeDuration(
                  *TestTopology(), static_cast<double>(r->step_flops), m.precision.param_dtype)),
              1e-9 * static_cast<double>(m.forward.size()));
  // One node, full shard: nothing over the network.
  absl::StatusOr<SimulationReport> one_node =
      Simulate(m, {.world_size = 8, .ranks = RankMode::kRepresentative}, **cluster);
  ASSERT_TRUE(one_node.ok()) << one_node.status();
  EXPECT_GT(one_node->intra_node_bytes_per_device, 0);
  EXPECT_EQ(one_node->inter_node_bytes_per_device, 0);
}

TEST(TuneRepresentativeTest, AsymmetricPlacementsRunEveryRank) {
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster = CreateTopologyCluster(TestTopology());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const ModelDescription m = TestModel();
  // Shard groups of 3 on nodes of 8: some groups straddle two nodes.
  SimulationConfig c{.world_size = 24,
                     .ranks = RankMode::kRepresentative,
                     .strategy = ShardingStrategy::kHybridShard,
                     .shard_size = 3};
  absl::StatusOr<SimulationReport> refused = Simulate(m, c, **cluster);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "symmetric")) << refused.status();
  c.ranks = RankMode::kAuto;
  absl::StatusOr<SimulationReport> all = Simulate(m, c, **cluster);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_FALSE(all->representative);
  EXPECT_EQ(all->ranks_simulated, 24);
  // A world of 12 on nodes of 8 (one full node, one half): also asymmetric.
  EXPECT_FALSE((*cluster)->RanksSymmetric(12, 12));
  EXPECT_TRUE((*cluster)->RanksSymmetric(4, 4));
  EXPECT_TRUE((*cluster)->RanksSymmetric(64, 32));
  EXPECT_FALSE((*cluster)->RanksSymmetric(60, 6));
  // Too many ranks for the topology.
  absl::StatusOr<SimulationReport> big =
      Simulate(m, {.world_size = 128, .ranks = RankMode::kRepresentative}, **cluster);
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(absl::StrContains(big.status().message(), "too few for 128")) << big.status();
  // The host backend has no representative.
  absl::StatusOr<SimulationReport> host =
      RunOnHostBackend(m, {.world_size = 2, .ranks = RankMode::kRepresentative});
  EXPECT_FALSE(host.ok());
}

}  // namespace
}  // namespace shardline
