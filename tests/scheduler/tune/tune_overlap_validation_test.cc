// The simulator against the overlap benchmark (scheduler/tune/overlap_validation.h) and the
// topology's memory_ops (collectives/sim/topology.h):
//   * memory_ops: parsed, defaulted member by member, written back, bad values named; a
//     topology cluster's timeline takes them;
//   * ParseOverlapBenchJson reads overlap_bench's --json form and names what is wrong;
//   * OverlapBenchModel: the benchmark's units, sizes and kernel times;
//   * PredictOverlapBench equals Simulate run directly on the documented model and
//     configuration, for every configuration of a run, and its figures are consistent.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "collectives/sim/calibration.h"
#include "collectives/sim/topology.h"
#include "scheduler/tune/overlap_validation.h"
#include "scheduler/tune/simulate.h"

namespace shardline {
namespace {

constexpr char kTopology[] = R"({
  "name": "two-ranks",
  "nodes": 1,
  "devices_per_node": 2,
  "device_memory_GiB": 4,
  "compute_TFLOPs": 0.01,
  "intra_node": {"bandwidth_GBps": 13.7, "latency_us": 17,
                 "efficiency": [{"bytes": 4096, "efficiency": 0.2},
                                {"bytes": 1048576, "efficiency": 0.9},
                                {"bytes": 8388608, "efficiency": 0.45}]}
  MEMORY
})";

std::string TopologyText(const std::string& memory) {
  return absl::StrReplaceAll(kTopology, {{"MEMORY", memory}});
}

TEST(MemoryOps, DefaultsAreTheTimelines) {
  absl::StatusOr<Topology> t = ParseTopology(TopologyText(""));
  ASSERT_TRUE(t.ok()) << t.status();
  const VirtualTimelineOptions defaults;
  EXPECT_EQ(t->memory_ops.copy_bytes_per_s, defaults.copy_bytes_per_s);
  EXPECT_EQ(t->memory_ops.cast_bytes_per_s, defaults.cast_bytes_per_s);
  EXPECT_EQ(t->memory_ops.reduce_bytes_per_s, defaults.reduce_bytes_per_s);
  EXPECT_EQ(t->memory_ops.fill_bytes_per_s, defaults.fill_bytes_per_s);
  EXPECT_EQ(t->memory_ops.op_overhead_s, 0);
}

