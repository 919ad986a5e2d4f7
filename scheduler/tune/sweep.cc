#include "scheduler/tune/sweep.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {
namespace {

std::string StrategyShortName(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard:
      return "full";
    case ShardingStrategy::kShardGradOp:
      return "shard_grad_op";
    case ShardingStrategy::kNoShard:
      return "no_shard";
    case ShardingStrategy::kHybridShard:
      return "hybrid";
  }
  return "?";
}

std::string DTypeOr(const std::optional<DType>& d) {
  return d.has_value() ? std::string(DTypeName(*d)) : "model";
}

double Seconds(const std::optional<absl::Duration>& d) {
  return d.has_value() ? absl::ToDoubleSeconds(*d) : 0;
}

// The fields of a row, in order, as (name, JSON text, CSV text).
struct Field {
  std::string name, json, csv;
};

std::string CsvQuote(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\"", "\"\""}}), "\"");
}

std::vector<Field> RowFields(const SweepRow& row, int index) {
  std::vector<Field> f;
  auto integer = [&](std::string name, int64_t v) {
    f.push_back({std::move(name), absl::StrCat(v), absl::StrCat(v)});
  };
  auto number = [&](std::string name, double v) {
    f.push_back({std::move(name), JsonNumber(v), JsonNumber(v)});
  };
  // A figure that needs the peak: null (CSV: empty) where none is known.
  auto of_peak = [&](std::string name, double v) {
    if (row.peak_flops_per_s > 0) {
      number(std::move(name), v);
    } else {
      f.push_back({std::move(name), "null", ""});
    }
  };
  auto text = [&](std::string name, const std::string& v) {
    f.push_back({std::move(name), JsonQuote(v), CsvQuote(v)});
  };
  auto boolean = [&](std::string name, bool v) {
    f.push_back({std::move(name), v ? "true" : "false", v ? "true" : "false"});
  };
  const SimulationConfig& c = row.config;
  const SimulationReport& r = row.report;
  integer("index", index);
  text("strategy", StrategyShortName(c.strategy));
  integer("shard_size", c.strategy == ShardingStrategy::kHybridShard ? c.shard_size
                        : c.strategy == ShardingStrategy::kNoShard   ? 1
                                                                     : c.world_size);
  integer("forward_prefetch", c.forward_prefetch);
  text("backward_prefetch", std::string(BackwardPrefetchName(c.backward_prefetch)));
  integer("backward_prefetch_depth", c.backward_prefetch_depth);
  integer("budget_units", c.budget_units);
  integer("budget_bytes", static_cast<int64_t>(c.budget_bytes));
  text("param_dtype", DTypeOr(c.param_dtype));
  text("reduce_dtype", DTypeOr(c.reduce_dtype));
  text("activation_checkpointing", ActivationCheckpointingName(c.activation_checkpointing));
  integer("micro_batches", c.micro_batches);
  text("accumulation", std::string(GradientAccumulationName(c.accumulation)));
  boolean("cpu_offload", c.cpu_offload);
  boolean("ok", row.status.ok());
  text("error", row.status.ok() ? "" : std::string(row.status.message()));
  integer("ranks_simulated", r.ranks_simulated);
  boolean("representative", r.representative);
  number("step_time_s", Seconds(r.step_time));
  number("compute_time_s", absl::ToDoubleSeconds(r.compute_time));
  number("exposed_communication_s", Seconds(r.exposed_communication));
  number("communication_time_s", Seconds(r.communication_time));
  number("tokens_per_s_per_device", r.tokens_per_s_per_device);
  of_peak("peak_TFLOPs", row.peak_flops_per_s / 1e12);
  of_peak("mfu", row.mfu);
  of_peak("hfu", row.hfu);
  number("compute_busy", row.compute_busy);
  number("ring_sent_bytes_per_rank", r.ring_sent_bytes_per_rank);
  number("intra_node_bytes_per_device", r.intra_node_bytes_per_device);
  number("inter_node_bytes_per_device", r.inter_node_bytes_per_device);
  integer("budget_overshoots", r.metrics.budget_overshoots);
  const MemoryReport& m = r.memory;
  integer("mem_master_shards_bytes", static_cast<int64_t>(m.master_shards));
  integer("mem_sharded_grads_bytes", static_cast<int64_t>(m.sharded_grads));
  integer("mem_optimizer_state_bytes", static_cast<int64_t>(m.optimizer_state));
  integer("mem_unsharded_params_peak_bytes", static_cast<int64_t>(m.unsharded_params_peak));
  integer("mem_grad_buffers_peak_bytes", static_cast<int64_t>(m.grad_buffers_peak));
  integer("mem_activations_peak_bytes", static_cast<int64_t>(m.activations_peak));
  integer("mem_total_peak_bytes", static_cast<int64_t>(m.total_peak));
  integer("mem_host_peak_bytes", static_cast<int64_t>(m.host_peak));
  boolean("fits", row.status.ok() && r.fits);
  return f;
}

}  // namespace

