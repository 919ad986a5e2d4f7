// shardline-tune failures (scheduler/tools/internal/shardline_tune.h): the failure model
// (scheduler/tune/failures.h) over job sizes and hybrid shapes, the step time simulated on a
// topology: failures per day, time to recover, steps lost and goodput, elastic HSDP against
// checkpoint restarts every N steps.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runtime/json.h"
#include "runtime/status.h"
#include "scheduler/tools/internal/shardline_tune.h"
#include "scheduler/tune/failures.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"

namespace shardline::tune_cli {
namespace {

constexpr char kFailuresUsage[] =
    "usage: shardline-tune failures (--model PRESET | --model-json FILE) --topology NAME|FILE\n"
    "                               [options]\n"
    "Failures per day, recovery time, steps lost and goodput of elastic HSDP against checkpoint\n"
    "restarts, per job size and hybrid shape (docs/tuning.md, \"Failures and recovery\").\n"
    "job:\n"
    "  --model PRESET            llama3-8b, llama3-70b, llama3-405b, gpt3-175b\n"
    "    --seq-len S --micro-batch B --layers L      the preset's shape\n"
    "  --model-json FILE         a model description (docs/tuning-model.md)\n"
    "  --topology NAME|FILE      a shipped topology or a topology JSON file\n"
    "  --gpus LIST               job sizes (default 64,128,256,512,1024, those the topology has)\n"
    "  --shard-sizes LIST        ranks per replica group (default: devices per node)\n"
    "  --checkpointing MODE      activation checkpointing of the simulated step: off, full, op\n"
    "                            (default off)\n"
    "  --step-s X                use this step time instead of simulating one\n"
    "failures:\n"
    "  --failure-source NAME     llama3 (default), opt-175b: the published count the per-GPU\n"
    "                            MTBF derives from\n"
    "  --gpu-mtbf-hours H        a per-GPU MTBF of your own instead\n"
    "  --detect-s X              detection by the liveness signal (default 0.174, measured)\n"
    "  --hang-fraction F         failures that end no process, detected at --timeout-s\n"
    "                            (default 0)\n"
    "  --timeout-s X             a collective's deadline (default 600: PyTorch's NCCL default)\n"
    "checkpoint restart:\n"
    "  --checkpoint-every LIST   N, steps between checkpoints (default 100,500,2000)\n"
    "  --relaunch-s X --init-s X the job's relaunch and initialisation (default 60, 30;\n"
    "                            assumptions)\n"
    "  --storage-GBps-per-node X storage read/write per node (default 0.977: Llama 3's 2 TB/s\n"
    "                            over 2,048 nodes)\n"
    "  --async-checkpoint        snapshots over the host link, written in the background\n"
    "elastic:\n"
    "  --resume-s X              abort decision to the next round's communicators (default\n"
    "                            0.028, measured)\n"
    "  --store-ops-per-s X       the store server's operations per second (default 22000)\n"
    "  --store-reads MODE        two_level (as built, default); per_entry, batched or leaders\n"
    "                            (a first design and variants that are not built: failures.h)\n"
    "  --crc-GBps X              the joiner's CRC-32C check (default 13)\n"
    "output:\n"
    "  --json FILE               every figure of every row\n";

absl::Status Bad(absl::string_view flag, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": '", value, "' ", what));
}

absl::StatusOr<std::vector<int>> PositiveList(absl::string_view flag, absl::string_view value) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) return Bad(flag, item, "is not a positive integer");
    out.push_back(v);
  }
  return out;
}

struct FailuresFlags {
  std::string model, model_json, topology, json, source = "llama3";
  int64_t seq_len = 0;
  int micro_batch = 0, layers = 0;
  std::vector<int> gpus, shard_sizes, every = {100, 500, 2000};
  ActivationCheckpointing checkpointing;
  double step_s = 0;
  RecoveryOptions options;
};

