// shardline-tune sweep's flags (scheduler/tools/internal/shardline_tune.h).

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/dtype.h"
#include "runtime/status.h"
#include "scheduler/tools/internal/shardline_tune.h"

namespace shardline::tune_cli {
namespace {

constexpr char kSweepUsage[] =
    "usage: shardline-tune sweep [options]\n"
    "model (one of):\n"
    "  --model PRESET            llama3-8b, llama3-70b, llama3-405b, gpt3-175b\n"
    "    --seq-len S --micro-batch B        the preset's shape (8192 / gpt3: 2048; 1)\n"
    "    --layers L --hidden H --ffn F --heads A --kv-heads K --vocab V   overrides\n"
    "  --model-json FILE         a model description (docs/tuning-model.md)\n"
    "cluster:\n"
    "  --topology NAME|FILE      a shipped topology (dgx-h100, h100-128-nodes, dgx-a100,\n"
    "                            this-machine) or a topology JSON file\n"
    "  --world N                 ranks (default: every device of the topology)\n"
    "  --peak-TFLOPs X           per-device peak that MFU and HFU are measured against\n"
    "                            (default: the topology's peak_TFLOPs for each row's param\n"
    "                            dtype; without one they are n/a)\n"
    "dimensions (comma-separated lists):\n"
    "  --strategies LIST         full, hybrid, shard_grad_op, no_shard (default: all)\n"
    "  --shard-sizes LIST        hybrid shard-group sizes (default: devices per node and twice\n"
    "                            that, where they divide the world and are below it)\n"
    "  --forward-prefetch LIST   depths (default 1,2)\n"
    "  --backward-prefetch LIST  off, before_grad, after_grad (default before_grad)\n"
    "  --backward-depth LIST     depths (default 1)\n"
    "  --budget-units LIST       unit caps, 0 = none (default 0)\n"
    "  --budget-GiB LIST         byte caps in GiB, 0 = none (default 0)\n"
    "  --param-dtypes LIST       f32, bf16, f16, model (default model)\n"
    "  --reduce-dtypes LIST      f32, bf16, f16, model (default model)\n"
    "  --checkpointing LIST      off, full (or on), op (selective per op, torchtitan's `op`),\n"
    "                            layer:K (every K-th layer checkpointed) (default off,full)\n"
    "  --micro-batches LIST      micro-batches per optimizer step (default 1; each of the model's\n"
    "                            --micro-batch sequences)\n"
    "  --accumulation LIST       no_sync, sync: reduce on the last micro-batch only, or on every\n"
    "                            one (default no_sync; one value where micro-batches is 1)\n"
    "  --cpu-offload LIST        off, on: master shards, gradients and optimizer state in host\n"
    "                            memory, copied over the topology's host_link_GBps (default off)\n"
    "simulation:\n"
    "  --host-lead one_use|whole_step      (default one_use)\n"
    "  --ranks auto|all|representative     (default auto: one representative rank where the\n"
    "                                      placement is symmetric)\n"
    "  --jobs N                  configurations at once (default: the CPUs)\n"
    "output:\n"
    "  --json FILE  --csv FILE   the table\n"
    "  --trace FILE              Chrome trace of the recommended configuration (rank 0)\n"
    "  --top K                   rows printed (default 10)\n"
    "  --progress | --no-progress   progress bar on stderr (default: when it is a terminal)\n";

absl::Status Bad(absl::string_view flag, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": '", value, "' ", what));
}