absl::StatusOr<std::vector<SimulationConfig>> ExpandSweep(const SweepSpace& s) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("sweep: ", parts...));
  };
  if (s.world_size < 1) return bad("world_size must be at least 1, got ", s.world_size);
  struct Dim {
    const char* name;
    size_t size;
  };
  for (const Dim& d :
       {Dim{"strategies", s.strategies.size()}, Dim{"forward_prefetch", s.forward_prefetch.size()},
        Dim{"backward_prefetch", s.backward_prefetch.size()},
        Dim{"backward_prefetch_depth", s.backward_prefetch_depth.size()},
        Dim{"budget_units", s.budget_units.size()}, Dim{"budget_bytes", s.budget_bytes.size()},
        Dim{"param_dtypes", s.param_dtypes.size()}, Dim{"reduce_dtypes", s.reduce_dtypes.size()},
        Dim{"activation_checkpointing", s.activation_checkpointing.size()},
        Dim{"micro_batches", s.micro_batches.size()}, Dim{"accumulation", s.accumulation.size()},
        Dim{"cpu_offload", s.cpu_offload.size()}}) {
    if (d.size == 0) return bad("dimension '", d.name, "' has no values");
  }
  for (const int v : s.forward_prefetch) {
    if (v < 0) return bad("forward_prefetch ", v, " is negative");
  }
  for (const int v : s.micro_batches) {
    if (v < 1) return bad("micro_batches ", v, " is below 1");
  }
  for (const int v : s.backward_prefetch_depth) {
    if (v < 0) return bad("backward_prefetch_depth ", v, " is negative");
  }
  for (const int v : s.budget_units) {
    if (v < 0) return bad("budget_units ", v, " is negative");
  }
  // Each strategy with its shard sizes.
  std::vector<std::pair<ShardingStrategy, int>> meshes;
  for (const ShardingStrategy st : s.strategies) {
    if (st != ShardingStrategy::kHybridShard) {
      meshes.emplace_back(st, 0);
      continue;
    }
    if (s.hybrid_shard_sizes.empty()) return bad("hybrid needs at least one shard size");
    for (const int k : s.hybrid_shard_sizes) {
      if (k < 1 || s.world_size % k != 0) {
        return bad("hybrid shard size ", k, " does not divide the world size ", s.world_size);
      }
      meshes.emplace_back(st, k);
    }
  }
  std::vector<SimulationConfig> out;
  for (const auto& [strategy, k] : meshes) {
    for (const int fp : s.forward_prefetch) {
      for (const BackwardPrefetch bp : s.backward_prefetch) {
        // With backward prefetch off the depth does nothing: one value.
        std::vector<int> depths = s.backward_prefetch_depth;
        if (bp == BackwardPrefetch::kOff) depths = {depths.front()};
        for (const int bd : depths) {
          for (const int bu : s.budget_units) {
            for (const uint64_t bb : s.budget_bytes) {
              for (const std::optional<DType>& pd : s.param_dtypes) {
                for (const std::optional<DType>& rd : s.reduce_dtypes) {
                  for (const ActivationCheckpointing& ckpt : s.activation_checkpointing) {
                    for (const int mb : s.micro_batches) {
                      // With one micro-batch the accumulation mode does nothing: one value.
                      std::vector<GradientAccumulation> modes = s.accumulation;
                      if (mb == 1) modes = {modes.front()};
                      for (const GradientAccumulation acc : modes) {
                        for (const bool offload : s.cpu_offload) {
                          SimulationConfig c;
                          c.world_size = s.world_size;
                          c.ranks = s.ranks;
                          c.strategy = strategy;
                          c.shard_size = k;
                          c.forward_prefetch = fp;
                          c.backward_prefetch = bp;
                          c.backward_prefetch_depth = bd;
                          c.budget_units = bu;
                          c.budget_bytes = bb;
                          c.param_dtype = pd;
                          c.reduce_dtype = rd;
                          c.activation_checkpointing = ckpt;
                          c.micro_batches = mb;
                          c.accumulation = acc;
                          c.cpu_offload = offload;
                          c.host_lead = s.host_lead;
                          out.push_back(c);
                        }
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

absl::StatusOr<SweepResult> RunSweep(const ModelDescription& model,
                                     const std::vector<SimulationConfig>& configs,
                                     const SimCluster& cluster, const SweepOptions& options) {
  if (configs.empty()) return absl::InvalidArgumentError("sweep: no configurations");
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sweep: threads must be at least 1, got ", options.threads));
  }
  SL_RETURN_IF_ERROR(model.Validate());
  SweepResult result;
  auto peak_of = [&](const std::optional<DType>& param_dtype) {
    return options.peak_flops_per_s > 0
               ? options.peak_flops_per_s
               : cluster.peak_flops_per_s(param_dtype.value_or(model.precision.param_dtype));
  };
  result.peak_flops_per_s = peak_of(std::nullopt);
  result.rows.resize(configs.size());
  const absl::Time start = absl::Now();
  std::atomic<size_t> next{0};
  std::mutex progress_mu;
  int done = 0;
  auto work = [&] {
    for (size_t i = next++; i < configs.size(); i = next++) {
      SweepRow& row = result.rows[i];
      row.config = configs[i];
      absl::StatusOr<SimulationReport> r = Simulate(model, configs[i], cluster);
      if (r.ok()) {
        row.report = *std::move(r);
        row.report.event_logs.clear();  // not part of the table; large for big models
        row.peak_flops_per_s = peak_of(row.config.param_dtype);
        if (row.report.step_time.has_value() && *row.report.step_time > absl::ZeroDuration()) {
          const double step_s = absl::ToDoubleSeconds(*row.report.step_time);
          if (row.peak_flops_per_s > 0) {
            row.mfu = static_cast<double>(row.report.model_flops) / step_s / row.peak_flops_per_s;
            row.hfu = static_cast<double>(row.report.step_flops) / step_s / row.peak_flops_per_s;
          }
          row.compute_busy = absl::ToDoubleSeconds(row.report.compute_time) / step_s;
        }
      } else {
        row.status = r.status();
      }
      if (options.progress) {
        std::lock_guard<std::mutex> lock(progress_mu);
        options.progress(++done, static_cast<int>(configs.size()));
      }
    }
  };
  const int threads = std::min<int>(options.threads, static_cast<int>(configs.size()));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (size_t i = 0; i < result.rows.size(); ++i) {
    const SweepRow& row = result.rows[i];
    if (!row.status.ok() || !row.report.fits) continue;
    if (result.best < 0) {
      result.best = static_cast<int>(i);
      continue;
    }
    const SweepRow& best = result.rows[result.best];
    if (row.report.tokens_per_s_per_device > best.report.tokens_per_s_per_device ||
        (row.report.tokens_per_s_per_device == best.report.tokens_per_s_per_device &&
         row.report.memory.total_peak < best.report.memory.total_peak)) {
      result.best = static_cast<int>(i);
    }
  }
  return result;
}

std::string DescribeConfig(const SimulationConfig& c) {
  std::string s = StrategyShortName(c.strategy);
  if (c.strategy == ShardingStrategy::kHybridShard) absl::StrAppend(&s, " k=", c.shard_size);
  absl::StrAppend(&s, " fp=", c.forward_prefetch, " bp=", BackwardPrefetchName(c.backward_prefetch),
                  ":", c.backward_prefetch_depth, " bu=", c.budget_units, " bb=", c.budget_bytes,
                  " p=", DTypeOr(c.param_dtype), " r=", DTypeOr(c.reduce_dtype));
  switch (c.activation_checkpointing.mode) {
    case CheckpointMode::kOff:
      break;
    case CheckpointMode::kFull:
      absl::StrAppend(&s, " ckpt");
      break;
    default:
      absl::StrAppend(&s, " ckpt=", ActivationCheckpointingName(c.activation_checkpointing));
  }
  if (c.micro_batches > 1) {
    absl::StrAppend(&s, " mb=", c.micro_batches, ":", GradientAccumulationName(c.accumulation));
  }
  if (c.cpu_offload) absl::StrAppend(&s, " offload");
  return s;
}

std::string SweepToJson(const SweepResult& result, const ModelDescription& model,
                        const SimCluster& cluster) {
  std::vector<std::string> not_modelled;
  for (const char* what : kNotModelled) not_modelled.push_back(JsonQuote(what));
  std::string out = absl::StrCat(
      "{\n  \"model\": ", JsonQuote(model.name), ",\n  \"parameters\": ", model.ParameterCount(),
      ",\n  \"cluster\": ", JsonQuote(cluster.Describe()),
      ",\n  \"world_size\": ", result.rows.empty() ? 0 : result.rows[0].config.world_size,
      ",\n  \"device_memory_bytes\": ", cluster.device_memory_bytes(), ",\n  \"peak_TFLOPs\": ",
      result.peak_flops_per_s > 0 ? JsonNumber(result.peak_flops_per_s / 1e12) : "null",
      ",\n  \"not_modelled\": [", absl::StrJoin(not_modelled, ", "),
      "],\n  \"best\": ", result.best, ",\n  \"seconds\": ", JsonNumber(result.seconds),
      ",\n  \"rows\": [");
  for (size_t i = 0; i < result.rows.size(); ++i) {
    std::vector<std::string> members, memory;
    for (const Field& f : RowFields(result.rows[i], static_cast<int>(i))) {
      if (f.name.rfind("mem_", 0) == 0) {
        // "mem_total_peak_bytes" -> "total_peak" inside "memory".
        const std::string name = f.name.substr(4, f.name.size() - 4 - 6);
        memory.push_back(absl::StrCat(JsonQuote(name), ": ", f.json));
      } else {
        members.push_back(absl::StrCat(JsonQuote(f.name), ": ", f.json));
      }
    }
    members.insert(members.end() - 1,
                   absl::StrCat("\"memory\": {", absl::StrJoin(memory, ", "), "}"));
    absl::StrAppend(&out, i == 0 ? "\n    {" : ",\n    {", absl::StrJoin(members, ", "), "}");
  }
  absl::StrAppend(&out, "\n  ]\n}\n");
  return out;
}

std::string SweepToCsv(const SweepResult& result) {
  std::string out;
  for (size_t i = 0; i < result.rows.size(); ++i) {
    const std::vector<Field> fields = RowFields(result.rows[i], static_cast<int>(i));
    if (i == 0) {
      std::vector<std::string> names;
      for (const Field& f : fields) names.push_back(f.name);
      absl::StrAppend(&out, absl::StrJoin(names, ","), "\n");
    }
    std::vector<std::string> values;
    for (const Field& f : fields) values.push_back(f.csv);
    absl::StrAppend(&out, absl::StrJoin(values, ","), "\n");
  }
  return out;
}

}  // namespace shardline