// Parses argv[2...]; --help prints the usage: false, nothing to run.
absl::StatusOr<bool> ParseFlags(int argc, char** argv, FailuresFlags& f) {
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kFailuresUsage, stdout);
      return false;
    }
    if (arg == "--async-checkpoint") {
      f.options.async_checkpoint = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (failures takes only flags)"));
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    const std::string value = argv[++i];
    // A number >= `min` (> 0 where `positive`), scaled by `scale`.
    auto number = [&](double* out, bool positive, double scale = 1) -> absl::Status {
      double v = 0;
      if (!absl::SimpleAtod(value, &v) || !(positive ? v > 0 : v >= 0) || std::isinf(v)) {
        return Bad(arg, value, positive ? "is not a positive number" : "is not a number >= 0");
      }
      *out = v * scale;
      return absl::OkStatus();
    };
    auto count = [&](auto* out) -> absl::Status {
      int64_t v = 0;
      if (!absl::SimpleAtoi(value, &v) || v < 1)
        return Bad(arg, value, "is not a positive integer");
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(v);
      return absl::OkStatus();
    };
    RecoveryOptions& o = f.options;
    if (arg == "--model") {
      f.model = value;
    } else if (arg == "--model-json") {
      f.model_json = value;
    } else if (arg == "--topology") {
      f.topology = value;
    } else if (arg == "--json") {
      f.json = value;
    } else if (arg == "--seq-len") {
      SL_RETURN_IF_ERROR(count(&f.seq_len));
    } else if (arg == "--micro-batch") {
      SL_RETURN_IF_ERROR(count(&f.micro_batch));
    } else if (arg == "--layers") {
      SL_RETURN_IF_ERROR(count(&f.layers));
    } else if (arg == "--gpus") {
      SL_ASSIGN_OR_RETURN(f.gpus, PositiveList(arg, value));
    } else if (arg == "--shard-sizes") {
      SL_ASSIGN_OR_RETURN(f.shard_sizes, PositiveList(arg, value));
    } else if (arg == "--checkpoint-every") {
      SL_ASSIGN_OR_RETURN(f.every, PositiveList(arg, value));
    } else if (arg == "--checkpointing") {
      absl::StatusOr<ActivationCheckpointing> c = ParseActivationCheckpointing(value);
      if (!c.ok()) return Bad(arg, value, "is not off, full (on), op or layer:K (K >= 1)");
      f.checkpointing = *c;
    } else if (arg == "--step-s") {
      SL_RETURN_IF_ERROR(number(&f.step_s, /*positive=*/true));
    } else if (arg == "--failure-source") {
      absl::StatusOr<FailureSource> s = FailureSourceByName(value);
      if (!s.ok()) return Annotate(s.status(), arg);
      f.source = value;
    } else if (arg == "--gpu-mtbf-hours") {
      SL_RETURN_IF_ERROR(number(&o.gpu_mtbf_hours, /*positive=*/true));
    } else if (arg == "--detect-s") {
      SL_RETURN_IF_ERROR(number(&o.detect_s, /*positive=*/false));
    } else if (arg == "--hang-fraction") {
      SL_RETURN_IF_ERROR(number(&o.hang_fraction, /*positive=*/false));
      if (o.hang_fraction > 1) return Bad(arg, value, "is not in [0, 1]");
    } else if (arg == "--timeout-s") {
      SL_RETURN_IF_ERROR(number(&o.timeout_s, /*positive=*/false));
    } else if (arg == "--relaunch-s") {
      SL_RETURN_IF_ERROR(number(&o.relaunch_s, /*positive=*/false));
    } else if (arg == "--init-s") {
      SL_RETURN_IF_ERROR(number(&o.init_s, /*positive=*/false));
    } else if (arg == "--storage-GBps-per-node") {
      SL_RETURN_IF_ERROR(number(&o.storage_bytes_per_s_per_node, /*positive=*/true, 1e9));
    } else if (arg == "--resume-s") {
      SL_RETURN_IF_ERROR(number(&o.resume_base_s, /*positive=*/false));
    } else if (arg == "--store-ops-per-s") {
      SL_RETURN_IF_ERROR(number(&o.store_ops_per_s, /*positive=*/true));
    } else if (arg == "--store-reads") {
      if (value == "two_level") {
        o.store_reads = StoreReads::kTwoLevel;
      } else if (value == "per_entry") {
        o.store_reads = StoreReads::kPerEntry;
      } else if (value == "batched") {
        o.store_reads = StoreReads::kBatched;
      } else if (value == "leaders") {
        o.store_reads = StoreReads::kLeaders;
      } else {
        return Bad(arg, value, "is not two_level, per_entry, batched or leaders");
      }
    } else if (arg == "--crc-GBps") {
      SL_RETURN_IF_ERROR(number(&o.crc_bytes_per_s, /*positive=*/true, 1e9));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg, " (shardline-tune failures --help lists them)"));
    }
  }
  if (f.model.empty() == f.model_json.empty()) {
    return absl::InvalidArgumentError("give exactly one of --model PRESET and --model-json FILE");
  }
  if (!f.model_json.empty() && (f.seq_len || f.micro_batch || f.layers)) {
    return absl::InvalidArgumentError(
        "--seq-len, --micro-batch and --layers apply to --model presets, not to --model-json");
  }
  if (f.topology.empty()) return absl::InvalidArgumentError("--topology is required");
  return true;
}

