// The main job: a small language model (examples/model/tiny_lm.h: a tied embedding/output head
// and residual MLP blocks, 11 units) trained data-parallel and sharded by the scheduler on the
// UCX backend, one process per rank:
//
//   build/bin/shardline-launch -n 2 -- build/examples/train_fsdp [flags]
//
// Rank 0 (every rank with --verbose) prints per step the loss, the step time, the exposed
// communication, peak communication memory against the budget, and the host time inside the
// hooks (the compute is this thread, so that includes its waits for gathers); at the end the final
// parameters are checked against a single-process unsharded run of the same model and data
// (per-tensor relative error ||sharded - unsharded|| / ||unsharded||), and each rank writes a
// Chrome trace that rank 0 merges into one file (open it in https://ui.perfetto.dev).
//
// Flags: --steps N (10)  --strategy full_shard|shard_grad_op|no_shard|hybrid_shard
//        --shard-size S (hybrid)  --micro M (1)  --accumulation sync|no_sync|defer_all_reduce
//        --param-dtype f32|bf16  --budget-kib K (0: unlimited)  --prefetch D (1)
//        --backward-prefetch off|before|after  --recompute  --cpu-offload  --blocks B (10)
//        --trace PATH (train_fsdp_trace.json; "" for none)  --tolerance T (1e-5; bf16: 2e-2)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collectives/bootstrap.h"
#include "examples/model/sharded_trainer.h"
#include "runtime/status.h"
#include "runtime/trace.h"

namespace sl = shardline;
namespace ex = shardline::examples;

