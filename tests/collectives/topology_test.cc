// The sim backend's topology (collectives/sim/topology.h): schema validation names the field,
// the JSON form round-trips, the shipped examples load, the efficiency curve interpolates, group
// shapes, and every cost formula against a hand computation.

#include "collectives/sim/topology.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_replace.h"
#include "collectives/sim/sim_communicator.h"
#include "gmock/gmock.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

// 4 nodes x 4 devices; intra 100 GB/s, 2 us per hop; 2 NICs of 50 GB/s per node (25 GB/s per
// device), 10 us per hop.
constexpr char kBase[] = R"({
  "name": "test4x4",
  "description": "round numbers",
  "nodes": 4,
  "devices_per_node": 4,
  "device_memory_GiB": 16,
  "compute_TFLOPs": 100,
  "intra_node": {"bandwidth_GBps": 100, "latency_us": 2},
  "inter_node": {"nics_per_node": 2, "nic_bandwidth_GBps": 50, "latency_us": 10}
})";

Topology Base() {
  absl::StatusOr<Topology> t = ParseTopology(kBase);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

// Seconds, compared to a hand computation in microseconds.
void ExpectUs(double seconds, double us) { EXPECT_NEAR(seconds * 1e6, us, 1e-9 * us + 1e-12); }

TEST(TopologyTest, ParsesTheFieldsInSiUnits) {
  const Topology t = Base();
  EXPECT_EQ(t.name, "test4x4");
  EXPECT_EQ(t.nodes, 4);
  EXPECT_EQ(t.devices_per_node, 4);
  EXPECT_EQ(t.devices(), 16);
  EXPECT_EQ(t.device_memory_bytes, uint64_t{16} << 30);
  EXPECT_EQ(t.compute_flops_per_s, 100e12);
  EXPECT_EQ(t.intra_node.bandwidth_bytes_per_s, 100e9);
  EXPECT_DOUBLE_EQ(t.intra_node.latency_s, 2e-6);
  EXPECT_EQ(t.nics_per_node, 2);
  EXPECT_EQ(t.rail_bandwidth_bytes_per_s(), 25e9);
  EXPECT_DOUBLE_EQ(t.inter_node.latency_s, 10e-6);
  EXPECT_EQ(t.collectives, DefaultCollectiveAlgorithms());
  EXPECT_EQ(ComputeDuration(t, 3e12, DType::kBF16), absl::Milliseconds(30));
  EXPECT_EQ(ComputeDuration(t, 3e12, DType::kF32), absl::Milliseconds(30)) << "one figure for all";
}

TEST(TopologyTest, PeaksAreKeptPerDTypeApartFromTheAchievedThroughput) {
  EXPECT_EQ(Base().PeakFlopsPerS(DType::kBF16), 0) << "not stated";
  const std::string json = absl::StrReplaceAll(
      kBase, {{R"("compute_TFLOPs": 100,)",
               R"("compute_TFLOPs": 100, "peak_TFLOPs": {"bfloat16": 312.5, "f32": 19.5},
                  "peak_source": "a datasheet",)"}});
  absl::StatusOr<Topology> t = ParseTopology(json);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->compute_flops_per_s, 100e12);
  EXPECT_EQ(t->PeakFlopsPerS(DType::kBF16), 312.5e12);
  EXPECT_EQ(t->PeakFlopsPerS(DType::kF32), 19.5e12);
  EXPECT_EQ(t->PeakFlopsPerS(DType::kF16), 0);
  EXPECT_EQ(t->peak_source, "a datasheet");
  // compute_TFLOPs per dtype: a dtype it does not name cannot compute.
  const std::string per_dtype = absl::StrReplaceAll(
      json, {{R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": {"bf16": 150, "f32": 9.75},)"}});
  absl::StatusOr<Topology> p = ParseTopology(per_dtype);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(ComputeDuration(*p, 3e12, DType::kBF16), absl::Milliseconds(20));
  EXPECT_EQ(ComputeDuration(*p, 9.75e12, DType::kF32), absl::Seconds(1));
  EXPECT_EQ(p->ComputeFlopsPerS(DType::kF16), 0);
  EXPECT_EQ(ComputeDuration(*p, 1, DType::kF16), absl::InfiniteDuration());
  absl::StatusOr<Topology> p_again = ParseTopology(TopologyToJson(*p));
  ASSERT_TRUE(p_again.ok()) << p_again.status();
  EXPECT_EQ(*p_again, *p);
  absl::StatusOr<Topology> again = ParseTopology(TopologyToJson(*t));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *t);
}

// compute_efficiency: matmul at a fraction of the peak, attention at the FlashAttention curve
// (log-interpolated in the sequence length; half the square when causal, 2.5 times in the
// backward), memory-bound bytes at the fill rate, the rest at compute_TFLOPs.
TEST(TopologyTest, ComputeEfficiencyTimesEachKindOfWork) {
  const std::string json =
      absl::StrReplaceAll(kBase, {{R"("compute_TFLOPs": 100,)",
                                   R"("compute_TFLOPs": 100, "peak_TFLOPs": {"bf16": 400},
                  "compute_efficiency": {"matmul": {"bf16": 0.75},
                    "attention_TFLOPs": {"bf16": [{"seq_len": 1024, "TFLOPs": 150},
                                                  {"seq_len": 4096, "TFLOPs": 250}]},
                    "source": "measured somewhere"},
                  "memory_ops": {"fill_GBps": 2000},)"}});
  absl::StatusOr<Topology> t = ParseTopology(json);
  ASSERT_TRUE(t.ok()) << t.status();
  const ComputeEfficiency& e = t->compute_efficiency;
  EXPECT_EQ(e.AttentionFlopsPerS(DType::kBF16, 512), 150e12) << "flat below the first point";
  EXPECT_EQ(e.AttentionFlopsPerS(DType::kBF16, 8192), 250e12) << "flat above the last";
  EXPECT_DOUBLE_EQ(e.AttentionFlopsPerS(DType::kBF16, 2048), 200e12) << "half way in log2";
  EXPECT_EQ(e.AttentionFlopsPerS(DType::kF32, 2048), 0);
  const ComputeWork work = {.matmul_flops = 3e12,
                            .attention_flops = 8e12,
                            .causal = true,
                            .attention_seq_len = 2048,
                            .elementwise_bytes = 4e9,
                            .other_flops = 5e12};
  // 3e12 / 300e12 + 4e12 / 200e12 + 4e9 / 2000e9 + 5e12 / 100e12 = 10 + 20 + 2 + 50 ms.
  EXPECT_NEAR(absl::ToDoubleMilliseconds(ComputeDuration(*t, work, DType::kBF16)), 82, 1e-9);
  ComputeWork backward = work;
  backward.backward = true;  // the attention kernel's work 2.5 times: 50 ms
  EXPECT_NEAR(absl::ToDoubleMilliseconds(ComputeDuration(*t, backward, DType::kBF16)), 112, 1e-9);
  // A dtype the efficiency does not name: every FLOP at compute_TFLOPs, the bytes free.
  EXPECT_NEAR(absl::ToDoubleMilliseconds(ComputeDuration(*t, work, DType::kF32)), 160, 1e-9);
  absl::StatusOr<Topology> again = ParseTopology(TopologyToJson(*t));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *t);
}

TEST(TopologyTest, ValidationErrorsNameTheField) {
  struct Case {
    std::string from, to;  // a replacement in kBase
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"("nodes": 4)", R"("nodes": 0)", "field 'nodes' must be >= 1, got 0"},
      {R"("nodes": 4)", R"("nodes": 4.5)", "field 'nodes' must be an integer, got number"},
      {R"("nodes": 4)", R"("nodes": -2)", "field 'nodes' must be in [0, 2^30], got -2"},
      {R"("devices_per_node": 4)", R"("devices_per_node": "4")",
       "field 'devices_per_node' must be an integer, got string"},
      {R"("device_memory_GiB": 16)", R"("device_memory_GiB": 0)",
       "field 'device_memory_GiB' must be positive"},
      {R"("compute_TFLOPs": 100)", R"("compute_TFLOPs": -1)",
       "field 'compute_TFLOPs' must be positive and finite, got -1"},
      {R"("bandwidth_GBps": 100)", R"("bandwidth_GBps": 0)",
       "field 'intra_node.bandwidth_GBps' must be positive and finite, got 0 GB/s"},
      {R"("latency_us": 2})", R"("latency_us": -1})",
       "field 'intra_node.latency_us' must be >= 0 and finite, got -1 us"},
      {R"("nics_per_node": 2)", R"("nics_per_node": 0)",
       "field 'inter_node.nics_per_node' must be >= 1 when nodes > 1, got 0"},
      {R"("nic_bandwidth_GBps": 50)", R"("nic_bandwith_GBps": 50)",
       "field 'inter_node.nic_bandwidth_GBps' is missing"},
      {R"("latency_us": 2})", R"("latency_us": 2, "efficency": []})",
       "field 'intra_node.efficency' is not a topology field (misspelt?)"},
      {R"("latency_us": 2})",
       R"("latency_us": 2, "efficiency": [{"bytes": 1000, "efficiency": 0.5},
                                           {"bytes": 1000, "efficiency": 1}]})",
       "field 'intra_node.efficiency[1].bytes' must be larger than the previous point's"},
      {R"("latency_us": 2})",
       R"("latency_us": 2, "efficiency": [{"bytes": 1000, "efficiency": 1.5}]})",
       "field 'intra_node.efficiency[0].efficiency' must be in (0, 1], got 1.5"},
      {R"("latency_us": 2})", R"("latency_us": 2, "efficiency": [{"bytes": 0, "efficiency": 1}]})",
       "field 'intra_node.efficiency[0].bytes' must be positive and finite, got 0"},
      {R"("latency_us": 2})", R"("latency_us": 2, "efficiency": {}})",
       "field 'intra_node.efficiency' must be an array, got object"},
      {R"("name": "test4x4")", R"("name": "")", "field 'name' must not be empty"},
      {R"("name": "test4x4",)", "", "field 'name' is missing"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "flops": 1,)",
       "field 'flops' is not a topology field"},
      {R"("intra_node")", R"("intra")", "field 'intra_node' is missing"},
      {R"("nodes": 4)", R"("nodes": 4, "collectives": {"all_gather": {"tree": {}}})",
       "field 'collectives.all_gather.tree' does not exist for all_gather"},
      {R"("nodes": 4)", R"("nodes": 4, "collectives": {"all_reduce": {"tree": {}}})",
       "field 'collectives.all_reduce' must list \"ring\""},
      {R"("nodes": 4)", R"("nodes": 4, "collectives": {"all_reduce": {"rings": {}}})",
       "field 'collectives.all_reduce.rings' is not an algorithm"},
      {R"("nodes": 4)",
       R"("nodes": 4, "collectives": {"all_reduce": {"ring": {"bandwidth_factor": 0}}})",
       "field 'collectives.all_reduce.ring.bandwidth_factor' must be in (0, 1], got 0"},
      {R"("nodes": 4)", R"("nodes": 4, "collectives": {"all_reduce": {"ring": {"latency": 1}}})",
       "field 'collectives.all_reduce.ring.latency' is not a topology field"},
      {R"("nodes": 4)", R"("nodes": 4, "collectives": {"allreduce": {"ring": {}}})",
       "field 'collectives.allreduce' is not a topology field"},
      {R"("nodes": 4,)", R"("nodes": 4,,)", "topology: JSON line 4 column 14"},
      {R"("nodes": 4,)", R"("nodes": 4, "host_cores": -2,)",
       "field 'host_cores' must be >= 0 and finite, got -2"},
      {R"("nodes": 4,)", R"("nodes": 4, "host_cores": "2",)",
       "field 'host_cores' must be a number, got string"},
      {R"("nodes": 4,)", R"("nodes": 4, "host_lockstep": 1,)",
       "field 'host_lockstep' must be true or false, got integer"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "peak_TFLOPs": {"bf18": 1},)",
       "field 'peak_TFLOPs.bf18' is not a dtype"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "peak_TFLOPs": {"bf16": 0},)",
       "field 'peak_TFLOPs.bf16' must be positive and finite, got 0"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "peak_TFLOPs": {"f32": "67"},)",
       "field 'peak_TFLOPs.f32' must be a number, got string"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "peak_TFLOPs": 989,)",
       "field 'peak_TFLOPs' must be an object, got integer"},
      {R"("compute_TFLOPs": 100,)",
       R"("compute_TFLOPs": 100, "compute_efficiency": {"matmul": {"bf16": 0.5}, "source": "s"},)",
       "field 'compute_efficiency.matmul.bf16' needs peak_TFLOPs for the dtype"},
      {R"("compute_TFLOPs": 100,)",
       R"("compute_TFLOPs": 100, "peak_TFLOPs": {"bf16": 9},
          "compute_efficiency": {"matmul": {"bf16": 1.5}, "source": "s"},)",
       "field 'compute_efficiency.matmul.bf16' must be in (0, 1], got 1.5"},
      {R"("compute_TFLOPs": 100,)",
       R"("compute_TFLOPs": 100, "compute_efficiency": {"matmul": {}},)",
       "field 'compute_efficiency.source' is missing"},
      {R"("compute_TFLOPs": 100,)",
       R"("compute_TFLOPs": 100, "compute_efficiency": {"source": "s", "attention_TFLOPs":
          {"bf16": [{"seq_len": 2048, "TFLOPs": 1}, {"seq_len": 1024, "TFLOPs": 2}]}},)",
       "field 'compute_efficiency.attention_TFLOPs.bf16[1].seq_len' must be larger"},
      {R"("compute_TFLOPs": 100,)",
       R"("compute_TFLOPs": 100, "compute_efficiency": {"source": "s", "attention_TFLOPs":
          {"bf16": [{"seq_len": 2048, "TFLOPS": 1}]}},)",
       "field 'compute_efficiency.attention_TFLOPs.bf16[0].TFLOPs' is missing"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": {"f32": -3},)",
       "field 'compute_TFLOPs.f32' must be positive and finite, got -3"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": {},)",
       "field 'compute_TFLOPs' must be positive and finite, got 0"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": "fast",)",
       "field 'compute_TFLOPs' must be a number, got string"},
      {R"("compute_TFLOPs": 100,)", R"("compute_TFLOPs": 100, "peak_source": 1,)",
       "field 'peak_source' must be a string, got integer"},
  };
  for (const Case& c : cases) {
    const std::string json = absl::StrReplaceAll(kBase, {{c.from, c.to}});
    ASSERT_NE(json, kBase) << c.from;
    absl::StatusOr<Topology> t = ParseTopology(json);
    ASSERT_FALSE(t.ok()) << c.to;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(c.message)) << c.to;
  }
  // One node needs no inter_node; more do.
  const std::string one_node = absl::StrReplaceAll(kBase, {{R"("nodes": 4)", R"("nodes": 1)"},
                                                           {R"(,
  "inter_node": {"nics_per_node": 2, "nic_bandwidth_GBps": 50, "latency_us": 10})",
                                                            ""}});
  EXPECT_TRUE(ParseTopology(one_node).ok()) << ParseTopology(one_node).status();
  const std::string missing = absl::StrReplaceAll(one_node, {{R"("nodes": 1)", R"("nodes": 2)"}});
  EXPECT_THAT(ParseTopology(missing).status().message(),
              HasSubstr("field 'inter_node' is missing (nodes > 1)"));
  // Programmatic topologies go through the same checks.
  Topology t = Base();
  t.collectives[static_cast<int>(CollectiveKind::kAllReduce)].push_back(
      {.algorithm = CollectiveAlgorithm::kTree});
  EXPECT_THAT(ValidateTopology(t).message(),
              HasSubstr("field 'collectives.all_reduce.tree' is listed twice"));
  EXPECT_THAT(LoadTopology("/nonexistent/x.json").status().message(), HasSubstr("cannot open"));
}

