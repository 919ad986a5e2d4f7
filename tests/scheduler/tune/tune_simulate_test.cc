// The simulation driver (scheduler/tune/simulate.h): the real scheduler on virtual time.
//   * FSDP's communication identities, exactly, counted from the collectives the scheduler
//     issued (the counting wrapper), for every rank's group sizes, with Ψ from the flat layouts'
//     padded sizes and every unit re-gathered in backward: full shard 3Ψ(N-1)/N, shard-grad-op
//     2Ψ(N-1)/N, no-shard 2Ψ(N-1)/N (all-reduce), hybrid 3Ψ(k-1)/k in the shard group plus
//     2(Ψ/k)(R-1)/R across; in several dtype mixes (the gathers move param_dtype, the
//     reductions reduce_dtype);
//   * peak parameter memory Σψ/N + (units in flight) x ψ for forward and backward prefetch
//     depths and unit budgets, in every mix of param and master dtypes;
//   * the issue order (gathers, reductions and the compute between them) on virtual time equals
//     the one on the local backend with host streams and real memory, for every rank, in the
//     warm-up and the measured step, across strategies, prefetch modes, depths and budgets; and
//     equals the documented example;
//   * activation and optimizer memory against plain sums; step time and the compute time;
//   * rank 0's Chrome trace holds the compute and the collectives at virtual times;
//   * bad configurations are errors naming the field;
//   * Llama 3 8B on 8 simulated ranks runs (and its figures are what the model says).
#include "scheduler/tune/simulate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/sim/topology.h"
#include "runtime/flat_layout.h"
#include "scheduler/tune/model.h"

