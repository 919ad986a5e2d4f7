// shardline-tune (scheduler/tools/shardline_tune.cc), run as a process:
//   * a tiny sweep (a JSON model with odd sizes, a 2 x 4 topology file, strategies, shard sizes,
//     prefetch depths, checkpointing, reduce dtypes, a byte budget that some configurations
//     cannot meet): every JSON row equals Simulate() run directly for the same configuration
//     (step time, exposed communication, tokens/s, MFU, bytes per link level, every memory figure,
//     fits, errors), every CSV row equals its JSON row, the recommendation is the best fitting
//     row computed here, and the Chrome trace of it holds rank 0's compute and gathers;
//   * a preset with shape overrides on a shipped topology name;
//   * failures: every JSON row equals EstimateRecovery over SimulatedScenario run directly with
//     the same options (scheduler/tune/failures.h), shapes with one replica group skipped;
//   * bad flags exit with status 2 and a message naming what was wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "runtime/json.h"
#include "scheduler/tune/failures.h"
#include "scheduler/tune/simulate.h"
#include "tests/common/run_tool.h"

namespace shardline {
namespace {

using testing::ToolRun;

// Runs shardline-tune with `args` (shell words), bounded in time by timeout(1).
ToolRun RunTool(const std::string& args) { return testing::RunTool(SHARDLINE_TUNE_BIN, args); }

std::string TempDir() {
  std::string pattern = ::testing::TempDir() + "tune_cli_XXXXXX";
  const char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

void Write(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

constexpr char kTopology[] = R"({
  "name": "cli-2x4", "nodes": 2, "devices_per_node": 4, "device_memory_GiB": 0.0185,
  "compute_TFLOPs": 13.7,
  "intra_node": {"bandwidth_GBps": 90, "latency_us": 2,
                 "efficiency": [{"bytes": 1024, "efficiency": 0.3}, {"bytes": 1048576, "efficiency": 0.95}]},
  "inter_node": {"nics_per_node": 2, "nic_bandwidth_GBps": 12, "latency_us": 6}
})";

// Five units of odd sizes, the first used again at the end.
std::string ModelJson() {
  std::string units, forward;
  for (int u = 0; u < 5; ++u) {
    absl::StrAppend(&units, u ? ", " : "", "{\"name\": \"u", u,
                    "\", \"params\": ", 150001 + 70001 * u, "}");
    absl::StrAppend(&forward, u ? ", " : "", "{\"unit\": \"u", u,
                    "\", \"forward_flops\": ", 2000000001ull * (u + 1),
                    ", \"backward_flops\": ", 4000000003ull * (u + 1),
                    ", \"activation_bytes\": ", 400009 * (u + 2),
                    ", \"checkpointed_activation_bytes\": ", 40009 * (u + 1), "}");
  }
  absl::StrAppend(&forward, ", {\"unit\": \"u0\", \"forward_flops\": 1000000000, ",
                  "\"backward_flops\": 2000000000, \"activation_bytes\": 300007, ",
                  "\"checkpointed_activation_bytes\": 300007}");
  return absl::StrCat(R"({"name": "cli-model", "tokens_per_micro_batch": 4096,
    "precision": {"param_dtype": "bf16", "reduce_dtype": "f32", "master_dtype": "f32"},
    "units": [)",
                      units, "], \"forward\": [", forward, "]}");
}

const JsonValue& Member(const JsonValue& object, const std::string& name) {
  const JsonValue* v = object.Find(name);
  EXPECT_NE(v, nullptr) << name;
  static const JsonValue kNull;
  return v != nullptr ? *v : kNull;
}

TEST(TuneCliTest, SweepRowsEqualSimulateAndCsvEqualsJson) {
  const std::string dir = TempDir();
  Write(dir + "/topology.json", kTopology);
  Write(dir + "/model.json", ModelJson());
  const ToolRun run = RunTool(absl::StrCat(
      "sweep --model-json ", dir, "/model.json --topology ", dir, "/topology.json --world 8 ",
      "--strategies full,hybrid,no_shard,shard_grad_op --shard-sizes 4,2 --forward-prefetch 0,2 ",
      "--backward-prefetch off,after_grad --backward-depth 1,2 --budget-GiB 0,0.0017 ",
      "--checkpointing off,on --reduce-dtypes model,bf16 --peak-TFLOPs 20 --jobs 2 --no-progress ",
      "--json ", dir, "/out.json --csv ", dir, "/out.csv --trace ", dir, "/trace.json"));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "# recommended: row ")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "not modelled: the optimizer step")) << run.output;
  EXPECT_FALSE(absl::StrContains(run.output, "/240 configurations")) << "no progress bar asked for";

  absl::StatusOr<JsonValue> table = ParseJson(Read(dir + "/out.json"));
  ASSERT_TRUE(table.ok()) << table.status();
  const std::vector<JsonValue>& rows = Member(*table, "rows").items();
  // 5 meshes (full, hybrid 4, hybrid 2, no shard, shard-grad-op) x fp 2 x bp 3 (off; after 1, 2)
  // x budget 2 x ckpt 2 x reduce 2.
  ASSERT_EQ(rows.size(), 5u * 2 * 3 * 2 * 2 * 2);
  EXPECT_EQ(Member(*table, "world_size").integer(), 8);
  EXPECT_EQ(Member(*table, "peak_TFLOPs").number(), 20);

  absl::StatusOr<Topology> topology = LoadTopology(dir + "/topology.json");
  ASSERT_TRUE(topology.ok()) << topology.status();
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster =
      CreateTopologyCluster(std::make_shared<const Topology>(*topology));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<ModelDescription> model = ParseModelJson(ModelJson());
  ASSERT_TRUE(model.ok()) << model.status();

  int best = -1, errors = 0, not_fitting = 0;
  double best_tokens = 0;
  uint64_t best_peak = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const JsonValue& row = rows[i];
    const std::string what = absl::StrCat("row ", i);
    ASSERT_EQ(Member(row, "index").integer(), static_cast<int64_t>(i));
    SimulationConfig c{.world_size = 8, .ranks = RankMode::kAuto};
    const std::string strategy = Member(row, "strategy").string();
    c.strategy = strategy == "full"            ? ShardingStrategy::kFullShard
                 : strategy == "hybrid"        ? ShardingStrategy::kHybridShard
                 : strategy == "no_shard"      ? ShardingStrategy::kNoShard
                 : strategy == "shard_grad_op" ? ShardingStrategy::kShardGradOp
                                               : ShardingStrategy::kFullShard;
    ASSERT_TRUE(strategy == "full" || strategy == "hybrid" || strategy == "no_shard" ||
                strategy == "shard_grad_op")
        << strategy;
    if (c.strategy == ShardingStrategy::kHybridShard) {
      c.shard_size = static_cast<int>(Member(row, "shard_size").integer());
    }
    c.forward_prefetch = static_cast<int>(Member(row, "forward_prefetch").integer());
    const std::string bp = Member(row, "backward_prefetch").string();
    c.backward_prefetch = bp == "off" ? BackwardPrefetch::kOff : BackwardPrefetch::kAfterGrad;
    ASSERT_TRUE(bp == "off" || bp == "after_grad") << bp;
    c.backward_prefetch_depth = static_cast<int>(Member(row, "backward_prefetch_depth").integer());
    c.budget_bytes = static_cast<uint64_t>(Member(row, "budget_bytes").integer());
    c.budget_units = static_cast<int>(Member(row, "budget_units").integer());
    if (Member(row, "reduce_dtype").string() == "bf16") c.reduce_dtype = DType::kBF16;
    ASSERT_EQ(Member(row, "param_dtype").string(), "model");
    absl::StatusOr<ActivationCheckpointing> ckpt =
        ParseActivationCheckpointing(Member(row, "activation_checkpointing").string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    c.activation_checkpointing = *ckpt;

    absl::StatusOr<SimulationReport> r = Simulate(*model, c, **cluster);
    ASSERT_EQ(Member(row, "ok").boolean(), r.ok()) << what << ": " << r.status();
    if (!r.ok()) {
      EXPECT_EQ(Member(row, "error").string(), r.status().message()) << what;
      EXPECT_FALSE(Member(row, "fits").boolean()) << what;
      ++errors;
      continue;
    }
    EXPECT_EQ(Member(row, "error").string(), "") << what;
    EXPECT_EQ(Member(row, "representative").boolean(), r->representative) << what;
    EXPECT_EQ(Member(row, "ranks_simulated").integer(), r->ranks_simulated) << what;
    EXPECT_EQ(Member(row, "step_time_s").number(), absl::ToDoubleSeconds(*r->step_time)) << what;
    EXPECT_EQ(Member(row, "compute_time_s").number(), absl::ToDoubleSeconds(r->compute_time))
        << what;
    EXPECT_EQ(Member(row, "exposed_communication_s").number(),
              absl::ToDoubleSeconds(*r->exposed_communication))
        << what;
    EXPECT_EQ(Member(row, "communication_time_s").number(),
              absl::ToDoubleSeconds(*r->communication_time))
        << what;
    EXPECT_EQ(Member(row, "tokens_per_s_per_device").number(), r->tokens_per_s_per_device) << what;
    // MFU against --peak-TFLOPs without the recomputation, HFU with it.
    const double step_s = absl::ToDoubleSeconds(*r->step_time);
    EXPECT_EQ(Member(row, "peak_TFLOPs").number(), 20) << what;
    EXPECT_DOUBLE_EQ(Member(row, "mfu").number(),
                     static_cast<double>(r->model_flops) / step_s / 20e12)
        << what;
    EXPECT_DOUBLE_EQ(Member(row, "hfu").number(),
                     static_cast<double>(r->step_flops) / step_s / 20e12)
        << what;
    EXPECT_DOUBLE_EQ(Member(row, "compute_busy").number(),
                     absl::ToDoubleSeconds(r->compute_time) / step_s)
        << what;
    if (c.activation_checkpointing.mode == CheckpointMode::kFull) {
      EXPECT_LT(Member(row, "mfu").number(), Member(row, "hfu").number()) << what;
    } else {
      EXPECT_EQ(Member(row, "mfu").number(), Member(row, "hfu").number()) << what;
    }
    EXPECT_EQ(Member(row, "ring_sent_bytes_per_rank").number(), r->ring_sent_bytes_per_rank)
        << what;
    EXPECT_EQ(Member(row, "intra_node_bytes_per_device").number(), r->intra_node_bytes_per_device)
        << what;
    EXPECT_EQ(Member(row, "inter_node_bytes_per_device").number(), r->inter_node_bytes_per_device)
        << what;
    EXPECT_EQ(Member(row, "budget_overshoots").integer(), r->metrics.budget_overshoots) << what;
    const JsonValue& mem = Member(row, "memory");
    const MemoryReport& m = r->memory;
    EXPECT_EQ(Member(mem, "master_shards").integer(), static_cast<int64_t>(m.master_shards));
    EXPECT_EQ(Member(mem, "sharded_grads").integer(), static_cast<int64_t>(m.sharded_grads));
    EXPECT_EQ(Member(mem, "optimizer_state").integer(), static_cast<int64_t>(m.optimizer_state));
    EXPECT_EQ(Member(mem, "unsharded_params_peak").integer(),
              static_cast<int64_t>(m.unsharded_params_peak));
    EXPECT_EQ(Member(mem, "grad_buffers_peak").integer(),
              static_cast<int64_t>(m.grad_buffers_peak));
    EXPECT_EQ(Member(mem, "activations_peak").integer(), static_cast<int64_t>(m.activations_peak));
    EXPECT_EQ(Member(mem, "total_peak").integer(), static_cast<int64_t>(m.total_peak));
    EXPECT_EQ(Member(row, "fits").boolean(), r->fits) << what;
    EXPECT_EQ(r->fits, m.total_peak <= topology->device_memory_bytes) << what;
    if (!r->fits) {
      ++not_fitting;
      continue;
    }
    if (best < 0 || r->tokens_per_s_per_device > best_tokens ||
        (r->tokens_per_s_per_device == best_tokens && m.total_peak < best_peak)) {
      best = static_cast<int>(i);
      best_tokens = r->tokens_per_s_per_device;
      best_peak = m.total_peak;
    }
  }
  // The grid was built to have all three kinds of rows.
  EXPECT_GT(errors, 0);
  EXPECT_GT(not_fitting, 0);
  ASSERT_GE(best, 0);
  EXPECT_EQ(Member(*table, "best").integer(), best);
  EXPECT_TRUE(absl::StrContains(run.output, absl::StrCat("# recommended: row ", best, ",")))
      << run.output;

  // CSV: a header and one line per row, each field equal to the JSON's.
  const std::vector<std::string> lines =
      absl::StrSplit(Read(dir + "/out.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), rows.size() + 1);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  for (size_t i = 0; i < rows.size(); ++i) {
    // Error messages may hold commas: split on the quotes first.
    std::vector<std::string> cells;
    std::string cell;
    bool quoted = false;
    for (const char ch : lines[i + 1]) {
      if (ch == '"') {
        quoted = !quoted;
      } else if (ch == ',' && !quoted) {
        cells.push_back(cell);
        cell.clear();
      } else {
        cell += ch;
      }
    }
    cells.push_back(cell);
    ASSERT_EQ(cells.size(), header.size()) << lines[i + 1];
    for (size_t k = 0; k < header.size(); ++k) {
      std::string name = header[k];
      const JsonValue* v = nullptr;
      if (name.rfind("mem_", 0) == 0) {
        v = Member(rows[i], "memory").Find(name.substr(4, name.size() - 10));
      } else {
        v = rows[i].Find(name);
      }
      ASSERT_NE(v, nullptr) << name;
      switch (v->kind()) {
        case JsonValue::Kind::kString:
          EXPECT_EQ(cells[k], v->string()) << name << " row " << i;
          break;
        case JsonValue::Kind::kBool:
          EXPECT_EQ(cells[k], v->boolean() ? "true" : "false") << name << " row " << i;
          break;
        case JsonValue::Kind::kInteger:
          EXPECT_EQ(cells[k], absl::StrCat(v->integer())) << name << " row " << i;
          break;
        case JsonValue::Kind::kNull:
          EXPECT_EQ(cells[k], "") << name << " row " << i;
          break;
        default: {
          double d = 0;
          ASSERT_TRUE(absl::SimpleAtod(cells[k], &d)) << cells[k];
          EXPECT_EQ(d, v->number()) << name << " row " << i;
        }
      }
    }
  }

  // The trace: rank 0's compute and gathers of the recommended configuration.
  absl::StatusOr<JsonValue> trace = ParseJson(Read(dir + "/trace.json"));
  ASSERT_TRUE(trace.ok()) << trace.status();
  int compute = 0, gathers = 0;
  for (const JsonValue& e : Member(*trace, "traceEvents").items()) {
    const JsonValue* name = e.Find("name");
    const JsonValue* ph = e.Find("ph");
    if (name == nullptr || ph == nullptr || ph->string() != "X") continue;
    if (absl::StartsWith(name->string(), "f u") || absl::StartsWith(name->string(), "b u")) {
      ++compute;
    }
    if (name->string() == "all_gather") ++gathers;
  }
  // Two steps (warm-up and measured) of six forward and six backward uses.
  EXPECT_EQ(compute, 2 * 12);
  EXPECT_GT(gathers, 0);
  std::filesystem::remove_all(dir);
}