TEST(TopologyTest, JsonRoundTrip) {
  Topology t = Base();
  t.description = "with \"quotes\" and a\nnewline";
  t.intra_node.efficiency = {{1000, 0.25}, {31622.7766, 0.6}, {1e6, 1}};
  t.inter_node.efficiency = {{4096, 0.1}, {1 << 22, 0.95}};
  t.collectives[static_cast<int>(CollectiveKind::kAllReduce)] = {
      {.algorithm = CollectiveAlgorithm::kTree, .bandwidth_factor = 0.85, .latency_s = 3e-6},
      {.algorithm = CollectiveAlgorithm::kRing}};
  t.device_memory_bytes = 85520809984;  // 79.65 GiB
  t.host_link_bytes_per_s = 12.5e9;
  t.host_cores = 1.5;
  t.host_lockstep = true;
  const std::string json = TopologyToJson(t);
  absl::StatusOr<Topology> back = ParseTopology(json);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
  // Unit conversions may move the last bit of a double.
  auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-15 * std::fabs(b); };
  EXPECT_EQ(back->name, t.name);
  EXPECT_EQ(back->description, t.description);
  EXPECT_EQ(back->device_memory_bytes, t.device_memory_bytes);
  EXPECT_TRUE(near(back->compute_flops_per_s, t.compute_flops_per_s));
  EXPECT_TRUE(near(back->intra_node.latency_s, t.intra_node.latency_s));
  EXPECT_TRUE(near(back->inter_node.bandwidth_bytes_per_s, t.inter_node.bandwidth_bytes_per_s));
  EXPECT_EQ(back->intra_node.efficiency, t.intra_node.efficiency);
  EXPECT_EQ(back->inter_node.efficiency, t.inter_node.efficiency);
  ASSERT_EQ(back->collectives[2].size(), 2u);
  EXPECT_EQ(back->collectives[2][0].algorithm, CollectiveAlgorithm::kTree);  // listed order kept
  EXPECT_EQ(back->collectives[2][0].bandwidth_factor, 0.85);
  EXPECT_TRUE(near(back->collectives[2][0].latency_s, 3e-6));
  EXPECT_EQ(back->collectives[0], t.collectives[0]);
  EXPECT_TRUE(near(back->host_link_bytes_per_s, t.host_link_bytes_per_s));
  EXPECT_EQ(back->host_cores, 1.5);
  EXPECT_TRUE(back->host_lockstep);
  EXPECT_EQ(Base().host_cores, 0);  // absent: not a host-memory machine
  EXPECT_FALSE(Base().host_lockstep);
  // And once more: the text is a fixed point.
  EXPECT_EQ(TopologyToJson(*back), json);
}