namespace shardline {
namespace {

std::unique_ptr<SimCluster> Cluster() {
  absl::StatusOr<std::unique_ptr<SimCluster>> c = CreateFlatCluster(
      {.network = {.latency = absl::Microseconds(3), .bandwidth_bytes_per_s = 20e9},
       .compute_flops_per_s = 50e12,
       .device_memory_bytes = 1ull << 30});
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// `units` units of odd sizes (so that the layouts pad), used once each unless `tied`, where
// unit 0 is used again at the end. `uniform`: every unit has the same tensors.
ModelDescription TestModel(int units, bool tied, bool uniform) {
  ModelDescription m;
  m.name = "test";
  m.optimizer_state_bytes_per_param = 12;
  m.tokens_per_micro_batch = 1000;
  for (int u = 0; u < units; ++u) {
    const int64_t n = uniform ? 3001 : 1001 + 377 * u;
    const int64_t k = uniform ? 7 : 5 + (u % 3);
    m.units.push_back({.name = absl::StrCat("u", u),
                       .tensors = {{.name = "w", .shape = {n}}, {.name = "b", .shape = {k}}}});
    m.forward.push_back({.unit = u,
                         .forward_flops = 1'000'000'000ull * (u + 1),
                         .backward_flops = 2'000'000'000ull * (u + 1) + 17,
                         .activation_bytes = 100'003ull * (u + 2),
                         .checkpointed_activation_bytes = 10'007ull * (u + 1)});
  }
  if (tied) {
    m.forward.push_back({.unit = 0,
                         .forward_flops = 3'000'000'000ull,
                         .backward_flops = 6'000'000'000ull,
                         .activation_bytes = 55'555,
                         .checkpointed_activation_bytes = 55'555});
  }
  return m;
}

// Σ over units of the padded unsharded size in elements, for a shard group of `shards`.
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

SimulationReport MustSimulate(const ModelDescription& m, const SimulationConfig& c) {
  std::unique_ptr<SimCluster> cluster = Cluster();
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
const Mix kMixes[] = {{DType::kF32, DType::kF32, DType::kF32},
                      {DType::kBF16, DType::kF32, DType::kF32},
                      {DType::kBF16, DType::kBF16, DType::kF32},
                      {DType::kF16, DType::kF32, DType::kF64}};

TEST(TuneSimulateTest, CommunicationIdentitiesHoldExactly) {
  const int units = 5;
  const ModelDescription base = TestModel(units, /*tied=*/false, /*uniform=*/false);
  for (const Mix& mix : kMixes) {
    ModelDescription m = base;
    m.precision = {
        .param_dtype = mix.param, .reduce_dtype = mix.reduce, .master_dtype = mix.master};
    const uint64_t ep = DTypeSize(mix.param), er = DTypeSize(mix.reduce);
    const std::string what = absl::StrCat(m.precision.ToString());

    // Full shard and shard-grad-op over N, with every unit resharded (full) or kept (sgo).
    for (int n : {2, 4, 6}) {
      const uint64_t psi = PaddedElements(m, n, mix.master);
      for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
        SimulationConfig c{.world_size = n, .strategy = s, .root_unit = -1};
        const SimulationReport r = MustSimulate(m, c);
        const bool full = s == ShardingStrategy::kFullShard;
        const CollectiveTally ag = Tally(r, CollectiveKind::kAllGather, n);
        const CollectiveTally rs = Tally(r, CollectiveKind::kReduceScatter, n);
        const std::string at = absl::StrCat(what, " ", ShardingStrategyName(s), " N=", n);
        EXPECT_EQ(ag.calls, (full ? 2u : 1u) * units) << at;
        EXPECT_EQ(ag.payload_bytes, (full ? 2 : 1) * psi * ep) << at;
        EXPECT_EQ(rs.calls, static_cast<uint64_t>(units)) << at;
        EXPECT_EQ(rs.payload_bytes, psi * er) << at;
        EXPECT_EQ(Tally(r, CollectiveKind::kAllReduce, n).calls, 0u) << at;
        // N x bytes sent = (N-1)(2Ψ_param + Ψ_reduce) (full), (N-1)(Ψ_param + Ψ_reduce) (sgo).
        EXPECT_EQ(ag.ring_sent_bytes_times_size + rs.ring_sent_bytes_times_size,
                  (n - 1) * ((full ? 2 : 1) * psi * ep + psi * er))
            << at;
        EXPECT_DOUBLE_EQ(r.ring_sent_bytes_per_rank,
                         static_cast<double>((n - 1) * ((full ? 2 : 1) * psi * ep + psi * er)) / n)
            << at;
        EXPECT_EQ(r.collectives.size(), 2u) << at;  // the gather and the reduce communicator
      }
    }

    // No shard over N: the gradients all-reduced, 2Ψ(N-1)/N; gathers and reduce-scatters over
    // one rank send nothing.
    for (int n : {3, 4}) {
      const uint64_t psi = PaddedElements(m, 1, mix.master);
      const SimulationReport r = MustSimulate(
          m, {.world_size = n, .strategy = ShardingStrategy::kNoShard, .root_unit = -1});
      const CollectiveTally ar = Tally(r, CollectiveKind::kAllReduce, n);
      const std::string at = absl::StrCat(what, " no_shard N=", n);
      EXPECT_EQ(ar.calls, static_cast<uint64_t>(units)) << at;
      EXPECT_EQ(ar.payload_bytes, psi * er) << at;
      EXPECT_EQ(ar.ring_sent_bytes_times_size, 2 * (n - 1) * psi * er) << at;
      EXPECT_EQ(Tally(r, CollectiveKind::kAllGather, 1).ring_sent_bytes_times_size, 0u) << at;
      EXPECT_DOUBLE_EQ(r.ring_sent_bytes_per_rank, static_cast<double>(2 * (n - 1) * psi * er) / n)
          << at;
    }

    // Hybrid R x k: 3Ψ(k-1)/k in the shard group, 2(Ψ/k)(R-1)/R across the replicas.
    for (auto [n, k] : {std::pair{4, 2}, std::pair{6, 3}, std::pair{6, 2}, std::pair{8, 4}}) {
      const int replicas = n / k;
      const uint64_t psi = PaddedElements(m, k, mix.master);
      ASSERT_EQ(psi % k, 0u);
      const SimulationReport r = MustSimulate(m, {.world_size = n,
                                                  .strategy = ShardingStrategy::kHybridShard,
                                                  .shard_size = k,
                                                  .root_unit = -1});
      const std::string at = absl::StrCat(what, " hybrid ", replicas, "x", k);
      const CollectiveTally ag = Tally(r, CollectiveKind::kAllGather, k);
      const CollectiveTally rs = Tally(r, CollectiveKind::kReduceScatter, k);
      const CollectiveTally ar = Tally(r, CollectiveKind::kAllReduce, replicas);
      EXPECT_EQ(ag.payload_bytes, 2 * psi * ep) << at;
      EXPECT_EQ(rs.payload_bytes, psi * er) << at;
      EXPECT_EQ(ar.calls, static_cast<uint64_t>(units)) << at;
      EXPECT_EQ(ar.payload_bytes, psi / k * er) << at;
      EXPECT_EQ(ag.ring_sent_bytes_times_size + rs.ring_sent_bytes_times_size,
                (k - 1) * (2 * psi * ep + psi * er))
          << at;
      EXPECT_EQ(ar.ring_sent_bytes_times_size, 2 * (replicas - 1) * (psi / k * er)) << at;
      EXPECT_NEAR(r.ring_sent_bytes_per_rank,
                  static_cast<double>((k - 1) * (2 * psi * ep + psi * er)) / k +
                      static_cast<double>(2 * (replicas - 1) * (psi / k * er)) / replicas,
                  1e-6)
          << at;
    }
  }
}

TEST(TuneSimulateTest, PeakParameterMemoryIsShardsPlusUnitsInFlight) {
  const int units = 6;
  const ModelDescription base = TestModel(units, /*tied=*/false, /*uniform=*/true);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  struct Policy {
    int forward;
    BackwardPrefetch backward;
    int depth;
    int budget_units;
    int in_flight;  // the most units whose unsharded parameters are alive at once
  };
  const Policy policies[] = {
      {0, BackwardPrefetch::kOff, 1, 0, 1},        {1, BackwardPrefetch::kOff, 1, 0, 2},
      {2, BackwardPrefetch::kBeforeGrad, 1, 0, 3}, {1, BackwardPrefetch::kBeforeGrad, 3, 0, 4},
      {0, BackwardPrefetch::kAfterGrad, 2, 0, 3},  {3, BackwardPrefetch::kBeforeGrad, 2, 2, 2},
      {4, BackwardPrefetch::kBeforeGrad, 4, 3, 3}, {9, BackwardPrefetch::kBeforeGrad, 1, 0, 6},
  };
  const int n = 4;
  for (DType param : dtypes) {
    for (DType master : dtypes) {
      ModelDescription m = base;
      m.precision = {.param_dtype = param, .reduce_dtype = param, .master_dtype = master};
      absl::StatusOr<FlatLayout> layout =
          FlatLayout::Create(m.units[0].tensors, {.num_shards = n, .element_dtype = master});
      ASSERT_TRUE(layout.ok());
      const uint64_t shard_bytes = units * layout->shard_elements() * DTypeSize(master);
      const uint64_t psi = layout->total_elements() * DTypeSize(param);
      for (const Policy& p : policies) {
        const HostLead lead =
            (p.forward + p.depth) % 2 == 0 ? HostLead::kOneUse : HostLead::kWholeStep;
        const SimulationReport r = MustSimulate(m, {.world_size = n,
                                                    .forward_prefetch = p.forward,
                                                    .backward_prefetch = p.backward,
                                                    .backward_prefetch_depth = p.depth,
                                                    .budget_units = p.budget_units,
                                                    .root_unit = -1,
                                                    .host_lead = lead});
        const std::string at =
            absl::StrCat(m.precision.ToString(), " forward ", p.forward, " backward ",
                         BackwardPrefetchName(p.backward), " ", p.depth, " units ", p.budget_units,
                         " lead ", HostLeadName(lead));
        EXPECT_EQ(r.memory.master_shards, shard_bytes) << at;
        EXPECT_EQ(r.memory.master_shards + r.memory.unsharded_params_requested_peak,
                  shard_bytes + p.in_flight * psi)
            << at;
        EXPECT_EQ(r.metrics.budget_overshoots, 0) << at;
      }
    }
  }
}

TEST(TuneSimulateTest, IssueOrderOnVirtualTimeEqualsTheHostBackend) {
  const ModelDescription m = TestModel(5, /*tied=*/true, /*uniform=*/false);
  struct Case {
    ShardingStrategy strategy;
    int world;
    int shard;
    int forward;
    BackwardPrefetch backward;
    int depth;
    uint64_t budget_bytes;
    int budget_units;
    int root;
  };
  // The largest unit is 2513 f32 elements (about 10 KiB); its backward footprint (parameters and
  // gradient) about 20 KiB.
  const Case cases[] = {
      {ShardingStrategy::kFullShard, 2, 0, 0, BackwardPrefetch::kOff, 1, 0, 0, -1},
      {ShardingStrategy::kFullShard, 3, 0, 1, BackwardPrefetch::kBeforeGrad, 1, 0, 0, 0},
      {ShardingStrategy::kFullShard, 2, 0, 2, BackwardPrefetch::kAfterGrad, 2, 0, 2, -1},
      {ShardingStrategy::kFullShard, 4, 0, 3, BackwardPrefetch::kBeforeGrad, 3, 48 << 10, 0, -1},
      {ShardingStrategy::kShardGradOp, 2, 0, 1, BackwardPrefetch::kBeforeGrad, 2, 0, 0, 0},
      {ShardingStrategy::kNoShard, 3, 0, 1, BackwardPrefetch::kAfterGrad, 1, 0, 0, 0},
      {ShardingStrategy::kHybridShard, 4, 2, 2, BackwardPrefetch::kBeforeGrad, 2, 0, 3, 0},
  };
  for (const Case& k : cases) {
    for (HostLead lead : {HostLead::kOneUse, HostLead::kWholeStep}) {
      const SimulationConfig c{.world_size = k.world,
                               .strategy = k.strategy,
                               .shard_size = k.shard,
                               .forward_prefetch = k.forward,
                               .backward_prefetch = k.backward,
                               .backward_prefetch_depth = k.depth,
                               .budget_bytes = k.budget_bytes,
                               .budget_units = k.budget_units,
                               .root_unit = k.root,
                               .host_lead = lead};
      const std::string at =
          absl::StrCat(ShardingStrategyName(k.strategy), " world ", k.world, " forward ", k.forward,
                       " backward ", BackwardPrefetchName(k.backward), " ", k.depth, " budget ",
                       k.budget_bytes, "/", k.budget_units, " lead ", HostLeadName(lead));
      // The host backend with the other lead: the order depends on the hooks alone.
      SimulationConfig on_host = c;
      on_host.host_lead = lead == HostLead::kOneUse ? HostLead::kWholeStep : HostLead::kOneUse;
      const SimulationReport virt = MustSimulate(m, c);
      absl::StatusOr<SimulationReport> host = RunOnHostBackend(m, on_host);
      ASSERT_TRUE(host.ok()) << at << ": " << host.status();
      ASSERT_EQ(virt.event_logs.size(), static_cast<size_t>(k.world)) << at;
      ASSERT_EQ(host->event_logs.size(), static_cast<size_t>(k.world)) << at;
      for (int r = 0; r < k.world; ++r) {
        ASSERT_EQ(virt.event_logs[r].size(), 2u) << at;
        for (int step = 0; step < 2; ++step) {
          EXPECT_EQ(absl::StrJoin(virt.event_logs[r][step], ", "),
                    absl::StrJoin(host->event_logs[r][step], ", "))
              << at << " rank " << r << " step " << step;
        }
      }
      // The same collectives and bytes; the same host-side budget decisions.
      EXPECT_EQ(virt.ring_sent_bytes_per_rank, host->ring_sent_bytes_per_rank) << at;
      EXPECT_EQ(virt.metrics.deferred_prefetches, host->metrics.deferred_prefetches) << at;
      EXPECT_EQ(virt.metrics.peak_inflight_bytes, host->metrics.peak_inflight_bytes) << at;
      // Not vacuous: the measured step prefetches (a gather right before another unit's compute)
      // wherever a forward prefetch depth is set.
      const std::string log = absl::StrJoin(virt.event_logs[0][1], ", ");
      EXPECT_NE(log.find("AG"), std::string::npos) << at;
      if (k.forward > 0) {
        EXPECT_LT(log.find("AG u1"), log.find("f u0")) << at << ": " << log;
      }
    }
  }
}

// On a topology with a compute_efficiency, each use's compute is its work timed kind by kind
// (collectives/sim/topology.h): the compute time is their sum, written out here, for no, full
// and op checkpointing.
TEST(TuneSimulateTest, ComputeTimeIsTheWorkTimedKindByKind) {
  absl::StatusOr<Topology> topology = ParseTopology(R"({
    "name": "efficiency", "nodes": 1, "devices_per_node": 4, "device_memory_GiB": 80,
    "compute_TFLOPs": 10, "peak_TFLOPs": {"bf16": 100},
    "compute_efficiency": {"matmul": {"bf16": 0.5},
                           "attention_TFLOPs": {"bf16": [{"seq_len": 64, "TFLOPs": 25}]},
                           "source": "round numbers"},
    "intra_node": {"bandwidth_GBps": 100, "latency_us": 1},
    "memory_ops": {"fill_GBps": 1000}})");
  ASSERT_TRUE(topology.ok()) << topology.status();
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster =
      CreateTopologyCluster(std::make_shared<const Topology>(*topology));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  TransformerConfig c = Llama3_8B({.seq_len = 1024, .micro_batch = 1});
  c.layers = 3;
  c.hidden = 512;
  c.ffn = 1408;
  c.heads = 8;
  c.kv_heads = 2;
  c.vocab = 3001;
  absl::StatusOr<ModelDescription> m = TransformerModel(c);
  ASSERT_TRUE(m.ok()) << m.status();
  auto seconds = [](const ComputeWork& w, bool backward) {
    const double k = backward ? 2 : 1;
    return k * w.matmul_flops / 50e12 +
           w.attention_flops / (w.causal ? 2 : 1) * (backward ? 2.5 : 1) / 25e12 +
           k * w.elementwise_bytes / 1000e9;
  };
  for (const CheckpointMode mode :
       {CheckpointMode::kOff, CheckpointMode::kFull, CheckpointMode::kOp}) {
    absl::StatusOr<SimulationReport> r =
        Simulate(*m, {.world_size = 4, .activation_checkpointing = {.mode = mode}}, **cluster);
    ASSERT_TRUE(r.ok()) << r.status();
    double expected = 0;
    for (const UnitUse& u : m->forward) {
      ASSERT_TRUE(u.has_work);
      expected += seconds(u.forward_work, false) + seconds(u.forward_work, true);
      const bool layer = u.checkpointed_activation_bytes < u.activation_bytes;
      if (layer && mode == CheckpointMode::kFull) expected += seconds(u.forward_work, false);
      if (layer && mode == CheckpointMode::kOp) {
        expected += seconds(u.selective_recompute_work, false);
      }
    }
    // (Each op's duration is rounded to a quarter nanosecond.)
    EXPECT_NEAR(absl::ToDoubleSeconds(r->compute_time), expected, 1e-8) << static_cast<int>(mode);
  }
  // In f32, which the efficiency does not name: every FLOP at compute_TFLOPs, the bytes free.
  absl::StatusOr<SimulationReport> f32 =
      Simulate(*m, {.world_size = 4, .param_dtype = DType::kF32}, **cluster);
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_NEAR(absl::ToDoubleSeconds(f32->compute_time),
              static_cast<double>(m->ForwardFlops() + m->BackwardFlops()) / 10e12, 1e-8);
}

TEST(TuneSimulateTest, IssueOrderIsTheDocumentedOne) {
  // docs/scheduler.md: four units, forward depth 1, backward before the gradient depth 1, every
  // unit resharded.
  ModelDescription m = TestModel(4, /*tied=*/false, /*uniform=*/false);
  const SimulationReport r = MustSimulate(m, {.world_size = 2, .root_unit = -1});
  EXPECT_EQ(absl::StrJoin(r.event_logs[1][1], ", "),
            "AG u0, AG u1, f u0, AG u2, f u1, AG u3, f u2, f u3, AG u3, AG u2, b u3, RS u3, AG u1, "
            "b u2, RS u2, AG u0, b u1, RS u1, b u0, RS u0");
}

TEST(TuneSimulateTest, ActivationOptimizerAndComputeFigures) {
  ModelDescription m = TestModel(5, /*tied=*/true, /*uniform=*/false);
  // Selective figures of odd sizes for the uses checkpointing applies to.
  for (UnitUse& u : m.forward) {
    if (u.checkpointed_activation_bytes < u.activation_bytes) {
      u.selective = true;
      u.selective_activation_bytes = (u.activation_bytes + 2 * u.checkpointed_activation_bytes) / 3;
      u.selective_recompute_flops = u.forward_flops / 3 + 7;
    }
  }
  const int n = 4;
  const std::vector<ActivationCheckpointing> modes = {{},
                                                      {.mode = CheckpointMode::kFull},
                                                      {.mode = CheckpointMode::kOp},
                                                      {.mode = CheckpointMode::kLayer, .every = 2}};
  for (const ActivationCheckpointing& mode : modes) {
    const std::string what = ActivationCheckpointingName(mode);
    const SimulationReport r = MustSimulate(m, {.world_size = n, .activation_checkpointing = mode});
    // The plan by hand (simulate.h): what each use keeps and recomputes. The tied use keeps as
    // much either way: checkpointing does not apply to it.
    std::vector<uint64_t> kept, recompute;
    int layer = 0;
    for (const UnitUse& u : m.forward) {
      const bool applies = u.checkpointed_activation_bytes < u.activation_bytes;
      layer += applies ? 1 : 0;
      uint64_t k = u.activation_bytes, f = 0;
      if (applies && (mode.mode == CheckpointMode::kFull ||
                      (mode.mode == CheckpointMode::kLayer && layer % 2 == 0))) {
        k = u.checkpointed_activation_bytes;
        f = u.forward_flops;
      } else if (applies && mode.mode == CheckpointMode::kOp) {
        k = u.selective_activation_bytes;
        f = u.selective_recompute_flops;
      }
      kept.push_back(k);
      recompute.push_back(f);
    }
    // At use k's backward: what uses 0..k kept, and what use k recomputed beside it.
    uint64_t held = 0, expected = 0;
    for (const uint64_t k : kept) held += k;
    for (size_t k = m.forward.size(); k-- > 0;) {
      expected = std::max(expected, held + (m.forward[k].activation_bytes - kept[k]));
      held -= kept[k];
    }
    EXPECT_EQ(r.memory.activations_peak, expected) << what;
    uint64_t flops = 0, model_flops = 0;
    for (size_t k = 0; k < m.forward.size(); ++k) {
      const UnitUse& u = m.forward[k];
      flops += u.forward_flops + u.backward_flops + recompute[k];
      model_flops += u.forward_flops + u.backward_flops;
    }
    EXPECT_EQ(r.step_flops, flops) << what;
    EXPECT_EQ(r.model_flops, model_flops) << what;
    if (mode.mode != CheckpointMode::kOff) {
      EXPECT_GT(flops, model_flops) << what;
    }
    // (Durations have quarter-nanosecond resolution.)
    EXPECT_NEAR(absl::ToDoubleSeconds(r.compute_time), flops / 50e12, 1e-9);
    // The step is at least its compute; with prefetch most communication hides behind it.
    ASSERT_TRUE(r.step_time.has_value() && r.exposed_communication.has_value());
    EXPECT_GE(*r.step_time, r.compute_time);
    EXPECT_LT(*r.exposed_communication, *r.step_time);
    EXPECT_NEAR(r.tokens_per_s_per_device, 1000 / absl::ToDoubleSeconds(*r.step_time), 1e-6);
    // Optimizer state: 12 bytes per element of each padded master shard.
    uint64_t shard_elements = 0;
    for (const UnitDescription& u : m.units) {
      shard_elements += FlatLayout::Create(u.tensors, {.num_shards = n}).value().shard_elements();
    }
    EXPECT_EQ(r.memory.optimizer_state, 12 * shard_elements);
    EXPECT_EQ(r.memory.master_shards, 4 * shard_elements);
    EXPECT_EQ(r.memory.sharded_grads, 4 * shard_elements);
    // The device's peak is at most the sum of the parts' peaks, and at least the persistent
    // parts plus the activations.
    const MemoryReport& mem = r.memory;
    EXPECT_LE(mem.total_peak, mem.master_shards + mem.sharded_grads + mem.optimizer_state +
                                  mem.unsharded_params_peak + mem.grad_buffers_peak +
                                  mem.activations_peak);
    EXPECT_GE(mem.total_peak, mem.master_shards + mem.optimizer_state + mem.activations_peak);
    EXPECT_TRUE(r.fits);
  }
}

TEST(TuneSimulateTest, TraceShowsRankZerosStreamsOnVirtualTime) {
  const ModelDescription m = TestModel(3, /*tied=*/false, /*uniform=*/false);
  TraceWriter trace(0);
  const SimulationReport r = MustSimulate(m, {.world_size = 2, .trace = &trace});
  const std::string json = trace.ToJson();
  // Both steps' compute (one op per use and direction) and gathers, on their own tracks.
  for (const char* name : {"\"f u0\"", "\"b u2\"", "all_gather", "reduce_scatter", "\"compute\"",
                           "\"gather\"", "\"reduce\""}) {
    EXPECT_TRUE(absl::StrContains(json, name)) << name;
  }
  // Virtual time: every span lies within the two steps after the Unix epoch (the virtual
  // clock's start), not at wall-clock time.
  ASSERT_TRUE(r.step_time.has_value());
  int spans = 0;
  for (size_t at = json.find("\"ts\":"); at != std::string::npos;
       at = json.find("\"ts\":", at + 1)) {
    const double ts = std::strtod(json.c_str() + at + 5, nullptr);
    EXPECT_GE(ts, 0);
    EXPECT_LE(ts, 2 * absl::ToDoubleMicroseconds(*r.step_time) + 1000);
    ++spans;
  }
  EXPECT_GT(spans, 20);
}

TEST(TuneSimulateTest, BadConfigurationsAreErrors) {
  const ModelDescription m = TestModel(3, false, false);
  std::unique_ptr<SimCluster> cluster = Cluster();
  struct Case {
    SimulationConfig config;
    std::string expected;
  };
  const Case cases[] = {
      {{.world_size = 0}, "world_size must be at least 1"},
      {{.world_size = 4, .strategy = ShardingStrategy::kHybridShard, .shard_size = 3},
       "hybrid shard_size 3"},
      {{.world_size = 2, .forward_prefetch = -1}, "prefetch depths must not be negative"},
      {{.world_size = 2, .root_unit = 3}, "root_unit 3"},
      {{.world_size = 2, .budget_bytes = 100, .root_unit = -1}, "budget_bytes 100"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SimulationReport> r = Simulate(m, c.config, *cluster);
    ASSERT_FALSE(r.ok()) << c.expected;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.expected)) << r.status();
  }
  EXPECT_FALSE(CreateFlatCluster({.compute_flops_per_s = 0}).ok());
}

TEST(TuneSimulateTest, Llama3_8BOnEightRanks) {
  absl::StatusOr<ModelDescription> m = TransformerModel(Llama3_8B({.seq_len = 8192}));
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster = CreateFlatCluster(
      {.network = {.latency = absl::Microseconds(10), .bandwidth_bytes_per_s = 100e9},
       .compute_flops_per_s = 400e12,
       .device_memory_bytes = 80ull << 30});
  ASSERT_TRUE(cluster.ok());
  absl::StatusOr<SimulationReport> r =
      Simulate(*m, {.world_size = 8, .activation_checkpointing = {.mode = CheckpointMode::kFull}},
               **cluster);
  ASSERT_TRUE(r.ok()) << r.status();
  // Master shards f32, sharded gradients f32, AdamW's two f32 states: 16 bytes per parameter,
  // over 8 ranks (plus padding, less than a few KiB).
  const double params = static_cast<double>(m->ParameterCount());
  EXPECT_NEAR(static_cast<double>(r->memory.master_shards), params * 4 / 8, 1e5);
  EXPECT_NEAR(static_cast<double>(r->memory.optimizer_state), params * 8 / 8, 2e5);
  EXPECT_TRUE(r->fits) << r->memory.total_peak;
  ASSERT_TRUE(r->step_time.has_value());
  EXPECT_GE(*r->step_time, r->compute_time);
  // Root (the embedding) kept from forward to backward: gathered once; every other unit twice.
  EXPECT_EQ(Tally(*r, CollectiveKind::kAllGather, 8).calls, 2u * 34 - 1);
  EXPECT_EQ(Tally(*r, CollectiveKind::kReduceScatter, 8).calls, 34u);
  std::cout << "llama3-8b, 8 ranks, " << r->cluster << ": step "
            << absl::FormatDuration(*r->step_time) << " (compute "
            << absl::FormatDuration(r->compute_time) << ", exposed communication "
            << absl::FormatDuration(r->exposed_communication.value_or(absl::ZeroDuration()))
            << "), " << r->tokens_per_s_per_device << " tokens/s/device, sent "
            << r->ring_sent_bytes_per_rank / 1e9 << " GB/rank, peak "
            << static_cast<double>(r->memory.total_peak) / (1ull << 30) << " GiB (activations "
            << static_cast<double>(r->memory.activations_peak) / (1ull << 30)
            << " GiB, unsharded parameters "
            << static_cast<double>(r->memory.unsharded_params_peak) / (1ull << 30)
            << " GiB, gradient buffers "
            << static_cast<double>(r->memory.grad_buffers_peak) / (1ull << 30) << " GiB)\n";
}

}  // namespace
}  // namespace shardline