namespace {

struct Flags {
  int steps = 10;
  std::string strategy = "full_shard";
  int shard_size = 0;
  int micro = 1;
  std::string accumulation = "sync";
  std::string param_dtype = "f32";
  int64_t budget_kib = 0;
  int prefetch = 1;
  std::string backward_prefetch = "before";
  bool recompute = false;
  bool cpu_offload = false;
  bool verbose = false;
  int blocks = 10;
  std::string trace = "train_fsdp_trace.json";
  double tolerance = 0;
};

absl::Status Parse(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> absl::StatusOr<std::string> {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
      return std::string(argv[++i]);
    };
    auto integer = [&](auto& out) -> absl::Status {
      SL_ASSIGN_OR_RETURN(std::string v, value());
      int64_t parsed = 0;
      if (!absl::SimpleAtoi(v, &parsed)) {
        return absl::InvalidArgumentError(absl::StrCat(flag, ": '", v, "' is not an integer"));
      }
      out = static_cast<std::remove_reference_t<decltype(out)>>(parsed);
      return absl::OkStatus();
    };
    if (flag == "--steps") {
      SL_RETURN_IF_ERROR(integer(f.steps));
    } else if (flag == "--strategy") {
      SL_ASSIGN_OR_RETURN(f.strategy, value());
    } else if (flag == "--shard-size") {
      SL_RETURN_IF_ERROR(integer(f.shard_size));
    } else if (flag == "--micro") {
      SL_RETURN_IF_ERROR(integer(f.micro));
    } else if (flag == "--accumulation") {
      SL_ASSIGN_OR_RETURN(f.accumulation, value());
    } else if (flag == "--param-dtype") {
      SL_ASSIGN_OR_RETURN(f.param_dtype, value());
    } else if (flag == "--budget-kib") {
      SL_RETURN_IF_ERROR(integer(f.budget_kib));
    } else if (flag == "--prefetch") {
      SL_RETURN_IF_ERROR(integer(f.prefetch));
    } else if (flag == "--backward-prefetch") {
      SL_ASSIGN_OR_RETURN(f.backward_prefetch, value());
    } else if (flag == "--blocks") {
      SL_RETURN_IF_ERROR(integer(f.blocks));
    } else if (flag == "--recompute") {
      f.recompute = true;
    } else if (flag == "--cpu-offload") {
      f.cpu_offload = true;
    } else if (flag == "--verbose") {
      f.verbose = true;
    } else if (flag == "--trace") {
      SL_ASSIGN_OR_RETURN(f.trace, value());
    } else if (flag == "--tolerance") {
      SL_ASSIGN_OR_RETURN(std::string v, value());
      if (!absl::SimpleAtod(v, &f.tolerance)) {
        return absl::InvalidArgumentError(absl::StrCat("--tolerance: '", v, "' is not a number"));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag '", flag, "' (see the source's header)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ex::ShardedRunOptions> MakeOptions(const Flags& f, sl::TraceWriter* trace) {
  ex::ShardedRunOptions o;
  o.steps = f.steps;
  o.micro_batches = f.micro;
  o.scheduler.trace = trace;
  o.scheduler.shard_size = f.shard_size;
  o.scheduler.forward_prefetch = f.prefetch;
  o.scheduler.budget_bytes = static_cast<size_t>(f.budget_kib) * 1024;
  o.train.step.recompute = f.recompute;
  o.scheduler.cpu_offload = f.cpu_offload;
  if (f.strategy == "full_shard") {
    o.scheduler.strategy = sl::ShardingStrategy::kFullShard;
  } else if (f.strategy == "shard_grad_op") {
    o.scheduler.strategy = sl::ShardingStrategy::kShardGradOp;
  } else if (f.strategy == "no_shard") {
    o.scheduler.strategy = sl::ShardingStrategy::kNoShard;
  } else if (f.strategy == "hybrid_shard") {
    o.scheduler.strategy = sl::ShardingStrategy::kHybridShard;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--strategy: unknown '", f.strategy, "'"));
  }
  if (f.accumulation == "sync") {
    o.accumulation = ex::Accumulation::kSync;
  } else if (f.accumulation == "no_sync") {
    o.accumulation = ex::Accumulation::kNoSync;
  } else if (f.accumulation == "defer_all_reduce") {
    o.accumulation = ex::Accumulation::kDeferAllReduce;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--accumulation: unknown '", f.accumulation, "'"));
  }
  if (f.param_dtype == "bf16") {
    o.precision.param_dtype = sl::DType::kBF16;
  } else if (f.param_dtype != "f32") {
    return absl::InvalidArgumentError(
        absl::StrCat("--param-dtype: f32 or bf16, not '", f.param_dtype, "'"));
  }
  if (f.backward_prefetch == "off") {
    o.scheduler.backward_prefetch = sl::BackwardPrefetch::kOff;
  } else if (f.backward_prefetch == "after") {
    o.scheduler.backward_prefetch = sl::BackwardPrefetch::kAfterGrad;
  } else if (f.backward_prefetch != "before") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backward-prefetch: off, before or after, not '", f.backward_prefetch, "'"));
  }
  return o;
}

std::string Mib(double bytes) { return absl::StrFormat("%.2f MiB", bytes / 1048576.0); }

absl::Status Run(int argc, char** argv) {
  Flags flags;
  SL_RETURN_IF_ERROR(Parse(argc, argv, flags));
  SL_ASSIGN_OR_RETURN(sl::ProcessGroup group, sl::InitProcessGroup());
  const int rank = group.world->rank();
  const bool print = rank == 0 || flags.verbose;
  sl::TraceWriter trace(rank, absl::StrCat("rank ", rank));
  SL_ASSIGN_OR_RETURN(ex::ShardedRunOptions options,
                      MakeOptions(flags, flags.trace.empty() ? nullptr : &trace));
  ex::ModelConfig config;
  config.blocks = flags.blocks;
  if (print) {
    std::printf(
        "train_fsdp: %d ranks (ucx), %s, %d units (tied embedding/head + %d blocks), "
        "param %s, prefetch %d, budget %s, %d micro-batch(es) (%s)\n",
        group.world->size(), flags.strategy.c_str(), config.num_units(), config.blocks,
        flags.param_dtype.c_str(), flags.prefetch,
        flags.budget_kib == 0 ? "unlimited" : absl::StrCat(flags.budget_kib, " KiB").c_str(),
        flags.micro, flags.accumulation.c_str());
  }
  options.on_step = [&](int step, double loss, const sl::StepMetrics& m, absl::Duration wall) {
    if (!print) return;
    const double exposed =
        m.exposed_communication ? absl::ToDoubleMilliseconds(*m.exposed_communication) : 0;
    std::printf(
        "[rank %d] step %2d  loss %.4f  step %6.2f ms  exposed comm %5.2f ms (%4.1f%%)  "
        "peak in flight %s / %s (%d units)%s  in hooks %.2f ms\n",
        rank, step, loss, absl::ToDoubleMilliseconds(wall), exposed,
        100.0 * exposed / std::max(1e-9, absl::ToDoubleMilliseconds(wall)),
        Mib(m.peak_inflight_bytes).c_str(),
        m.budget_bytes == 0 ? "unlimited" : Mib(m.budget_bytes).c_str(), m.peak_inflight_units,
        m.budget_overshoots > 0 ? absl::StrCat(" ", m.budget_overshoots, " overshoots").c_str()
                                : "",
        absl::ToDoubleMilliseconds(m.host_hook_time));
    std::fflush(stdout);
  };
  SL_ASSIGN_OR_RETURN(ex::ShardedRun run, ex::TrainSharded(config, group.world, options));
  SL_ASSIGN_OR_RETURN(ex::ReferenceComparison cmp,
                      ex::CompareWithReference(config, *group.world, run, options));
  const double tolerance =
      flags.tolerance > 0 ? flags.tolerance : (flags.param_dtype == "f32" ? 1e-5 : 2e-2);
  if (print) {
    std::printf(
        "[rank %d] final loss %.4f (unsharded reference %.4f); parameters vs the unsharded "
        "single-process run: max per-tensor relative error %.2e (tolerance %.0e): %s\n",
        rank, run.losses.back(), cmp.reference_losses.back(), cmp.max_relative_error, tolerance,
        cmp.max_relative_error <= tolerance ? "OK" : "FAILED");
  }
  if (!flags.trace.empty()) {
    const std::string mine = absl::StrCat(flags.trace, ".rank", rank);
    SL_RETURN_IF_ERROR(trace.WriteFile(mine));
    SL_ASSIGN_OR_RETURN(std::unique_ptr<sl::Stream> stream, sl::CreateCallerStream());
    SL_ASSIGN_OR_RETURN(sl::Work barrier, group.world->Barrier(*stream));
    SL_RETURN_IF_ERROR(barrier.Wait(absl::Now() + group.world->timeout()));
    if (rank == 0) {
      std::vector<std::string> files;
      for (int r = 0; r < group.world->size(); ++r)
        files.push_back(absl::StrCat(flags.trace, ".rank", r));
      SL_RETURN_IF_ERROR(sl::MergeTraceFiles(files, flags.trace));
      std::printf("[rank 0] trace: %s (per rank: %s.rank<r>)\n", flags.trace.c_str(),
                  flags.trace.c_str());
    }
  }
  if (cmp.max_relative_error > tolerance) {
    return absl::InternalError(absl::StrCat("the sharded run differs from the unsharded one: ",
                                            cmp.max_relative_error, " > ", tolerance));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status status = Run(argc, argv);
  if (!status.ok()) {
    std::fprintf(stderr, "train_fsdp: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