TEST(TopologyTest, ShippedExamplesLoad) {
  for (const char* file : {"dgx-h100.json", "h100-128-nodes.json", "dgx-a100.json",
                           "dgx-a100-cluster.json", "this-machine.json"}) {
    absl::StatusOr<Topology> t = LoadTopology(std::string(SHARDLINE_TOPOLOGIES_DIR) + "/" + file);
    ASSERT_TRUE(t.ok()) << file << ": " << t.status();
    EXPECT_FALSE(t->description.empty()) << file;
    // The GPU topologies state their datasheet's peaks and cite it; the achieved throughput
    // lies below the peak of the dtype the presets compute in.
    if (absl::string_view(file) != "this-machine.json") {
      EXPECT_GT(t->PeakFlopsPerS(DType::kBF16), t->ComputeFlopsPerS(DType::kBF16)) << file;
      EXPECT_GT(t->PeakFlopsPerS(DType::kF32), t->ComputeFlopsPerS(DType::kF32)) << file;
      EXPECT_GT(t->PeakFlopsPerS(DType::kF32), 0) << file;
      EXPECT_THAT(t->peak_source, HasSubstr("datasheet")) << file;
    }
  }
  absl::StatusOr<Topology> cluster =
      LoadTopology(std::string(SHARDLINE_TOPOLOGIES_DIR) + "/h100-128-nodes.json");
  ASSERT_TRUE(cluster.ok());
  EXPECT_EQ(cluster->devices(), 1024);
  EXPECT_EQ(cluster->nics_per_node, 8);
}