// MFU, HFU and busy without --peak-TFLOPs: each row against the topology's datasheet peak for
// its own param dtype; n/a (null) where the topology states none for it.
TEST(TuneCliTest, MfuIsAgainstTheTopologysPeakForEachRowsDType) {
  const std::string dir = TempDir();
  const std::string topology = absl::StrReplaceAll(
      kTopology, {{R"("compute_TFLOPs": 13.7,)",
                   R"("compute_TFLOPs": 13.7, "peak_TFLOPs": {"bf16": 41.3, "f32": 9.7},)"}});
  ASSERT_NE(topology, kTopology);
  Write(dir + "/topology.json", topology);
  Write(dir + "/model.json", ModelJson());
  const ToolRun run = RunTool(absl::StrCat(
      "sweep --model-json ", dir, "/model.json --topology ", dir, "/topology.json --world 8 ",
      "--strategies full --forward-prefetch 1 --checkpointing off,on --param-dtypes model,f32,f16 ",
      "--jobs 2 --no-progress --json ", dir, "/out.json"));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "41.3 TFLOP/s per device (the topology's bf16 "))
      << run.output;
  absl::StatusOr<JsonValue> table = ParseJson(Read(dir + "/out.json"));
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Member(*table, "peak_TFLOPs").number(), 41.3);
  const std::vector<JsonValue>& rows = Member(*table, "rows").items();
  ASSERT_EQ(rows.size(), 6u);
  int unknown = 0;
  for (const JsonValue& row : rows) {
    const std::string dtype = Member(row, "param_dtype").string();
    const std::string what =
        absl::StrCat(dtype, " ", Member(row, "activation_checkpointing").string());
    ASSERT_TRUE(Member(row, "ok").boolean()) << what << Member(row, "error").string();
    const double step_s = Member(row, "step_time_s").number();
    EXPECT_DOUBLE_EQ(Member(row, "compute_busy").number(),
                     Member(row, "compute_time_s").number() / step_s)
        << what;
    if (dtype == "f16") {  // the topology states no f16 peak
      EXPECT_EQ(Member(row, "peak_TFLOPs").kind(), JsonValue::Kind::kNull) << what;
      EXPECT_EQ(Member(row, "mfu").kind(), JsonValue::Kind::kNull) << what;
      EXPECT_EQ(Member(row, "hfu").kind(), JsonValue::Kind::kNull) << what;
      ++unknown;
      continue;
    }
    const double peak = dtype == "f32" ? 9.7e12 : 41.3e12;
    EXPECT_DOUBLE_EQ(Member(row, "peak_TFLOPs").number() * 1e12, peak) << what;
    // The model's FLOPs per micro-batch: the six uses' forward and backward, written out.
    double model_flops = 1e9 + 2e9;
    for (int u = 0; u < 5; ++u) model_flops += (2000000001.0 + 4000000003.0) * (u + 1);
    EXPECT_NEAR(Member(row, "mfu").number(), model_flops / step_s / peak, 1e-12) << what;
    if (Member(row, "activation_checkpointing").string() == "full") {
      EXPECT_GT(Member(row, "hfu").number(), Member(row, "mfu").number()) << what;
    } else {
      EXPECT_EQ(Member(row, "hfu").number(), Member(row, "mfu").number()) << what;
    }
  }
  EXPECT_EQ(unknown, 2);
  std::filesystem::remove_all(dir);
}