TEST(MemoryOps, ParsedMemberByMemberAndWrittenBack) {
  absl::StatusOr<Topology> t = ParseTopology(TopologyText(
      R"(, "memory_ops": {"copy_GBps": 31.5, "fill_GBps": 57.25, "op_overhead_us": 3.5})"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_DOUBLE_EQ(t->memory_ops.copy_bytes_per_s, 31.5e9);
  EXPECT_DOUBLE_EQ(t->memory_ops.fill_bytes_per_s, 57.25e9);
  EXPECT_DOUBLE_EQ(t->memory_ops.op_overhead_s, 3.5e-6);
  EXPECT_EQ(t->memory_ops.cast_bytes_per_s, VirtualTimelineOptions().cast_bytes_per_s);
  EXPECT_EQ(t->memory_ops.reduce_bytes_per_s, VirtualTimelineOptions().reduce_bytes_per_s);
  absl::StatusOr<Topology> back = ParseTopology(TopologyToJson(*t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_NEAR(back->memory_ops.copy_bytes_per_s, 31.5e9, 1);
  EXPECT_NEAR(back->memory_ops.fill_bytes_per_s, 57.25e9, 1);
  EXPECT_NEAR(back->memory_ops.op_overhead_s, 3.5e-6, 1e-15);
  EXPECT_NEAR(back->memory_ops.cast_bytes_per_s, 50e9, 1);

  // A topology cluster's timeline takes them.
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster =
      CreateTopologyCluster(std::make_shared<Topology>(*t));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const VirtualTimelineOptions o = (*cluster)->TimelineOptions();
  EXPECT_DOUBLE_EQ(o.copy_bytes_per_s, 31.5e9);
  EXPECT_DOUBLE_EQ(o.fill_bytes_per_s, 57.25e9);
  EXPECT_DOUBLE_EQ(o.cast_bytes_per_s, 50e9);
  EXPECT_EQ(o.op_overhead, absl::Nanoseconds(3500));
}

TEST(MemoryOps, BadValuesNameTheField) {
  struct Case {
    std::string memory;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {R"(, "memory_ops": {"cast_GBps": 0})", "'memory_ops.cast_GBps' must be positive"},
           {R"(, "memory_ops": {"reduce_GBps": -2})", "'memory_ops.reduce_GBps' must be positive"},
           {R"(, "memory_ops": {"op_overhead_us": -1})",
            "'memory_ops.op_overhead_us' must be >= 0"},
           {R"(, "memory_ops": {"fill_GBps": "fast"})", "'memory_ops.fill_GBps' must be a number"},
           {R"(, "memory_ops": {"copy_GBs": 3})", "memory_ops.copy_GBs"},
           {R"(, "memory_ops": 5)", "'memory_ops' must be an object"},
       }) {
    absl::StatusOr<Topology> t = ParseTopology(TopologyText(c.memory));
    ASSERT_FALSE(t.ok()) << c.memory;
    EXPECT_TRUE(absl::IsInvalidArgument(t.status())) << t.status();
    EXPECT_NE(t.status().message().find(c.message), std::string::npos)
        << t.status() << " lacks " << c.message;
  }
}

TEST(Calibration, MedianOverRepeats) {
  auto run = [](const std::string& source, double t1, double t2, double in2) {
    PerfRun r;
    r.source = source;
    r.kind = CollectiveKind::kAllGather;
    r.nranks = 2;
    r.rows = {{.size_bytes = 4096, .out_of_place_s = t1, .in_place_s = t1 * 1.5},
              {.size_bytes = 1024, .out_of_place_s = t2, .in_place_s = in2}};
    return r;
  };
  std::vector<PerfRun> runs = {run("a", 3e-5, 7e-6, -1), run("b", 1e-5, 5e-6, 9e-6),
                               run("c", 2e-5, 6e-6, 4e-6)};
  PerfRun other = run("d", 1, 1, 1);
  other.kind = CollectiveKind::kReduceScatter;
  runs.push_back(other);
  const std::vector<PerfRun> median = MedianOverRepeats(runs);
  ASSERT_EQ(median.size(), 2u);
  EXPECT_EQ(median[0].source, "a +2 repeats (median)");
  ASSERT_EQ(median[0].rows.size(), 2u);
  EXPECT_EQ(median[0].rows[0].size_bytes, 1024.0);  // sizes ascending
  EXPECT_DOUBLE_EQ(median[0].rows[0].out_of_place_s, 6e-6);
  EXPECT_DOUBLE_EQ(median[0].rows[0].in_place_s, (4e-6 + 9e-6) / 2);  // two present: their mean
  EXPECT_DOUBLE_EQ(median[0].rows[1].out_of_place_s, 2e-5);
  EXPECT_DOUBLE_EQ(median[0].rows[1].in_place_s, 3e-5);
  EXPECT_EQ(median[1].source, "d");
  const std::vector<PerfRun> min = MinOverRepeats(runs);
  EXPECT_EQ(min[0].source, "a +2 repeats");
  EXPECT_DOUBLE_EQ(min[0].rows[0].out_of_place_s, 5e-6);
  EXPECT_DOUBLE_EQ(min[0].rows[0].in_place_s, 4e-6);
  EXPECT_DOUBLE_EQ(min[0].rows[1].in_place_s, 1.5e-5);
}

// An overlap_bench --json output (the fields the parser reads, plus others it ignores).
std::string RunJson(const std::string& configs, const std::string& compute = "stream") {
  return absl::StrCat(R"({
  "benchmark": "overlap_bench", "host": "h", "cpus": 2,
  "load_before": "1.0 1.0 1.0", "load_after": "2.0 1.0 1.0", "ranks": 2,
  "units": 7, "compute": ")",
                      compute, R"(", "root_unit": -1, "steps": 3, "warmup": 2, "reps": 2,
  "ratio": 0.8, "backward_factor": 2,
  "calibration": {"unit_bytes": 3145760, "all_gather_us": 250.5, "reduce_scatter_us": 410.0,
    "all_gather_min_max_us": [240, 260], "reduce_scatter_min_max_us": [400, 420],
    "zero_fill_us": 61.5, "forward_us": 380.2, "backward_us": 760.4},
  "configs": [)",
                      configs, "]}");
}

std::string ConfigJson(const std::string& name, int fp, const std::string& bp, int bd,
                       uint64_t budget, double step, double compute) {
  return absl::StrCat(R"({"name": ")", name, R"(", "forward_prefetch": )", fp,
                      R"(, "backward_prefetch": ")", bp, R"(", "backward_depth": )", bd,
                      R"(, "budget_bytes": )", budget, R"(, "median": {"step_ms": )", step,
                      R"(, "compute_ms": )", compute,
                      R"(, "gathers": 14, "reductions": 7, "enqueue_ms": 1},
     "samples": [{"step_ms": )",
                      step + 0.5, R"(}, {"step_ms": )", step - 0.25, "}]}");
}

TEST(OverlapBenchJson, Parsed) {
  const std::string json = RunJson(
      absl::StrCat(ConfigJson("off", 0, "off", 1, 0, 31.25, 12.5), ",",
                   ConfigJson("depth4-budget3", 4, "before_grad", 4, 9437280, 22.0, 11.75)));
  absl::StatusOr<OverlapBenchRun> run = ParseOverlapBenchJson(json);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ranks, 2);
  EXPECT_EQ(run->units, 7);
  EXPECT_EQ(run->root_unit, -1);
  EXPECT_EQ(run->unit_bytes, 3145760u);
  EXPECT_DOUBLE_EQ(run->backward_factor, 2);
  EXPECT_DOUBLE_EQ(run->zero_fill_us, 61.5);
  EXPECT_EQ(run->load_after, "2.0 1.0 1.0");
  ASSERT_EQ(run->configs.size(), 2u);
  const OverlapBenchConfig& c = run->configs[1];
  EXPECT_EQ(c.name, "depth4-budget3");
  EXPECT_EQ(c.forward_prefetch, 4);
  EXPECT_EQ(c.backward_prefetch, BackwardPrefetch::kBeforeGrad);
  EXPECT_EQ(c.backward_depth, 4);
  EXPECT_EQ(c.budget_bytes, 9437280u);
  EXPECT_DOUBLE_EQ(c.step_ms, 22.0);
  EXPECT_DOUBLE_EQ(c.compute_ms, 11.75);
  EXPECT_EQ(c.step_samples_ms, (std::vector<double>{22.5, 21.75}));
  EXPECT_EQ(run->configs[0].backward_prefetch, BackwardPrefetch::kOff);
}

TEST(OverlapBenchJson, ErrorsNameTheMember) {
  const std::string good = ConfigJson("off", 0, "off", 1, 0, 31.25, 12.5);
  struct Case {
    std::string json;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {RunJson(good, "caller"), "'compute' is 'caller'"},
           {RunJson(""), "'configs' is empty"},
           {RunJson(absl::StrReplaceAll(
                good, {{"\"off\", \"backward_depth\"", "\"sideways\", \"backward_depth\""}})),
            "'configs[0].backward_prefetch' is not a backward prefetch mode"},
           {RunJson(absl::StrReplaceAll(
                good, {{"\"forward_prefetch\": 0", "\"forward_prefetch\": 1.5"}})),
            "'configs[0].forward_prefetch' must be a whole number"},
           {RunJson(absl::StrReplaceAll(good, {{"\"compute_ms\": 12.5", "\"compute_ms\": 0"}})),
            "'configs[0].median' step_ms and compute_ms must be > 0"},
           {absl::StrReplaceAll(RunJson(good),
                                {{"\"unit_bytes\": 3145760", "\"unit_bytes\": 3145761"}}),
            "'calibration.unit_bytes' is not a multiple of 4"},
           {absl::StrReplaceAll(RunJson(good), {{"\"units\": 7", "\"units\": \"7\""}}),
            "'units' must be a number, got string"},
           {absl::StrReplaceAll(RunJson(good), {{"\"ranks\": 2,", ""}}), "'ranks' is missing"},
           {absl::StrReplaceAll(RunJson(good), {{"\"root_unit\": -1", "\"root_unit\": 7"}}),
            "'root_unit' is not below 'units'"},
           {absl::StrReplaceAll(RunJson(good), {{"overlap_bench", "all_gather_perf"}}),
            "'benchmark' is 'all_gather_perf'"},
       }) {
    absl::StatusOr<OverlapBenchRun> run = ParseOverlapBenchJson(c.json);
    ASSERT_FALSE(run.ok()) << c.message;
    EXPECT_TRUE(absl::IsInvalidArgument(run.status())) << run.status();
    EXPECT_NE(run.status().message().find(c.message), std::string::npos)
        << run.status() << " lacks " << c.message;
  }
}

TEST(OverlapBenchModel, UnitsSizesAndKernels) {
  absl::StatusOr<ModelDescription> m = OverlapBenchModel(5, 4 * 12345, 1001, 2003);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->units.size(), 5u);
  ASSERT_EQ(m->forward.size(), 5u);
  for (int u = 0; u < 5; ++u) {
    EXPECT_EQ(m->units[u].name, absl::StrCat("unit", u));
    EXPECT_EQ(m->units[u].ParameterCount(), 12345u);
    EXPECT_EQ(m->forward[u].unit, u);
    EXPECT_EQ(m->forward[u].forward_flops, 1001u);
    EXPECT_EQ(m->forward[u].backward_flops, 2003u);
    EXPECT_EQ(m->forward[u].activation_bytes, 0u);
  }
  EXPECT_EQ(m->precision.param_dtype, DType::kF32);
  EXPECT_EQ(m->precision.reduce_dtype, DType::kF32);
  EXPECT_FALSE(OverlapBenchModel(0, 16, 1, 1).ok());
  EXPECT_FALSE(OverlapBenchModel(2, 18, 1, 1).ok());
}

TEST(PredictOverlapBench, EqualsSimulateOnTheDocumentedModel) {
  absl::StatusOr<Topology> topo = ParseTopology(
      TopologyText(R"(, "memory_ops": {"copy_GBps": 21, "cast_GBps": 17, "fill_GBps": 43})"));
  ASSERT_TRUE(topo.ok()) << topo.status();
  const std::string json =
      RunJson(absl::StrCat(ConfigJson("off", 0, "off", 1, 0, 31.25, 12.5), ",",
                           ConfigJson("fwd1-bwd1", 1, "before_grad", 1, 0, 24.0, 11.9), ",",
                           ConfigJson("depth4-budget3", 4, "before_grad", 4, 9437280, 22.0, 11.75),
                           ",", ConfigJson("after", 2, "after_grad", 2, 0, 23.0, 12.0)));
  absl::StatusOr<OverlapBenchRun> run = ParseOverlapBenchJson(json);
  ASSERT_TRUE(run.ok()) << run.status();
  for (const bool zero_fill : {false, true}) {
    absl::StatusOr<std::vector<OverlapPrediction>> p =
        PredictOverlapBench(*topo, *run, {.zero_fill = zero_fill});
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->size(), run->configs.size());
    for (size_t i = 0; i < p->size(); ++i) {
      const OverlapBenchConfig& c = run->configs[i];
      const OverlapPrediction& got = (*p)[i];
      SCOPED_TRACE(c.name);
      // The reference: the documented model and configuration, simulated here.
      Topology t = *topo;
      t.compute_flops_per_s = 1e9;
      t.device_memory_bytes = uint64_t{1} << 60;
      absl::StatusOr<std::unique_ptr<SimCluster>> cluster =
          CreateTopologyCluster(std::make_shared<Topology>(t));
      ASSERT_TRUE(cluster.ok());
      const double fwd_ns = c.compute_ms / 7 / 3 * 1e6;
      double bwd_ns = 2 * fwd_ns;
      if (zero_fill && c.backward_prefetch == BackwardPrefetch::kOff) bwd_ns += 61.5e3;
      absl::StatusOr<ModelDescription> model =
          OverlapBenchModel(7, 3145760, std::llround(fwd_ns), std::llround(bwd_ns));
      ASSERT_TRUE(model.ok());
      SimulationConfig config{.world_size = 2,
                              .forward_prefetch = c.forward_prefetch,
                              .backward_prefetch = c.backward_prefetch,
                              .backward_prefetch_depth = c.backward_depth,
                              .budget_bytes = c.budget_bytes,
                              .root_unit = -1,
                              .host_lead = HostLead::kWholeStep};
      absl::StatusOr<SimulationReport> r = Simulate(*model, config, **cluster);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(got.predicted_step_ms, absl::ToDoubleMilliseconds(*r->step_time));
      EXPECT_EQ(got.predicted_exposed_ms, absl::ToDoubleMilliseconds(*r->exposed_communication));
      EXPECT_EQ(got.compute_ms, absl::ToDoubleMilliseconds(r->compute_time));
      EXPECT_EQ(got.measured_step_ms, c.step_ms);
      EXPECT_DOUBLE_EQ(got.error, (got.predicted_step_ms - c.step_ms) / c.step_ms);
      // The kernels given are the measured ones (+ the fills where modelled): 7 x (f + b).
      EXPECT_NEAR(got.compute_ms, 7 * (std::llround(fwd_ns) + std::llround(bwd_ns)) / 1e6, 1e-9);
      // Every unit gathered in forward and backward (no root), reduced once.
      EXPECT_EQ(got.predicted_gathers, 14);
      EXPECT_EQ(got.predicted_reductions, 7);
      // A step is at least its compute and at most compute + every collective in sequence.
      EXPECT_GT(got.predicted_step_ms, got.compute_ms);
    }
  }
  // Too few devices.
  Topology one = *topo;
  one.devices_per_node = 1;
  EXPECT_FALSE(PredictOverlapBench(one, *run).ok());
}

}  // namespace
}  // namespace shardline