TEST(TopologyTest, EfficiencyCurveIsPiecewiseLinearInLogSize) {
  LinkModel link;
  EXPECT_EQ(link.Efficiency(123), 1.0);
  link.efficiency = {{1000, 0.25}, {1e6, 1.0}};
  EXPECT_EQ(link.Efficiency(1), 0.25);
  EXPECT_EQ(link.Efficiency(1000), 0.25);
  EXPECT_DOUBLE_EQ(link.Efficiency(1e4), 0.5);  // a third of the way in log2
  EXPECT_DOUBLE_EQ(link.Efficiency(std::sqrt(1e9)), 0.625);
  EXPECT_EQ(link.Efficiency(1e6), 1.0);
  EXPECT_EQ(link.Efficiency(1e9), 1.0);
  link.efficiency = {{1000, 0.25}, {8000, 0.5}, {64000, 0.8}};
  EXPECT_DOUBLE_EQ(link.Efficiency(4000), 0.25 + 0.25 * 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(link.Efficiency(16000), 0.5 + 0.3 / 3.0);
  EXPECT_EQ(link.Efficiency(1e9), 0.8);
}

TEST(TopologyTest, GroupShapes) {
  const Topology t = Base();
  auto shape = [&](std::vector<int> devices) { return GroupShapeOf(t, devices); };
  EXPECT_EQ(*shape({0, 1, 2, 3}), (GroupShape{4, 1, 4}));
  EXPECT_EQ(*shape({0, 4, 8, 12}), (GroupShape{4, 4, 1}));
  EXPECT_EQ(*shape({0, 1, 5}), (GroupShape{3, 2, 2}));
  EXPECT_EQ(*shape({15}), (GroupShape{1, 1, 1}));
  EXPECT_THAT(shape({0, 16}).status().message(),
              HasSubstr("rank 1 is placed on device 16, outside the topology's devices 0..15"));
  EXPECT_THAT(shape({3, 3}).status().message(), HasSubstr("rank 1 is placed on device 3, which"));
  EXPECT_FALSE(shape({}).ok());
  EXPECT_THAT(EstimateCollective(t, CollectiveKind::kAllGather, 1, DType::kF32, {8, 1, 8})
                  .status()
                  .message(),
              HasSubstr("does not fit 4 node(s) of 4 device(s)"));
}

TEST(TopologyTest, RingInsideANodeIsTheFlatModel) {
  // alpha = 5us, B = 1 GB/s inside one node: SimCollectiveCost's table.
  Topology t = Base();
  t.nodes = 1;
  t.devices_per_node = 8;
  t.intra_node.latency_s = 5e-6;
  t.intra_node.bandwidth_bytes_per_s = 1e9;
  SimOptions flat;
  flat.latency = absl::Microseconds(5);
  flat.bandwidth_bytes_per_s = 1e9;
  for (const CollectiveKind kind :
       {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
        CollectiveKind::kBroadcast, CollectiveKind::kAllToAll, CollectiveKind::kBarrier}) {
    for (const int n : {1, 2, 5, 8}) {
      for (const size_t count : {size_t{0}, size_t{1}, size_t{1001}, size_t{1} << 20}) {
        absl::StatusOr<CollectiveCost> c =
            EstimateCollective(t, kind, count, DType::kBF16, {n, 1, n});
        ASSERT_TRUE(c.ok()) << c.status();
        EXPECT_EQ(c->algorithm, CollectiveAlgorithm::kRing);
        EXPECT_NEAR(
            absl::ToDoubleNanoseconds(c->duration()),
            absl::ToDoubleNanoseconds(SimCollectiveCost(kind, count, DType::kBF16, n, flat)),
            // The flat model rounds each step's transfer to the nanosecond.
            2.0 * n)
            << CollectiveName(kind) << " n=" << n << " count=" << count;
      }
    }
  }
}

TEST(TopologyTest, FormulasAgainstHandComputation) {
  const Topology t = Base();
  auto with = [&](CollectiveAlgorithm a, CollectiveKind kind, size_t count, GroupShape g) {
    absl::StatusOr<CollectiveCost> c = EstimateCollectiveWith(t, a, kind, count, DType::kF32, g);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : CollectiveCost{};
  };
  using A = CollectiveAlgorithm;
  using K = CollectiveKind;

  // all_gather in one node, 4 ranks, p = 4000 B: L = 3 * 2us, X = 3 * 4000 B / 100 GB/s.
  CollectiveCost c = with(A::kRing, K::kAllGather, 1000, {4, 1, 4});
  ExpectUs(c.latency_s, 6);
  ExpectUs(c.transfer_s, 0.12);
  EXPECT_EQ(c.intra_bytes, 12000);
  EXPECT_EQ(c.inter_bytes, 0);

  // all_reduce over 4 nodes x 4, T = 4e6 B.
  //   ring: L = 30 * 10us; bus = 2*15/16 * 4e6 = 7.5e6: intra 5.625e6 / 100 GB/s = 56.25us,
  //         inter 1.875e6 / 25 GB/s = 75us -> X = 75us.
  c = with(A::kRing, K::kAllReduce, 1000000, {16, 4, 4});
  ExpectUs(c.latency_s, 300);
  ExpectUs(c.transfer_s, 75);
  EXPECT_DOUBLE_EQ(c.intra_bytes, 5.625e6);
  EXPECT_DOUBLE_EQ(c.inter_bytes, 1.875e6);
  //   tree: h = 2; L = 2 (3*2 + 2*10) = 52us; intra 6e6 -> 60us, inter 2e6 -> 80us.
  c = with(A::kTree, K::kAllReduce, 1000000, {16, 4, 4});
  ExpectUs(c.latency_s, 52);
  ExpectUs(c.transfer_s, 80);
  //   hierarchical: L = 2*3*2 + 2*3*10 = 72us; intra 2*3*1e6 = 6e6 -> 60us; inter
  //   2*3*4e6/16 = 1.5e6 -> 60us; X = 120us.
  c = with(A::kHierarchical, K::kAllReduce, 1000000, {16, 4, 4});
  ExpectUs(c.latency_s, 72);
  ExpectUs(c.transfer_s, 120);
  //   best: tree (132us < 192us < 375us).
  c = *EstimateCollective(t, K::kAllReduce, 1000000, DType::kF32, {16, 4, 4});
  EXPECT_EQ(c.algorithm, A::kTree);
  ExpectUs(c.seconds(), 132);

  // all_gather over 4 nodes x 4, p = 1e6 B.
  //   ring: L = 15 * 10 = 150us; bus 15e6: intra 11.25e6 -> 112.5us, inter 3.75e6 -> 150us.
  c = with(A::kRing, K::kAllGather, 250000, {16, 4, 4});
  ExpectUs(c.seconds(), 300);
  //   hierarchical: L = 3*10 + 3*2 = 36us; inter 3e6 -> 120us; intra 3*4*1e6 -> 120us.
  c = with(A::kHierarchical, K::kAllGather, 250000, {16, 4, 4});
  ExpectUs(c.latency_s, 36);
  ExpectUs(c.transfer_s, 240);
  EXPECT_EQ(c.inter_bytes, 3e6);
  EXPECT_EQ(c.intra_bytes, 12e6);
  EXPECT_EQ(EstimateCollective(t, K::kAllGather, 250000, DType::kF32, {16, 4, 4})->algorithm,
            A::kHierarchical);
  //   reduce_scatter: the same cost.
  ExpectUs(with(A::kHierarchical, K::kReduceScatter, 250000, {16, 4, 4}).seconds(), 276);

  // broadcast over 4 nodes x 4, T = 4e6: tree L = 3*2 + 2*10 = 26us, intra 3e6 -> 30us, inter
  // 1e6 -> 40us; hierarchical L = 3*10 + 3*2 = 36us, X = 4e6/25e9 + 4e6/100e9 = 200us.
  ExpectUs(with(A::kTree, K::kBroadcast, 1000000, {16, 4, 4}).seconds(), 66);
  ExpectUs(with(A::kHierarchical, K::kBroadcast, 1000000, {16, 4, 4}).seconds(), 236);
  // ring: L = 15 * 10us; bus = T: intra 3e6 -> 30us, inter 1e6 -> 40us.
  ExpectUs(with(A::kRing, K::kBroadcast, 1000000, {16, 4, 4}).seconds(), 190);

  // A replicate group, one rank per node (4 nodes): ring all_reduce T = 4e6: L = 6 * 10us,
  // bus = 6e6 all over the network at 25 GB/s = 240us. Tree: L = 2 * 2 * 10 = 40us, 8e6 B ->
  // 320us. No hierarchy with one rank per node.
  c = *EstimateCollective(t, K::kAllReduce, 1000000, DType::kF32, {4, 4, 1});
  EXPECT_EQ(c.algorithm, A::kRing);
  ExpectUs(c.seconds(), 300);
  EXPECT_EQ(c.intra_bytes, 0);
  ExpectUs(with(A::kTree, K::kAllReduce, 1000000, {4, 4, 1}).seconds(), 360);
  EXPECT_THAT(
      EstimateCollectiveWith(t, A::kHierarchical, K::kAllReduce, 1000000, DType::kF32, {4, 4, 1})
          .status()
          .message(),
      HasSubstr("algorithm hierarchical does not apply to all_reduce on 4 ranks over 4"));
  EXPECT_FALSE(EstimateCollectiveWith(t, A::kTree, K::kAllGather, 1, DType::kF32, {16, 4, 4}).ok());
  EXPECT_FALSE(EstimateCollectiveWith(t, A::kTree, K::kAllReduce, 1, DType::kF32, {4, 1, 4}).ok());

  // all_to_all and barrier: rings. 2 nodes x 2 (n = 4), p = 1e6: L = 3 * 10us; bus 3e6: intra
  // 1.5e6 -> 15us, inter 1.5e6 -> 60us.
  ExpectUs(EstimateCollective(t, K::kAllToAll, 250000, DType::kF32, {4, 2, 2})->seconds(), 90);
  ExpectUs(EstimateCollective(t, K::kBarrier, 0, DType::kU8, {4, 2, 2})->seconds(), 60);
  ExpectUs(EstimateCollective(t, K::kBarrier, 0, DType::kU8, {4, 1, 4})->seconds(), 12);
  // One rank: free.
  EXPECT_EQ(EstimateCollective(t, K::kAllReduce, 1 << 20, DType::kF32, {1, 1, 1})->seconds(), 0);
}

TEST(TopologyTest, EfficiencyAndAlgorithmCorrections) {
  Topology t = Base();
  // Inside a node: all_gather of p = 1e4 B per rank runs at eff(1e4) = 0.5.
  t.intra_node.efficiency = {{1000, 0.25}, {1e6, 1.0}};
  CollectiveCost c =
      *EstimateCollective(t, CollectiveKind::kAllGather, 2500, DType::kF32, {4, 1, 4});
  ExpectUs(c.transfer_s, 3 * 1e4 / (100e9 * 0.5) * 1e6);
  ExpectUs(c.latency_s, 6);
  // The all_reduce's chunk is T/n: T = 4e4 on 4 ranks -> m = 1e4 too.
  c = *EstimateCollective(t, CollectiveKind::kAllReduce, 10000, DType::kF32, {4, 1, 4});
  ExpectUs(c.transfer_s, 6 * 1e4 / (100e9 * 0.5) * 1e6);

  // A slower tree (factor 0.5, +3us): 55 + 160 = 215us loses to the hierarchy's 192us.
  t = Base();
  t.collectives[static_cast<int>(CollectiveKind::kAllReduce)] = {
      {.algorithm = CollectiveAlgorithm::kRing},
      {.algorithm = CollectiveAlgorithm::kTree, .bandwidth_factor = 0.5, .latency_s = 3e-6},
      {.algorithm = CollectiveAlgorithm::kHierarchical}};
  ASSERT_TRUE(ValidateTopology(t).ok());
  c = *EstimateCollectiveWith(t, CollectiveAlgorithm::kTree, CollectiveKind::kAllReduce, 1000000,
                              DType::kF32, {16, 4, 4});
  ExpectUs(c.seconds(), 215);
  c = *EstimateCollective(t, CollectiveKind::kAllReduce, 1000000, DType::kF32, {16, 4, 4});
  EXPECT_EQ(c.algorithm, CollectiveAlgorithm::kHierarchical);
  ExpectUs(c.seconds(), 192);
  // Only the ring listed: the ring, whatever is faster.
  t.collectives[static_cast<int>(CollectiveKind::kAllReduce)] = {
      {.algorithm = CollectiveAlgorithm::kRing}};
  c = *EstimateCollective(t, CollectiveKind::kAllReduce, 1000000, DType::kF32, {16, 4, 4});
  EXPECT_EQ(c.algorithm, CollectiveAlgorithm::kRing);
  ExpectUs(c.seconds(), 375);
}

}  // namespace
}  // namespace shardline