TEST(TuneCliTest, PresetWithOverridesOnAShippedTopology) {
  const ToolRun run = RunTool(
      "sweep --model llama3-8b --layers 2 --seq-len 1024 --topology dgx-h100 --strategies "
      "full,hybrid --shard-sizes 4 --forward-prefetch 1 --checkpointing on --progress");
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "llama3-8b (modified)")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "] 2/2 configurations")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "topology dgx-h100: 1 x 8 devices")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "over the peak, 989.4 TFLOP/s per device"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "2 of 2 configurations with one representative rank"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "# recommended: row ")) << run.output;
}

TEST(TuneCliTest, FailuresRowsEqualTheModelRunDirectly) {
  const std::string dir = TempDir();
  Write(dir + "/topology.json", R"({
    "name": "cli-fail-4x4", "nodes": 4, "devices_per_node": 4, "device_memory_GiB": 80,
    "compute_TFLOPs": 100, "host_link_GBps": 20,
    "intra_node": {"bandwidth_GBps": 200, "latency_us": 1},
    "inter_node": {"nics_per_node": 2, "nic_bandwidth_GBps": 25, "latency_us": 5}})");
  const ToolRun run = RunTool(absl::StrCat(
      "failures --model llama3-8b --layers 2 --seq-len 512 --topology ", dir,
      "/topology.json --gpus 8,16 --shard-sizes 4,8 --checkpoint-every 10,300 ",
      "--gpu-mtbf-hours 5000 --detect-s 0.3 --hang-fraction 0.1 --timeout-s 120 ",
      "--relaunch-s 40 --init-s 10 --storage-GBps-per-node 3 --async-checkpoint ",
      "--resume-s 0.05 --store-ops-per-s 15000 --store-reads batched --crc-GBps 9 --json ", dir,
      "/failures.json"));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "per-GPU MTBF 5000 h (--gpu-mtbf-hours)"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "skipped (elastic HSDP needs >= 2 replica groups of "
                                "whole shard groups): 8 GPUs in groups of 8"))
      << run.output;
  absl::StatusOr<JsonValue> table = ParseJson(Read(dir + "/failures.json"));
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(Member(*table, "topology").string(), "cli-fail-4x4");
  const std::vector<JsonValue>& rows = Member(*table, "rows").items();
  ASSERT_EQ(rows.size(), 3u);

  absl::StatusOr<Topology> topology = LoadTopology(dir + "/topology.json");
  ASSERT_TRUE(topology.ok()) << topology.status();
  absl::StatusOr<std::unique_ptr<SimCluster>> cluster =
      CreateTopologyCluster(std::make_shared<const Topology>(*topology));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  TransformerConfig config = Llama3_8B({.seq_len = 512});
  config.layers = 2;
  absl::StatusOr<ModelDescription> model = TransformerModel(config);
  ASSERT_TRUE(model.ok()) << model.status();
  RecoveryOptions options{.gpu_mtbf_hours = 5000,
                          .detect_s = 0.3,
                          .hang_fraction = 0.1,
                          .timeout_s = 120,
                          .relaunch_s = 40,
                          .init_s = 10,
                          .storage_bytes_per_s_per_node = 3e9,
                          .async_checkpoint = true,
                          .resume_base_s = 0.05,
                          .store_ops_per_s = 15000,
                          .store_reads = StoreReads::kBatched,
                          .crc_bytes_per_s = 9e9};
  const std::pair<int, int> shapes[] = {{8, 4}, {16, 4}, {16, 8}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const JsonValue& row = rows[i];
    const auto [gpus, k] = shapes[i];
    absl::StatusOr<RecoveryScenario> s =
        SimulatedScenario(*model, **cluster, {.gpus = gpus, .shard_size = k});
    ASSERT_TRUE(s.ok()) << s.status();
    s->checkpoint_every = {10, 300};
    absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(*s, options);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(Member(row, "gpus").integer(), gpus);
    EXPECT_EQ(Member(row, "shard_size").integer(), k);
    EXPECT_EQ(Member(row, "replicas").integer(), gpus / k);
    EXPECT_EQ(Member(row, "step_s").number(), s->step_s);
    EXPECT_EQ(Member(row, "state_bytes").number(), s->state_bytes);
    EXPECT_EQ(Member(row, "failures_per_day").number(), e->failures_per_day);
    EXPECT_EQ(Member(row, "job_mtbf_hours").number(), e->job_mtbf_hours);
    const JsonValue& el = Member(row, "elastic");
    EXPECT_EQ(Member(el, "resume_s").number(), e->elastic.resume_s);
    EXPECT_EQ(Member(el, "next_commit_s").number(), e->elastic.next_commit_s);
    EXPECT_EQ(Member(el, "transfer_s").number(), e->elastic.transfer_s);
    EXPECT_EQ(Member(el, "rejoin_s").number(), e->elastic.rejoin_s);
    EXPECT_EQ(Member(el, "lost_s").number(), e->elastic.lost_s);
    EXPECT_EQ(Member(el, "protocol_s").number(), e->elastic.protocol_s);
    EXPECT_EQ(Member(el, "goodput").number(), e->elastic.goodput);
    const std::vector<JsonValue>& ck = Member(row, "checkpoint").items();
    ASSERT_EQ(ck.size(), 2u);
    for (size_t j = 0; j < 2; ++j) {
      const CheckpointRestartCost& c = e->checkpoint[j];
      EXPECT_EQ(Member(ck[j], "every").integer(), c.every);
      EXPECT_EQ(Member(ck[j], "blocked_s").number(), c.blocked_s);
      EXPECT_EQ(Member(ck[j], "restart_s").number(), c.restart_s);
      EXPECT_EQ(Member(ck[j], "lost_steps").number(), c.lost_steps);
      EXPECT_EQ(Member(ck[j], "lost_s").number(), c.lost_s);
      EXPECT_EQ(Member(ck[j], "goodput").number(), c.goodput);
    }
    EXPECT_EQ(Member(row, "elastic_resumes_faster").boolean(), e->elastic_resumes_faster);
  }
  std::filesystem::remove_all(dir);
}