absl::StatusOr<ModelDescription> BuildModel(const FailuresFlags& f) {
  if (!f.model_json.empty()) return ModelFromJson(f.model_json);
  SL_ASSIGN_OR_RETURN(TransformerConfig config, PresetConfig(f.model, f.seq_len, f.micro_batch));
  if (f.layers > 0) {
    config.layers = f.layers;
    config.name += " (modified)";
  }
  return TransformerModel(config);
}

std::string Json(const RecoveryEstimate& e) {
  const RecoveryScenario& s = e.scenario;
  const ElasticCost& el = e.elastic;
  std::string out = absl::StrCat(
      "{\"gpus\": ", s.gpus, ", \"replicas\": ", e.replicas, ", \"shard_size\": ", s.shard_size,
      ", \"nodes\": ", e.nodes, ", \"step_s\": ", JsonNumber(s.step_s),
      ", \"state_bytes\": ", JsonNumber(s.state_bytes),
      ", \"link_bytes_per_s\": ", JsonNumber(s.link_bytes_per_s),
      ", \"peak_bytes\": ", JsonNumber(s.peak_bytes), ", \"fits\": ", s.fits ? "true" : "false",
      ", \"gpu_mtbf_hours\": ", JsonNumber(e.gpu_mtbf_hours),
      ", \"job_mtbf_hours\": ", JsonNumber(e.job_mtbf_hours),
      ", \"failures_per_day\": ", JsonNumber(e.failures_per_day),
      ", \"elastic_resumes_faster\": ", e.elastic_resumes_faster ? "true" : "false",
      ",\n   \"elastic\": {\"detect_s\": ", JsonNumber(el.detect_s),
      ", \"quorum_s\": ", JsonNumber(el.quorum_s), ", \"resume_s\": ", JsonNumber(el.resume_s),
      ", \"next_commit_s\": ", JsonNumber(el.next_commit_s),
      ", \"lost_steps\": ", JsonNumber(el.lost_steps),
      ", \"degraded_s\": ", JsonNumber(el.degraded_s),
      ", \"transfer_s\": ", JsonNumber(el.transfer_s), ", \"rejoin_s\": ", JsonNumber(el.rejoin_s),
      ", \"lost_s\": ", JsonNumber(el.lost_s), ", \"protocol_s\": ", JsonNumber(el.protocol_s),
      ", \"steady\": ", JsonNumber(el.steady), ", \"goodput\": ", JsonNumber(el.goodput),
      "},\n   \"checkpoint\": [");
  for (size_t i = 0; i < e.checkpoint.size(); ++i) {
    const CheckpointRestartCost& c = e.checkpoint[i];
    absl::StrAppend(
        &out, i ? ",\n     " : "", "{\"every\": ", c.every,
        ", \"write_s\": ", JsonNumber(c.write_s), ", \"blocked_s\": ", JsonNumber(c.blocked_s),
        ", \"steady\": ", JsonNumber(c.steady), ", \"load_s\": ", JsonNumber(c.load_s),
        ", \"restart_s\": ", JsonNumber(c.restart_s),
        ", \"lost_steps\": ", JsonNumber(c.lost_steps), ", \"lost_s\": ", JsonNumber(c.lost_s),
        ", \"goodput\": ", JsonNumber(c.goodput), "}");
  }
  absl::StrAppend(&out, "]}");
  return out;
}

}  // namespace