template <typename T, typename F>
absl::StatusOr<std::vector<T>> ParseList(absl::string_view flag, absl::string_view value,
                                         F parse_one) {
  std::vector<T> out;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    if (item.empty()) return Bad(flag, value, "has an empty item");
    SL_ASSIGN_OR_RETURN(T v, parse_one(item));
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace

absl::StatusOr<SweepFlags> ParseSweepFlags(int argc, char** argv) {
  SweepFlags f;
  f.space.strategies = {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard,
                        ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};
  f.space.forward_prefetch = {1, 2};
  f.space.activation_checkpointing = {{}, {.mode = CheckpointMode::kFull}};
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kSweepUsage, stdout);
      std::exit(0);
    }
    if (arg == "--progress" || arg == "--no-progress") {
      f.progress = arg == "--progress";
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (sweep takes only flags)"));
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    const std::string value = argv[++i];
    auto positive = [&](auto* out) -> absl::Status {
      int64_t v = 0;
      if (!absl::SimpleAtoi(value, &v) || v < 1)
        return Bad(arg, value, "is not a positive integer");
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(v);
      return absl::OkStatus();
    };
    auto non_negative = [&](absl::string_view item) -> absl::StatusOr<int> {
      int v = 0;
      if (!absl::SimpleAtoi(item, &v) || v < 0) {
        return Bad(arg, item, "is not a non-negative integer");
      }
      return v;
    };
    auto dtype = [&](absl::string_view item) -> absl::StatusOr<std::optional<DType>> {
      if (item == "model") return std::optional<DType>();
      absl::StatusOr<DType> d = ParseDType(item);
      if (!d.ok() || !IsFloatingPoint(*d)) {
        return Bad(arg, item, "is not a floating dtype (f32, bf16, f16, f64) or 'model'");
      }
      return std::optional<DType>(*d);
    };
    if (arg == "--model") {
      f.model = value;
    } else if (arg == "--model-json") {
      f.model_json = value;
    } else if (arg == "--topology") {
      f.topology = value;
    } else if (arg == "--json") {
      f.json = value;
    } else if (arg == "--csv") {
      f.csv = value;
    } else if (arg == "--trace") {
      f.trace = value;
    } else if (arg == "--seq-len") {
      SL_RETURN_IF_ERROR(positive(&f.seq_len));
    } else if (arg == "--micro-batch") {
      SL_RETURN_IF_ERROR(positive(&f.micro_batch));
    } else if (arg == "--layers") {
      SL_RETURN_IF_ERROR(positive(&f.layers));
    } else if (arg == "--hidden") {
      SL_RETURN_IF_ERROR(positive(&f.hidden));
    } else if (arg == "--ffn") {
      SL_RETURN_IF_ERROR(positive(&f.ffn));
    } else if (arg == "--heads") {
      SL_RETURN_IF_ERROR(positive(&f.heads));
    } else if (arg == "--kv-heads") {
      SL_RETURN_IF_ERROR(positive(&f.kv_heads));
    } else if (arg == "--vocab") {
      SL_RETURN_IF_ERROR(positive(&f.vocab));
    } else if (arg == "--world") {
      SL_RETURN_IF_ERROR(positive(&f.world));
    } else if (arg == "--jobs") {
      SL_RETURN_IF_ERROR(positive(&f.jobs));
    } else if (arg == "--top") {
      SL_RETURN_IF_ERROR(positive(&f.top));
    } else if (arg == "--peak-TFLOPs") {
      if (!absl::SimpleAtod(value, &f.peak_tflops) || !(f.peak_tflops > 0)) {
        return Bad(arg, value, "is not a positive number");
      }
    } else if (arg == "--strategies") {
      SL_ASSIGN_OR_RETURN(
          f.space.strategies,
          ParseList<ShardingStrategy>(
              arg, value, [&](absl::string_view s) -> absl::StatusOr<ShardingStrategy> {
                if (s == "full") return ShardingStrategy::kFullShard;
                if (s == "hybrid") return ShardingStrategy::kHybridShard;
                if (s == "shard_grad_op") return ShardingStrategy::kShardGradOp;
                if (s == "no_shard") return ShardingStrategy::kNoShard;
                return Bad(arg, s, "is not full, hybrid, shard_grad_op or no_shard");
              }));
    } else if (arg == "--shard-sizes") {
      SL_ASSIGN_OR_RETURN(
          f.space.hybrid_shard_sizes,
          ParseList<int>(arg, value, [&](absl::string_view s) -> absl::StatusOr<int> {
            SL_ASSIGN_OR_RETURN(int v, non_negative(s));
            if (v < 1) return Bad(arg, s, "is not a positive integer");
            return v;
          }));
      f.shard_sizes_given = true;
    } else if (arg == "--forward-prefetch") {
      SL_ASSIGN_OR_RETURN(f.space.forward_prefetch, ParseList<int>(arg, value, non_negative));
    } else if (arg == "--backward-prefetch") {
      SL_ASSIGN_OR_RETURN(
          f.space.backward_prefetch,
          ParseList<BackwardPrefetch>(arg, value,
                                      [&](absl::string_view s) -> absl::StatusOr<BackwardPrefetch> {
                                        if (s == "off") return BackwardPrefetch::kOff;
                                        if (s == "before_grad")
                                          return BackwardPrefetch::kBeforeGrad;
                                        if (s == "after_grad") return BackwardPrefetch::kAfterGrad;
                                        return Bad(arg, s, "is not off, before_grad or after_grad");
                                      }));
    } else if (arg == "--backward-depth") {
      SL_ASSIGN_OR_RETURN(f.space.backward_prefetch_depth,
                          ParseList<int>(arg, value, non_negative));
    } else if (arg == "--budget-units") {
      SL_ASSIGN_OR_RETURN(f.space.budget_units, ParseList<int>(arg, value, non_negative));
    } else if (arg == "--budget-GiB") {
      SL_ASSIGN_OR_RETURN(
          f.space.budget_bytes,
          ParseList<uint64_t>(arg, value, [&](absl::string_view s) -> absl::StatusOr<uint64_t> {
            double gib = 0;
            if (!absl::SimpleAtod(s, &gib) || gib < 0) {
              return Bad(arg, s, "is not a non-negative number");
            }
            return static_cast<uint64_t>(gib * (1ull << 30));
          }));
    } else if (arg == "--param-dtypes") {
      SL_ASSIGN_OR_RETURN(f.space.param_dtypes, ParseList<std::optional<DType>>(arg, value, dtype));
    } else if (arg == "--reduce-dtypes") {
      SL_ASSIGN_OR_RETURN(f.space.reduce_dtypes,
                          ParseList<std::optional<DType>>(arg, value, dtype));
    } else if (arg == "--micro-batches") {
      SL_ASSIGN_OR_RETURN(
          f.space.micro_batches,
          ParseList<int>(arg, value, [&](absl::string_view s) -> absl::StatusOr<int> {
            SL_ASSIGN_OR_RETURN(int v, non_negative(s));
            if (v < 1) return Bad(arg, s, "is not a positive integer");
            return v;
          }));
    } else if (arg == "--accumulation") {
      SL_ASSIGN_OR_RETURN(
          f.space.accumulation,
          ParseList<GradientAccumulation>(
              arg, value, [&](absl::string_view s) -> absl::StatusOr<GradientAccumulation> {
                if (s == "no_sync") return GradientAccumulation::kNoSync;
                if (s == "sync") return GradientAccumulation::kSync;
                return Bad(arg, s, "is not no_sync or sync");
              }));
    } else if (arg == "--cpu-offload") {
      SL_ASSIGN_OR_RETURN(
          f.space.cpu_offload,
          ParseList<bool>(arg, value, [&](absl::string_view s) -> absl::StatusOr<bool> {
            if (s == "on") return true;
            if (s == "off") return false;
            return Bad(arg, s, "is not on or off");
          }));
    } else if (arg == "--checkpointing") {
      SL_ASSIGN_OR_RETURN(
          f.space.activation_checkpointing,
          ParseList<ActivationCheckpointing>(
              arg, value, [&](absl::string_view s) -> absl::StatusOr<ActivationCheckpointing> {
                absl::StatusOr<ActivationCheckpointing> c = ParseActivationCheckpointing(s);
                if (!c.ok()) return Bad(arg, s, "is not off, full (on), op or layer:K (K >= 1)");
                return c;
              }));
    } else if (arg == "--host-lead") {
      if (value == "one_use") {
        f.space.host_lead = HostLead::kOneUse;
      } else if (value == "whole_step") {
        f.space.host_lead = HostLead::kWholeStep;
      } else {
        return Bad(arg, value, "is not one_use or whole_step");
      }
    } else if (arg == "--ranks") {
      if (value == "auto") {
        f.space.ranks = RankMode::kAuto;
      } else if (value == "all") {
        f.space.ranks = RankMode::kAll;
      } else if (value == "representative") {
        f.space.ranks = RankMode::kRepresentative;
      } else {
        return Bad(arg, value, "is not auto, all or representative");
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg, " (shardline-tune sweep --help lists them)"));
    }
  }
  if (f.model.empty() == f.model_json.empty()) {
    return absl::InvalidArgumentError("give exactly one of --model PRESET and --model-json FILE");
  }
  if (!f.model_json.empty() && (f.seq_len || f.micro_batch || f.layers || f.hidden || f.ffn ||
                                f.heads || f.kv_heads || f.vocab)) {
    return absl::InvalidArgumentError(
        "--seq-len, --micro-batch and the shape overrides apply to --model presets, not to "
        "--model-json");
  }
  if (f.topology.empty()) return absl::InvalidArgumentError("--topology is required");
  return f;
}

}  // namespace shardline::tune_cli