TEST(TuneCliTest, BadFlagsAreClearErrors) {
  const std::string base = "sweep --model llama3-8b --layers 2 --topology dgx-h100 --no-progress ";
  const std::string fail = "failures --model llama3-8b --layers 2 --topology dgx-h100 ";
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {"", "no subcommand"},
      {"tune", "unknown subcommand 'tune'"},
      {"sweep --topology dgx-h100", "exactly one of --model"},
      {"sweep --model llama3-8b", "--topology is required"},
      {"sweep --model llama3-9b --topology dgx-h100", "llama3-9b"},
      {base + "--frobnicate 1", "unknown flag --frobnicate"},
      {base + "--strategies full,zero3", "--strategies: 'zero3' is not full, hybrid"},
      {base + "--shard-sizes 3 --strategies hybrid", "hybrid shard size 3 does not divide"},
      {base + "--forward-prefetch 1,,2", "has an empty item"},
      {base + "--forward-prefetch -1", "'-1' is not a non-negative integer"},
      {base + "--reduce-dtypes bf16,int8", "'int8' is not a floating dtype"},
      {base + "--checkpointing maybe", "'maybe' is not off, full (on), op or layer:K"},
      {base + "--checkpointing layer:0", "'layer:0' is not off, full (on), op or layer:K"},
      {base + "--world 16", "--world 16: topology 'dgx-h100' has only 8 devices"},
      {base + "--world", "--world needs a value"},
      {base + "--ranks some", "'some' is not auto, all or representative"},
      {"sweep --model llama3-8b --topology no-such-machine", "'no-such-machine' is neither"},
      {"sweep --model llama3-8b --topology /nonexistent/t.json", "/nonexistent/t.json"},
      {base + "--micro-batches 2,0", "'0' is not a positive integer"},
      {base + "--accumulation lazy", "'lazy' is not no_sync or sync"},
      {base + "--cpu-offload yes", "'yes' is not on or off"},
      {"calibrate", "no perf JSON given"},
      {"calibrate --repeats mean x.json", "--repeats: 'mean' is not min, median or keep"},
      {"validate /nonexistent/o.json", "--topology is required"},
      {"validate --topology this-machine", "no overlap_bench JSON file given"},
      {"validate --topology this-machine /nonexistent/o.json", "/nonexistent/o.json"},
      {"validate --topology this-machine --frob", "unknown flag --frob"},
      {"failures --topology dgx-h100", "exactly one of --model"},
      {"failures --model llama3-8b", "--topology is required"},
      {fail + "--gpus 16", "--gpus 16: topology 'dgx-h100' has only 8 devices"},
      {fail + "--hang-fraction 2", "--hang-fraction: '2' is not in [0, 1]"},
      {fail + "--storage-GBps-per-node 0", "'0' is not a positive number"},
      {fail + "--detect-s -1", "--detect-s: '-1' is not a number >= 0"},
      {fail + "--store-reads some", "'some' is not two_level, per_entry, batched or leaders"},
      {fail + "--failure-source bloom", "unknown failure source 'bloom'"},
      {fail + "--checkpoint-every 100,0", "'0' is not a positive integer"},
      {fail + "--shard-sizes 8", "no job size and shard size make 2 or more replica groups"},
      {fail + "--frob 1", "unknown flag --frob"},
  };
  for (const Case& c : cases) {
    const ToolRun run = RunTool(c.args);
    EXPECT_EQ(run.status, 2) << c.args << "\n" << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, c.expected)) << c.args << "\n" << run.output;
  }
}

}  // namespace
}  // namespace shardline
