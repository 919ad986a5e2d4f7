// Micro-batch accumulation and CPU offload in the simulation driver (scheduler/tune/simulate.h)
// and the sweep (sweep.h):
//   * bytes per step, counted from the collectives the scheduler issued, for k micro-batches:
//     full shard with no_sync (k x 2Ψ_param gathered, Ψ_reduce reduced once) and sync (k x 3Ψ),
//     no shard (the all-reduce once or k times), hybrid (the replicate all-reduce once);
//   * one micro-batch is the default run, figure for figure; k micro-batches have k times the
//     FLOPs and the tokens;
//   * CPU offload: the same collectives; the master shards, sharded gradients and optimizer
//     state leave the device for the host (host_peak is their sum plus the reduced shards being
//     copied back); each gather's and
//     each reduction's host copies take their bytes over the cluster's host link, exactly, in a
//     configuration where every op is on the critical path; a cluster without one is an error;
//   * the sweep expands the new dimensions (one accumulation mode where k = 1) and writes them.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/flat_layout.h"
#include "scheduler/tune/simulate.h"
#include "scheduler/tune/sweep.h"

namespace shardline {
namespace {

constexpr double kHostLink = 7.5e9;

std::unique_ptr<SimCluster> Cluster(double host_link = kHostLink) {
  absl::StatusOr<std::unique_ptr<SimCluster>> c = CreateFlatCluster(
      {.network = {.latency = absl::Microseconds(3), .bandwidth_bytes_per_s = 20e9},
       .compute_flops_per_s = 50e12,
       .device_memory_bytes = 1ull << 30,
       .host_link_bytes_per_s = host_link});
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// Units of odd sizes (the layouts pad).
ModelDescription TestModel(int units) {
  ModelDescription m;
  m.name = "test";
  m.optimizer_state_bytes_per_param = 12;
  m.tokens_per_micro_batch = 1000;
  for (int u = 0; u < units; ++u) {
    m.units.push_back({.name = absl::StrCat("u", u),
                       .tensors = {{.name = "w", .shape = {1001 + 377 * u}},
                                   {.name = "b", .shape = {5 + u % 3}}}});
    m.forward.push_back({.unit = u,
                         .forward_flops = 1'000'000'000ull * (u + 1),
                         .backward_flops = 2'000'000'000ull * (u + 1) + 17,
                         .activation_bytes = 100'003ull * (u + 2),
                         .checkpointed_activation_bytes = 10'007ull * (u + 1)});
  }
  return m;
}

uint64_t PaddedElements(const ModelDescription& m, int shards, DType master) {
  uint64_t total = 0;
  for (const UnitDescription& u : m.units) {
    absl::StatusOr<FlatLayout> l =
        FlatLayout::Create(u.tensors, {.num_shards = shards, .element_dtype = master});
    EXPECT_TRUE(l.ok()) << l.status();
    total += l->total_elements();
  }
  return total;
}

SimulationReport MustSimulate(const ModelDescription& m, const SimulationConfig& c,
                              double host_link = kHostLink) {
  std::unique_ptr<SimCluster> cluster = Cluster(host_link);
  absl::StatusOr<SimulationReport> r = Simulate(m, c, *cluster);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : SimulationReport{};
}

// The tally of `kind` over rank 0's communicators of group size `size`.
CollectiveTally Tally(const SimulationReport& r, CollectiveKind kind, int size) {
  return SumTallies(r.collectives, kind, size);
}

struct Mix {
  DType param, reduce, master;
};

TEST(TuneAccumulationTest, BytesPerStepCountedFromTheIssuedCollectives) {
  const int units = 4;
  for (const Mix& mix :
       {Mix{DType::kF32, DType::kF32, DType::kF32}, Mix{DType::kBF16, DType::kF32, DType::kF32},
        Mix{DType::kBF16, DType::kBF16, DType::kF32}}) {
    ModelDescription m = TestModel(units);
    m.precision = {
        .param_dtype = mix.param, .reduce_dtype = mix.reduce, .master_dtype = mix.master};
    const uint64_t ep = DTypeSize(mix.param), er = DTypeSize(mix.reduce);
    for (const int k : {2, 3}) {
      for (const GradientAccumulation acc :
           {GradientAccumulation::kNoSync, GradientAccumulation::kSync}) {
        const bool sync = acc == GradientAccumulation::kSync;
        const uint64_t reductions = sync ? k : 1;
        const std::string at =
            absl::StrCat(m.precision.ToString(), " k=", k, " ", GradientAccumulationName(acc));
        // Full shard over 4, every unit re-gathered in backward.
        {
          const int n = 4;
          const uint64_t psi = PaddedElements(m, n, mix.master);
          const SimulationReport r = MustSimulate(
              m, {.world_size = n, .root_unit = -1, .micro_batches = k, .accumulation = acc});
          const CollectiveTally ag = Tally(r, CollectiveKind::kAllGather, n);
          const CollectiveTally rs = Tally(r, CollectiveKind::kReduceScatter, n);
          EXPECT_EQ(ag.calls, 2u * units * k) << at;
          EXPECT_EQ(ag.payload_bytes, 2 * k * psi * ep) << at;
          EXPECT_EQ(rs.calls, units * reductions) << at;
          EXPECT_EQ(rs.payload_bytes, reductions * psi * er) << at;
          EXPECT_DOUBLE_EQ(
              r.ring_sent_bytes_per_rank,
              static_cast<double>((n - 1) * (2 * k * psi * ep + reductions * psi * er)) / n)
              << at;
        }
        // No shard over 3: the all-reduce once (no_sync) or k times.
        {
          const int n = 3;
          const uint64_t psi = PaddedElements(m, 1, mix.master);
          const SimulationReport r = MustSimulate(m, {.world_size = n,
                                                      .strategy = ShardingStrategy::kNoShard,
                                                      .root_unit = -1,
                                                      .micro_batches = k,
                                                      .accumulation = acc});
          const CollectiveTally ar = Tally(r, CollectiveKind::kAllReduce, n);
          EXPECT_EQ(ar.calls, units * reductions) << at;
          EXPECT_EQ(ar.payload_bytes, reductions * psi * er) << at;
          EXPECT_DOUBLE_EQ(r.ring_sent_bytes_per_rank,
                           static_cast<double>(2 * (n - 1) * reductions * psi * er) / n)
              << at;
        }
        // Hybrid 3 x 2: gathers every micro-batch, the reduce-scatter and the replicate
        // all-reduce once (no_sync) or k times.
        {
          const int n = 6, s = 2, replicas = 3;
          const uint64_t psi = PaddedElements(m, s, mix.master);
          const SimulationReport r = MustSimulate(m, {.world_size = n,
                                                      .strategy = ShardingStrategy::kHybridShard,
                                                      .shard_size = s,
                                                      .root_unit = -1,
                                                      .micro_batches = k,
                                                      .accumulation = acc});
          EXPECT_EQ(Tally(r, CollectiveKind::kAllGather, s).payload_bytes, 2 * k * psi * ep) << at;
          EXPECT_EQ(Tally(r, CollectiveKind::kReduceScatter, s).payload_bytes,
                    reductions * psi * er)
              << at;
          const CollectiveTally ar = Tally(r, CollectiveKind::kAllReduce, replicas);
          EXPECT_EQ(ar.calls, units * reductions) << at;
          EXPECT_EQ(ar.payload_bytes, reductions * psi / s * er) << at;
        }
      }
    }
  }
}

TEST(TuneAccumulationTest, OneMicroBatchIsTheDefaultAndKScaleTheWork) {
  const ModelDescription m = TestModel(5);
  const SimulationReport one = MustSimulate(m, {.world_size = 4, .forward_prefetch = 2});
  const SimulationReport explicit_one =
      MustSimulate(m, {.world_size = 4, .forward_prefetch = 2, .micro_batches = 1});
  EXPECT_EQ(explicit_one.step_time, one.step_time);
  EXPECT_EQ(explicit_one.exposed_communication, one.exposed_communication);
  EXPECT_EQ(explicit_one.memory.total_peak, one.memory.total_peak);
  EXPECT_EQ(explicit_one.event_logs, one.event_logs);
  for (const GradientAccumulation acc :
       {GradientAccumulation::kNoSync, GradientAccumulation::kSync}) {
    const SimulationReport r = MustSimulate(
        m, {.world_size = 4, .forward_prefetch = 2, .micro_batches = 3, .accumulation = acc});
    EXPECT_EQ(r.step_flops, 3 * one.step_flops);
    EXPECT_EQ(r.compute_time, absl::Seconds(static_cast<double>(3 * one.step_flops) / 50e12));
    EXPECT_DOUBLE_EQ(r.tokens_per_s_per_device, 3000 / absl::ToDoubleSeconds(*r.step_time));
    // Three micro-batches take at least three times one's compute.
    EXPECT_GE(*r.step_time, 3 * one.compute_time);
    // One log per micro-batch of the warm-up and of the measured step, per rank.
    ASSERT_EQ(r.event_logs.size(), 4u);
    EXPECT_EQ(r.event_logs[0].size(), 6u);
  }
  // Bad: no micro-batch.
  std::unique_ptr<SimCluster> cluster = Cluster();
  absl::StatusOr<SimulationReport> bad = Simulate(m, {.micro_batches = 0}, *cluster);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "micro_batches must be at least 1"))
      << bad.status();
}

TEST(TuneAccumulationTest, CpuOffloadMovesTheShardsToTheHostAndCopiesOverTheHostLink) {
  for (const Mix& mix :
       {Mix{DType::kF32, DType::kF32, DType::kF32}, Mix{DType::kBF16, DType::kF32, DType::kF32}}) {
    ModelDescription m = TestModel(3);
    m.precision = {
        .param_dtype = mix.param, .reduce_dtype = mix.reduce, .master_dtype = mix.master};
    const std::string at = m.precision.ToString();
    for (const ShardingStrategy s :
         {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      const SimulationConfig base{.world_size = 4, .strategy = s, .root_unit = -1};
      SimulationConfig offload = base;
      offload.cpu_offload = true;
      const SimulationReport a = MustSimulate(m, base);
      const SimulationReport b = MustSimulate(m, offload);
      // The same collectives.
      EXPECT_EQ(b.collectives.size(), a.collectives.size()) << at;
      for (const auto& [key, tally] : a.collectives) {
        ASSERT_TRUE(b.collectives.count(key)) << at;
        EXPECT_EQ(b.collectives.at(key).payload_bytes, tally.payload_bytes) << at;
        EXPECT_EQ(b.collectives.at(key).calls, tally.calls) << at;
      }
      // Shards, gradients and optimizer state: the same sizes, now on the host.
      EXPECT_EQ(b.memory.master_shards, a.memory.master_shards) << at;
      EXPECT_EQ(b.memory.sharded_grads, a.memory.sharded_grads) << at;
      EXPECT_EQ(b.memory.optimizer_state, a.memory.optimizer_state) << at;
      // The host holds them and, while a reduction's copy back is in flight, its reduced shard
      // (at most every unit's at once).
      const uint64_t held =
          a.memory.master_shards + a.memory.sharded_grads + a.memory.optimizer_state;
      const uint64_t psi = PaddedElements(m, 4, mix.master);
      EXPECT_GE(b.memory.host_peak, held) << at;
      EXPECT_LE(b.memory.host_peak, held + psi / 4 * DTypeSize(mix.reduce)) << at;
      EXPECT_EQ(a.memory.host_peak, 0u) << at;
      EXPECT_LT(b.memory.total_peak, a.memory.total_peak) << at;
      EXPECT_GT(*b.step_time, *a.step_time) << at;
    }
  }
  // Exactly the copies' time where every op is on the critical path: one unit, no prefetch, no
  // root. Forward: H2D of the master shard, cast, gather, compute; backward the same, then the
  // reduction and the D2H copy of the reduced shard. Changing the host link from B1 to B2
  // changes the step by bytes (1/B2 - 1/B1).
  ModelDescription one = TestModel(1);
  one.precision = {
      .param_dtype = DType::kBF16, .reduce_dtype = DType::kF32, .master_dtype = DType::kF32};
  const int n = 4;
  const uint64_t shard = PaddedElements(one, n, DType::kF32) / n;
  const uint64_t copied = 2 * shard * 4 /* master f32, two gathers */ + shard * 4 /* f32 grad */;
  const SimulationConfig c{.world_size = n,
                           .forward_prefetch = 0,
                           .backward_prefetch = BackwardPrefetch::kOff,
                           .root_unit = -1,
                           .cpu_offload = true};
  const SimulationReport fast = MustSimulate(one, c, 40e9);
  const SimulationReport slow = MustSimulate(one, c, 2e9);
  EXPECT_NEAR(absl::ToDoubleSeconds(*slow.step_time - *fast.step_time),
              static_cast<double>(copied) * (1 / 2e9 - 1 / 40e9), 1e-9);

  // A cluster without a host link.
  std::unique_ptr<SimCluster> none = Cluster(0);
  absl::StatusOr<SimulationReport> bad = Simulate(one, c, *none);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "host_link_GBps")) << bad.status();
}

TEST(TuneAccumulationTest, SweepExpandsAndWritesTheNewDimensions) {
  SweepSpace space{.world_size = 4,
                   .micro_batches = {1, 2},
                   .accumulation = {GradientAccumulation::kNoSync, GradientAccumulation::kSync},
                   .cpu_offload = {false, true}};
  absl::StatusOr<std::vector<SimulationConfig>> grid = ExpandSweep(space);
  ASSERT_TRUE(grid.ok()) << grid.status();
  // k = 1: one mode (x 2 offload); k = 2: two modes (x 2 offload).
  ASSERT_EQ(grid->size(), 6u);
  int k2 = 0, offloaded = 0;
  for (const SimulationConfig& c : *grid) {
    k2 += c.micro_batches == 2;
    offloaded += c.cpu_offload;
  }
  EXPECT_EQ(k2, 4);
  EXPECT_EQ(offloaded, 3);
  const ModelDescription m = TestModel(3);
  std::unique_ptr<SimCluster> cluster = Cluster();
  absl::StatusOr<SweepResult> r = RunSweep(m, *grid, *cluster, {});
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string csv = SweepToCsv(*r);
  EXPECT_TRUE(absl::StrContains(csv, "micro_batches,accumulation,cpu_offload,ok")) << csv;
  EXPECT_TRUE(absl::StrContains(csv, "mem_host_peak_bytes")) << csv;
  const std::string json = SweepToJson(*r, m, *cluster);
  EXPECT_TRUE(absl::StrContains(json,
                                "\"micro_batches\": 2, \"accumulation\": \"sync\", "
                                "\"cpu_offload\": true"))
      << json;
  for (size_t i = 0; i < r->rows.size(); ++i) {
    const SweepRow& row = r->rows[i];
    ASSERT_TRUE(row.status.ok()) << row.status;
    const std::string d = DescribeConfig(row.config);
    EXPECT_EQ(absl::StrContains(d, "offload"), row.config.cpu_offload) << d;
    EXPECT_EQ(absl::StrContains(d, "mb=2:"), row.config.micro_batches == 2) << d;
    EXPECT_EQ(row.report.memory.host_peak > 0, row.config.cpu_offload) << d;
  }
  space.micro_batches = {0};
  EXPECT_FALSE(ExpandSweep(space).ok());
}

}  // namespace
}  // namespace shardline