absl::Status Failures(int argc, char** argv) {
  FailuresFlags f;
  SL_ASSIGN_OR_RETURN(bool run, ParseFlags(argc, argv, f));
  if (!run) return absl::OkStatus();
  SL_ASSIGN_OR_RETURN(ModelDescription model, BuildModel(f));
  SL_ASSIGN_OR_RETURN(Topology topology, FindTopology(f.topology, argv[0]));
  auto shared_topology = std::make_shared<const Topology>(std::move(topology));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<SimCluster> cluster, CreateTopologyCluster(shared_topology));
  const int devices = shared_topology->devices();
  if (f.gpus.empty()) {
    for (const int n : {64, 128, 256, 512, 1024}) {
      if (n <= devices) f.gpus.push_back(n);
    }
    if (f.gpus.empty()) f.gpus.push_back(devices);
  }
  for (const int n : f.gpus) {
    if (n > devices) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--gpus ", n, ": topology '", shared_topology->name, "' has only ", devices, " devices"));
    }
  }
  if (f.shard_sizes.empty()) f.shard_sizes.push_back(shared_topology->devices_per_node);
  SL_ASSIGN_OR_RETURN(FailureSource source, FailureSourceByName(f.source));
  RecoveryOptions& o = f.options;
  const bool own_mtbf = o.gpu_mtbf_hours > 0;
  if (!own_mtbf) o.gpu_mtbf_hours = source.GpuMtbfHours();
  SL_RETURN_IF_ERROR(ValidateRecoveryOptions(o));

  std::printf("# model %s: %.3fB parameters; topology %s (%d x %d devices)\n", model.name.c_str(),
              static_cast<double>(model.ParameterCount()) / 1e9, shared_topology->name.c_str(),
              shared_topology->nodes, shared_topology->devices_per_node);
  if (own_mtbf) {
    std::printf("# per-GPU MTBF %.0f h (--gpu-mtbf-hours)\n", o.gpu_mtbf_hours);
  } else {
    std::printf("# per-GPU MTBF %.0f h = %d GPUs x %.0f days x 24 / %d failures: %s\n",
                o.gpu_mtbf_hours, source.gpus, source.days, source.failures,
                source.citation.c_str());
  }
  std::printf(
      "# detect %.3f s (hangs %.0f%%, at %.0f s); restart: relaunch %.0f s + init %.0f s + load "
      "at %.3f GB/s per node; %s checkpoints; elastic: resume %.3f s + quorum, store %.0f ops/s "
      "(%s reads), CRC %.1f GB/s\n",
      o.detect_s, 100 * o.hang_fraction, o.timeout_s, o.relaunch_s, o.init_s,
      o.storage_bytes_per_s_per_node / 1e9, o.async_checkpoint ? "asynchronous" : "synchronous",
      o.resume_base_s, o.store_ops_per_s, std::string(StoreReadsName(o.store_reads)).c_str(),
      o.crc_bytes_per_s / 1e9);

  std::vector<RecoveryEstimate> estimates;
  std::vector<std::string> skipped;
  for (const int n : f.gpus) {
    for (const int k : f.shard_sizes) {
      if (n % k != 0 || n / k < 2) {
        skipped.push_back(absl::StrCat(n, " GPUs in groups of ", k));
        continue;
      }
      SimulationConfig config{.ranks = RankMode::kAuto};
      config.activation_checkpointing = f.checkpointing;
      absl::StatusOr<RecoveryScenario> s =
          SimulatedScenario(model, *cluster, {.gpus = n, .shard_size = k}, config);
      if (!s.ok()) return Annotate(s.status(), absl::StrCat(n, " GPUs, shard size ", k));
      if (f.step_s > 0) s->step_s = f.step_s;
      s->checkpoint_every = f.every;
      absl::StatusOr<RecoveryEstimate> e = EstimateRecovery(*s, o);
      if (!e.ok()) return Annotate(e.status(), absl::StrCat(n, " GPUs, shard size ", k));
      estimates.push_back(*std::move(e));
    }
  }
  if (!skipped.empty()) {
    std::printf("# skipped (elastic HSDP needs >= 2 replica groups of whole shard groups): %s\n",
                absl::StrJoin(skipped, "; ").c_str());
  }
  if (estimates.empty() || f.every.empty()) {
    return absl::InvalidArgumentError("no job size and shard size make 2 or more replica groups");
  }
  const double state_gb = estimates.front().scenario.state_bytes / 1e9;
  std::printf("# state (master weights + optimizer) %.1f GB; step time %s\n\n", state_gb,
              f.step_s > 0 ? "--step-s" : "simulated (hybrid shard, representative rank)");

  // A restart costs the same whatever N (N decides the work lost, below).
  std::printf(
      "| GPUs | R x k | peak GiB | step s | failures/day | job MTBF h | elastic resume s | to next "
      "commit s "
      "| rejoin s | checkpoint restart s | of which load s | elastic faster |\n"
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const RecoveryEstimate& e : estimates) {
    const CheckpointRestartCost& c = e.checkpoint.front();
    std::printf(
        "| %d | %d x %d | %.1f%s | %.3f | %.2f | %.1f | %.3f | %.3f | %.1f | %.1f | %.1f | %s |\n",
        e.scenario.gpus, e.replicas, e.scenario.shard_size, e.scenario.peak_bytes / (1ull << 30),
        e.scenario.fits ? "" : " (does not fit)", e.scenario.step_s, e.failures_per_day,
        e.job_mtbf_hours, e.elastic.resume_s, e.elastic.next_commit_s, e.elastic.rejoin_s,
        c.restart_s, c.load_s, e.elastic_resumes_faster ? "yes" : "NO");
  }
  std::string lost_heads, lost_rules;
  for (const int n : f.every) {
    absl::StrAppend(&lost_heads, " N=", n, ": lost steps / job s / goodput |");
    absl::StrAppend(&lost_rules, "---|");
  }
  std::printf(
      "\n| GPUs | R x k | elastic: lost steps / job s / protocol ms per step / goodput |%s\n"
      "|---:|---|---|%s\n",
      lost_heads.c_str(), lost_rules.c_str());
  for (const RecoveryEstimate& e : estimates) {
    std::string cells;
    for (const CheckpointRestartCost& c : e.checkpoint) {
      absl::StrAppend(&cells,
                      absl::StrFormat(" %.1f / %.0f / %.4f |", c.lost_steps, c.lost_s, c.goodput));
    }
    std::printf("| %d | %d x %d | %.1f / %.1f / %.1f / %.4f |%s\n", e.scenario.gpus, e.replicas,
                e.scenario.shard_size, e.elastic.lost_steps, e.elastic.lost_s,
                1e3 * e.elastic.protocol_s, e.elastic.goodput, cells.c_str());
  }
  const bool all_faster =
      std::all_of(estimates.begin(), estimates.end(),
                  [](const RecoveryEstimate& e) { return e.elastic_resumes_faster; });
  std::printf("\n# elastic resume below every checkpoint restart at every scale: %s\n",
              all_faster ? "yes" : "NO");
  if (!f.json.empty()) {
    std::vector<std::string> rows;
    for (const RecoveryEstimate& e : estimates) rows.push_back(Json(e));
    SL_RETURN_IF_ERROR(WriteFile(
        f.json,
        absl::StrCat("{\"model\": ", JsonQuote(model.name),
                     ", \"topology\": ", JsonQuote(shared_topology->name),
                     ", \"failure_source\": ", own_mtbf ? "null" : JsonQuote(source.name),
                     ", \"elastic_resumes_faster_everywhere\": ", all_faster ? "true" : "false",
                     ",\n \"rows\": [\n  ", absl::StrJoin(rows, ",\n  "), "]}\n")));
  }
  return absl::OkStatus();
}

}  // namespace shardline::tune_cli
