// overlap_bench: how much of the FSDP scheduler's communication hides behind compute.
//
//   build/bin/shardline-launch -n 2 -- build/bench/overlap_bench --units 16 --ratio 0.8
//
// Every rank builds the world over UCX (as the perf binaries do), then:
//
//  1. Calibration. Times all-gathers and reduce-scatters of one unit's size over the world on a
//     host stream, from pool-sized shareable host buffers like the scheduler's (median of
//     --calib-iters, the maximum over ranks, so every rank derives the same numbers). With
//     --unit-bytes auto the unit is first sized so that its all-gather takes about
//     --target-ag-us. The emulated compute per unit is then chosen so that the step's
//     communication is --ratio times its compute:
//        t_f = (2 t_AG + t_RS) / (ratio (1 + backward_factor)),   t_b = backward_factor t_f
//     (a unit is gathered twice, in forward and backward, and reduced once). With t_RS ~ t_AG
//     that makes the forward's gather and the backward's gather + reduction each `ratio` of
//     their phase's compute.
//  2. One Scheduler (full shard) per configuration, all over the same compute stream and the
//     same units (N of --unit-bytes, one f32 tensor each, no root unit unless --root-unit).
//  3. Steps. Forward: PreForward(u), a compute op of t_f, PostForward(u); backward in reverse:
//     PreBackward(u), a compute op of t_b, PostBackward(u); FinishBackward; then the host waits
//     for the compute stream. The compute stream is an emulated accelerator: a host stream whose
//     "kernel" sleeps until its end time (it occupies the stream without burning a core), so the
//     host thread only enqueues, as a CUDA framework's does. --compute caller instead runs the
//     kernels on the host thread (a CPU framework: the hooks' waits block the host). After the
//     timed part: ZeroGrad and a wait, outside the step (the optimizer's place).
//  4. Every configuration warms up (--warmup steps), then the configurations take turns
//     (round-robin) for --reps repetitions of --steps steps each; each figure is the median over
//     the reps x steps samples of rank 0.
//
// Figures per configuration (rank 0):
//   step        host wall time from the first PreForward to the end of the compute stream's work
//   compute     the emulated kernels' measured time (sum over the step)
//   comm        gathers x t_AG + reductions x t_RS (the calibration's times, the scheduler's
//               counts of issued collectives)
//   ideal       max(compute, comm) + t_AG + t_RS (the first gather and the last reduction cannot
//               overlap anything)
//   no-overlap  compute + comm
//   exposed     step - compute (everything the compute stream did not spend in kernels: waits
//               for gathers, the gradient zero-fills, the final wait for the reductions), and
//               beyond = exposed - t_AG - t_RS (what better scheduling could still hide), both
//               as % of the step
//   and the scheduler's own StepMetrics: exposed_communication, overlap_fraction, peak in flight
//   against the budget, deferred prefetches, overshoots, host time in the hooks.
//
// Flags (sizes take K/M/G suffixes, binary):
//   --units N (16)  --unit-bytes B|auto (auto)  --target-ag-us US (1000, for auto)
//   --ratio R (0.8)  --backward-factor F (2)  --steps K (5)  --warmup W (3)  --reps R (5)
//   --configs a,b,... (all: off,fwd1-bwd1,depth2,depth4,depth4-budget3,depth4-budget-min)
//   --compute stream|caller (stream)  --root-unit U (-1: none)  --calib-iters N (15)
//   --json FILE (rank 0)  --trace FILE (Chrome trace of rank 0's streams)  --timeout S (120)

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/bootstrap.h"
#include "collectives/communicator.h"
#include "runtime/allocator.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "scheduler/scheduler.h"

namespace shardline {
namespace {

// ---------------------------------------------------------------------------------------------
// Flags

struct Flags {
  int units = 16;
  size_t unit_bytes = 0;  // 0: auto
  double target_ag_us = 1000;
  double ratio = 0.8;
  double backward_factor = 2;
  int steps = 5;
  int warmup = 3;
  int reps = 5;
  std::vector<std::string> configs;
  std::string compute = "stream";
  int root_unit = -1;
  int calib_iters = 15;
  std::string json;
  std::string trace;
  int timeout_s = 120;
};

constexpr char kUsage[] =
    "usage: overlap_bench [--units N] [--unit-bytes B|auto] [--target-ag-us US] [--ratio R]\n"
    "         [--backward-factor F] [--steps K] [--warmup W] [--reps R] [--configs a,b,...]\n"
    "         [--compute stream|caller] [--root-unit U] [--calib-iters N] [--json FILE]\n"
    "         [--trace FILE] [--timeout S]\n"
    "configs: off fwd1-bwd1 depth2 depth4 depth4-budget3 depth4-budget-min (default: all)\n";

absl::StatusOr<size_t> ParseBytes(absl::string_view flag, absl::string_view text) {
  size_t scale = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        scale = size_t{1} << 10;
        break;
      case 'M':
      case 'm':
        scale = size_t{1} << 20;
        break;
      case 'G':
      case 'g':
        scale = size_t{1} << 30;
        break;
      default:
        break;
    }
    if (scale != 1) text.remove_suffix(1);
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", text, "' is not a positive size (bytes, K/M/G suffixes)"));
  }
  return static_cast<size_t>(value) * scale;
}

absl::Status ParseInt(absl::string_view flag, absl::string_view text, int lo, int* out) {
  if (!absl::SimpleAtoi(text, out) || *out < lo) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", text, "' is not an integer >= ", lo));
  }
  return absl::OkStatus();
}

absl::Status ParseDouble(absl::string_view flag, absl::string_view text, double* out) {
  if (!absl::SimpleAtod(text, out) || !(*out > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", text, "' is not a number > 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") continue;
    std::string value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (arg == "-h" || arg == "--help") {
      return absl::CancelledError("help");
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat(arg, ": missing value"));
    }
    if (arg == "--units") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.units));
    } else if (arg == "--unit-bytes") {
      if (value == "auto") {
        f.unit_bytes = 0;
      } else {
        SL_ASSIGN_OR_RETURN(f.unit_bytes, ParseBytes(arg, value));
      }
    } else if (arg == "--target-ag-us") {
      SL_RETURN_IF_ERROR(ParseDouble(arg, value, &f.target_ag_us));
    } else if (arg == "--ratio") {
      SL_RETURN_IF_ERROR(ParseDouble(arg, value, &f.ratio));
    } else if (arg == "--backward-factor") {
      SL_RETURN_IF_ERROR(ParseDouble(arg, value, &f.backward_factor));
    } else if (arg == "--steps") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.steps));
    } else if (arg == "--warmup") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.warmup));  // >= 1: the order is recorded
    } else if (arg == "--reps") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.reps));
    } else if (arg == "--configs") {
      f.configs = absl::StrSplit(value, ',', absl::SkipEmpty());
    } else if (arg == "--compute") {
      if (value != "stream" && value != "caller") {
        return absl::InvalidArgumentError(
            absl::StrCat(arg, ": '", value, "' is neither stream nor caller"));
      }
      f.compute = value;
    } else if (arg == "--root-unit") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, -1, &f.root_unit));
    } else if (arg == "--calib-iters") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.calib_iters));
    } else if (arg == "--json") {
      f.json = value;
    } else if (arg == "--trace") {
      f.trace = value;
    } else if (arg == "--timeout") {
      SL_RETURN_IF_ERROR(ParseInt(arg, value, 1, &f.timeout_s));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
    }
  }
  if (f.root_unit >= f.units) {
    return absl::InvalidArgumentError(
        absl::StrCat("--root-unit ", f.root_unit, " is not below --units ", f.units));
  }
  return f;
}

// ---------------------------------------------------------------------------------------------
// Configurations

enum class Budget : uint8_t { kUnlimited, kThreeUnits, kMinimum };

struct Config {
  std::string name;
  int forward = 0;
  BackwardPrefetch backward = BackwardPrefetch::kOff;
  int backward_depth = 1;
  Budget budget = Budget::kUnlimited;
};

const std::vector<Config>& AllConfigs() {
  static const std::vector<Config> configs = {
      {"off", 0, BackwardPrefetch::kOff, 1, Budget::kUnlimited},
      {"fwd1-bwd1", 1, BackwardPrefetch::kBeforeGrad, 1, Budget::kUnlimited},
      {"depth2", 2, BackwardPrefetch::kBeforeGrad, 2, Budget::kUnlimited},
      {"depth4", 4, BackwardPrefetch::kBeforeGrad, 4, Budget::kUnlimited},
      {"depth4-budget3", 4, BackwardPrefetch::kBeforeGrad, 4, Budget::kThreeUnits},
      {"depth4-budget-min", 4, BackwardPrefetch::kBeforeGrad, 4, Budget::kMinimum},
  };
  return configs;
}

absl::StatusOr<std::vector<Config>> SelectConfigs(const std::vector<std::string>& names) {
  if (names.empty()) return AllConfigs();
  std::vector<Config> out;
  for (const std::string& name : names) {
    auto it = std::find_if(AllConfigs().begin(), AllConfigs().end(),
                           [&](const Config& c) { return c.name == name; });
    if (it == AllConfigs().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--configs: unknown configuration '", name, "' (see --help)"));
    }
    out.push_back(*it);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The emulated accelerator's kernel: occupies its stream for `duration` by sleeping until an
// absolute end time (no core burnt, no drift from sleeping in pieces). The measured time is
// added to `*busy_ns`, so "compute" is what the kernels really took, oversleep included.

void EmulatedKernel(int64_t duration_ns, std::atomic<int64_t>* busy_ns) {
  // 1 ns timer slack instead of the default 50 us: the kernel ends on time.
  thread_local bool slack_set = [] { return prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0) == 0; }();
  (void)slack_set;
  timespec start{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  timespec end = start;
  end.tv_sec += duration_ns / 1000000000;
  end.tv_nsec += duration_ns % 1000000000;
  if (end.tv_nsec >= 1000000000) {
    end.tv_nsec -= 1000000000;
    ++end.tv_sec;
  }
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &end, nullptr) == EINTR) {
  }
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  busy_ns->fetch_add((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec),
                     std::memory_order_relaxed);
}

absl::Status EnqueueKernel(Stream& compute, const char* name, int64_t duration_ns,
                           std::atomic<int64_t>* busy_ns) {
  StreamOp op;
  op.name = name;
  op.kind = StreamOpKind::kCompute;
  op.run = [duration_ns, busy_ns]() -> absl::Status {
    EmulatedKernel(duration_ns, busy_ns);
    return absl::OkStatus();
  };
  return compute.Submit(std::move(op));
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// ---------------------------------------------------------------------------------------------
// Calibration

struct Calibration {
  size_t unit_bytes = 0;
  double ag_us = 0;  // one unit's all-gather (in place, the gathered size = unit_bytes)
  double rs_us = 0;  // one unit's reduce-scatter (avg, in place)
  double ag_min_us = 0, ag_max_us = 0, rs_min_us = 0, rs_max_us = 0;  // their spread
  double fill_us = 0;  // one unit's zero-fill (memset) on one thread, for reference
  double fwd_us = 0;   // emulated forward compute per unit
  double bwd_us = 0;   // emulated backward compute per unit
};

// Elements of a unit of about `bytes`: a multiple of 16 x the world size (no padding).
size_t UnitElements(size_t bytes, int world) {
  const size_t quantum = 16 * static_cast<size_t>(world);
  return std::max(quantum, bytes / sizeof(float) / quantum * quantum);
}

// `iters` timed all-gathers and reduce-scatters of `elements` f32 over `world`, each waited for,
// after two untimed ones: their medians (ag_us, rs_us), minima and maxima into `out`, each the
// maximum over ranks (so every rank agrees).
absl::Status TimeCollectives(Communicator& world, Allocator& alloc, Stream& stream, Stream& control,
                             size_t elements, int iters, absl::Time deadline, Calibration* out) {
  const size_t count = elements / world.size();
  SL_ASSIGN_OR_RETURN(Buffer buffer, alloc.Allocate(elements * sizeof(float)));
  std::memset(buffer.data(), 0, elements * sizeof(float));
  float* data = static_cast<float*>(buffer.data());
  std::vector<double> ag;
  std::vector<double> rs;
  for (int i = 0; i < iters + 2; ++i) {
    const absl::Time t0 = absl::Now();
    SL_ASSIGN_OR_RETURN(Work gather, world.AllGather(data + world.rank() * count, data, count,
                                                     DType::kF32, stream));
    SL_RETURN_IF_ERROR(gather.Wait(deadline));
    const absl::Time t1 = absl::Now();
    SL_ASSIGN_OR_RETURN(Work reduce,
                        world.ReduceScatter(data, data + world.rank() * count, count, DType::kF32,
                                            stream, {.op = ReduceOp::kAvg}));
    SL_RETURN_IF_ERROR(reduce.Wait(deadline));
    const absl::Time t2 = absl::Now();
    if (i >= 2) {
      ag.push_back(absl::ToDoubleMicroseconds(t1 - t0));
      rs.push_back(absl::ToDoubleMicroseconds(t2 - t1));
    }
  }
  double times[6] = {Median(ag),
                     Median(rs),
                     *std::min_element(ag.begin(), ag.end()),
                     *std::max_element(ag.begin(), ag.end()),
                     *std::min_element(rs.begin(), rs.end()),
                     *std::max_element(rs.begin(), rs.end())};
  SL_ASSIGN_OR_RETURN(
      Work agree, world.AllReduce(times, times, 6, DType::kF64, control, {.op = ReduceOp::kMax}));
  SL_RETURN_IF_ERROR(agree.Wait(deadline));
  out->ag_us = times[0];
  out->rs_us = times[1];
  out->ag_min_us = times[2];
  out->ag_max_us = times[3];
  out->rs_min_us = times[4];
  out->rs_max_us = times[5];
  return absl::OkStatus();
}

absl::StatusOr<Calibration> Calibrate(Communicator& world, const Flags& f, absl::Time deadline) {
  // The memory the scheduler's pools use over this world (ucx: shareable, mapped by peers).
  std::unique_ptr<Allocator> alloc = world.CreateHostAllocatorForTransfers(64, "calibration");
  SL_ASSIGN_OR_RETURN(auto stream, CreateHostStream({.name = "calibration"}));
  SL_ASSIGN_OR_RETURN(auto control, CreateCallerStream({.name = "calibration control"}));
  Calibration c;
  size_t elements = UnitElements(f.unit_bytes, world.size());
  if (f.unit_bytes == 0) {
    // Auto: measure at 4 MiB and scale linearly to the target gather time (the ranks agree on
    // the measurement, so on the size).
    const size_t probe = UnitElements(size_t{4} << 20, world.size());
    Calibration at_probe;
    SL_RETURN_IF_ERROR(TimeCollectives(world, *alloc, *stream, *control, probe, f.calib_iters,
                                       deadline, &at_probe));
    const double scaled =
        static_cast<double>(probe) * f.target_ag_us / std::max(at_probe.ag_us, 1.0);
    const double lo = 64 * 1024 / sizeof(float);
    const double hi = (size_t{256} << 20) / sizeof(float);
    elements =
        UnitElements(static_cast<size_t>(std::clamp(scaled, lo, hi)) * sizeof(float), world.size());
  }
  c.unit_bytes = elements * sizeof(float);
  SL_RETURN_IF_ERROR(
      TimeCollectives(world, *alloc, *stream, *control, elements, f.calib_iters, deadline, &c));
  {
    std::vector<double> fills;
    std::vector<float> scratch(elements);
    for (int i = 0; i < 7; ++i) {
      const absl::Time t0 = absl::Now();
      std::memset(scratch.data(), 0, c.unit_bytes);
      fills.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (scratch[i] != 0) return absl::InternalError("memset");  // keeps the fill
    }
    c.fill_us = Median(fills);
  }
  const double comm_per_unit = 2 * c.ag_us + c.rs_us;
  c.fwd_us = comm_per_unit / (f.ratio * (1 + f.backward_factor));
  c.bwd_us = c.fwd_us * f.backward_factor;
  return c;
}

// ---------------------------------------------------------------------------------------------
// One configuration's scheduler and its samples

struct Sample {
  double step_ms = 0;
  double compute_ms = 0;
  double enqueue_ms = 0;  // host time until FinishBackward returned
  double comm_ms = 0;
  double ideal_ms = 0;
  double no_overlap_ms = 0;
  double exposed_pct = 0;
  double beyond_pct = 0;
  double sched_step_ms = -1;
  double sched_exposed_ms = -1;
  double sched_comm_ms = -1;
  double overlap = -1;
  double hook_us_per_unit = 0;
  double peak_inflight_bytes = 0;
  double peak_inflight_units = 0;
  double deferred = 0;
  double overshoots = 0;
  double gathers = 0;
  double prefetched = 0;
  double reductions = 0;
};

struct Run {
  Config config;
  size_t budget_bytes = 0;
  std::unique_ptr<Scheduler> scheduler;
  std::vector<Sample> samples;
};

absl::StatusOr<std::unique_ptr<Scheduler>> MakeScheduler(std::shared_ptr<Communicator> world,
                                                         Stream& compute, const Flags& f,
                                                         const Config& config, size_t unit_bytes,
                                                         size_t budget_bytes, TraceWriter* trace,
                                                         absl::Time deadline) {
  SchedulerOptions options;
  options.name = config.name;
  options.strategy = ShardingStrategy::kFullShard;
  options.forward_prefetch = config.forward;
  options.backward_prefetch = config.backward;
  options.backward_prefetch_depth = config.backward_depth;
  options.budget_bytes = budget_bytes;
  options.root_unit = f.root_unit;
  options.trace = trace;
  if (trace != nullptr) {
    options.stream_factory =
        [trace, name = config.name](StreamOptions o) -> absl::StatusOr<std::unique_ptr<Stream>> {
      o.track = absl::StrCat(name, ".", o.track.empty() ? o.name : o.track);
      o.trace = trace;
      return CreateHostStream(std::move(o));
    };
  }
  SL_ASSIGN_OR_RETURN(auto scheduler, Scheduler::Create(world, compute, options, deadline));
  const size_t elements = unit_bytes / sizeof(float);
  for (int u = 0; u < f.units; ++u) {
    UnitSpec spec;
    spec.name = absl::StrCat("unit", u);
    spec.tensors = {{.name = "w", .shape = {static_cast<int64_t>(elements)}}};
    SL_RETURN_IF_ERROR(scheduler->RegisterUnit(std::move(spec)).status());
  }
  return scheduler;
}

absl::StatusOr<Sample> RunStep(Scheduler& s, Stream& compute, const Flags& f, const Calibration& c,
                               absl::Time deadline) {
  static std::atomic<int64_t> busy_ns{0};
  busy_ns.store(0);
  const int64_t fwd_ns = static_cast<int64_t>(c.fwd_us * 1000);
  const int64_t bwd_ns = static_cast<int64_t>(c.bwd_us * 1000);
  const absl::Time t0 = absl::Now();
  for (int u = 0; u < f.units; ++u) {
    SL_RETURN_IF_ERROR(s.PreForward(u));
    SL_RETURN_IF_ERROR(EnqueueKernel(compute, "forward", fwd_ns, &busy_ns));
    SL_RETURN_IF_ERROR(s.PostForward(u));
  }
  for (int u = f.units - 1; u >= 0; --u) {
    SL_RETURN_IF_ERROR(s.PreBackward(u));
    SL_RETURN_IF_ERROR(EnqueueKernel(compute, "backward", bwd_ns, &busy_ns));
    SL_RETURN_IF_ERROR(s.PostBackward(u));
  }
  SL_RETURN_IF_ERROR(s.FinishBackward());
  const absl::Time t_enqueued = absl::Now();
  SL_RETURN_IF_ERROR(compute.Synchronize(deadline));
  const absl::Time t1 = absl::Now();
  // The optimizer's place: outside the step.
  SL_RETURN_IF_ERROR(s.ZeroGrad());
  SL_RETURN_IF_ERROR(compute.Synchronize(deadline));
  SL_ASSIGN_OR_RETURN(StepMetrics m, s.LastStepMetrics(deadline));

  Sample x;
  x.step_ms = Ms(t1 - t0);
  x.enqueue_ms = Ms(t_enqueued - t0);
  x.compute_ms = busy_ns.load() / 1e6;
  for (const UnitStepMetrics& u : m.units) {
    x.gathers += u.gathers;
    x.prefetched += u.prefetched;
    x.reductions += u.reductions;
  }
  x.comm_ms = (x.gathers * c.ag_us + x.reductions * c.rs_us) / 1000;
  const double unhideable_ms = (c.ag_us + c.rs_us) / 1000;
  x.ideal_ms = std::max(x.compute_ms, x.comm_ms) + unhideable_ms;
  x.no_overlap_ms = x.compute_ms + x.comm_ms;
  x.exposed_pct = 100 * (x.step_ms - x.compute_ms) / x.step_ms;
  x.beyond_pct = 100 * (x.step_ms - x.compute_ms - unhideable_ms) / x.step_ms;
  if (m.step_time) x.sched_step_ms = Ms(*m.step_time);
  if (m.exposed_communication) x.sched_exposed_ms = Ms(*m.exposed_communication);
  if (m.communication_time) x.sched_comm_ms = Ms(*m.communication_time);
  if (m.overlap_fraction) x.overlap = *m.overlap_fraction;
  x.hook_us_per_unit = absl::ToDoubleMicroseconds(m.host_hook_time) / f.units;
  x.peak_inflight_bytes = static_cast<double>(m.peak_inflight_bytes);
  x.peak_inflight_units = m.peak_inflight_units;
  x.deferred = m.deferred_prefetches;
  x.overshoots = m.budget_overshoots;
  return x;
}

// The median of every field over the samples.
Sample MedianSample(const std::vector<Sample>& samples) {
  Sample out;
  auto field = [&](double Sample::*member) {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back(s.*member);
    out.*member = Median(std::move(v));
  };
  for (double Sample::*m : {&Sample::step_ms,
                            &Sample::compute_ms,
                            &Sample::enqueue_ms,
                            &Sample::comm_ms,
                            &Sample::ideal_ms,
                            &Sample::no_overlap_ms,
                            &Sample::exposed_pct,
                            &Sample::beyond_pct,
                            &Sample::sched_step_ms,
                            &Sample::sched_exposed_ms,
                            &Sample::sched_comm_ms,
                            &Sample::overlap,
                            &Sample::hook_us_per_unit,
                            &Sample::peak_inflight_bytes,
                            &Sample::peak_inflight_units,
                            &Sample::deferred,
                            &Sample::overshoots,
                            &Sample::gathers,
                            &Sample::prefetched,
                            &Sample::reductions}) {
    field(m);
  }
  return out;
}

std::string Mib(double bytes) { return absl::StrFormat("%.1f", bytes / (1 << 20)); }

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

std::string BudgetText(size_t budget) { return budget == 0 ? "unlimited" : Mib(budget) + " MiB"; }

void PrintReport(const Flags& f, const Calibration& c, int world_size, const std::vector<Run>& runs,
                 const std::string& load_before, const std::string& load_after) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::printf(
      "# overlap_bench: %d ranks (ucx), %d units of %s MiB (f32), compute %s, host %s, "
      "%ld cpus, load %s -> %s\n",
      world_size, f.units, Mib(static_cast<double>(c.unit_bytes)).c_str(), f.compute.c_str(), host,
      sysconf(_SC_NPROCESSORS_ONLN), load_before.c_str(), load_after.c_str());
  std::printf(
      "# calibration: all-gather %.0f us (min %.0f, max %.0f), reduce-scatter %.0f us (min %.0f, "
      "max %.0f) per unit: medians of %d, max over ranks; zero-fill (memset) %.0f us per unit\n",
      c.ag_us, c.ag_min_us, c.ag_max_us, c.rs_us, c.rs_min_us, c.rs_max_us, f.calib_iters,
      c.fill_us);
  std::printf(
      "# emulated compute per unit: forward %.0f us, backward %.0f us (ratio %.2f: "
      "2 AG + RS = %.2f x (forward + backward))\n",
      c.fwd_us, c.bwd_us, f.ratio, f.ratio);
  std::printf(
      "# medians over %d reps x %d steps (rank 0), after %d warm-up steps; "
      "configurations interleaved\n\n",
      f.reps, f.steps, f.warmup);
  std::printf(
      "| config | step ms | ideal ms | step / ideal | no-overlap ms | compute ms | exposed %% | "
      "beyond unhideable %% | zero-fills ms (est.) | sched exposed ms | sched overlap | "
      "peak in flight MiB (units) / budget | deferred | overshoots | prefetched / gathers | "
      "hooks us/unit |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n");
  // The gradient zero-fills (PrepareGrad, one per unit on the compute stream) are compute-stream
  // work outside the emulated kernels: estimated from the calibration's memset.
  const double fills_ms = f.units * c.fill_us / 1000;
  auto optional = [](double v, int digits) {
    return v < 0 ? std::string("n/a") : absl::StrFormat("%.*f", digits, v);
  };
  for (const Run& r : runs) {
    const Sample m = MedianSample(r.samples);
    std::printf("%s",
                absl::StrFormat(
                    "| %s | %.1f | %.1f | %.3f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %s "
                    "| %s (%.0f) / %s | %.0f | %.0f | %.0f / %.0f | %.1f |\n",
                    r.config.name, m.step_ms, m.ideal_ms, m.step_ms / m.ideal_ms, m.no_overlap_ms,
                    m.compute_ms, m.exposed_pct, m.beyond_pct, fills_ms,
                    optional(m.sched_exposed_ms, 1), optional(m.overlap, 2),
                    Mib(m.peak_inflight_bytes), m.peak_inflight_units, BudgetText(r.budget_bytes),
                    m.deferred, m.overshoots, m.prefetched, m.gathers, m.hook_us_per_unit)
                    .c_str());
  }
  std::printf(
      "\n# targets (16 units, ratio 0.8): exposed beyond the unhideable part < 5%% of "
      "the step; step <= 1.1 x ideal\n");
  for (const Run& r : runs) {
    const Sample m = MedianSample(r.samples);
    std::printf("#   %-18s beyond %5.1f%% %-4s  step/ideal %.3f %s\n", r.config.name.c_str(),
                m.beyond_pct, m.beyond_pct < 5 ? "met" : "MISS", m.step_ms / m.ideal_ms,
                m.step_ms / m.ideal_ms <= 1.1 ? "met" : "MISS");
  }
}

absl::Status WriteJson(const std::string& path, const Flags& f, const Calibration& c,
                       int world_size, const std::vector<Run>& runs, const std::string& load_before,
                       const std::string& load_after) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string out = absl::StrFormat(
      "{\n  \"benchmark\": \"overlap_bench\",\n  \"host\": \"%s\",\n  \"cpus\": %ld,\n"
      "  \"load_before\": \"%s\",\n  \"load_after\": \"%s\",\n  \"ranks\": %d,\n"
      "  \"units\": %d,\n  \"compute\": \"%s\",\n  \"root_unit\": %d,\n  \"steps\": %d,\n"
      "  \"warmup\": %d,\n  \"reps\": %d,\n  \"ratio\": %g,\n  \"backward_factor\": %g,\n"
      "  \"calibration\": {\"unit_bytes\": %zu, \"all_gather_us\": %.1f, "
      "\"reduce_scatter_us\": %.1f, \"all_gather_min_max_us\": [%.1f, %.1f], "
      "\"reduce_scatter_min_max_us\": [%.1f, %.1f], \"zero_fill_us\": %.1f, \"forward_us\": %.1f, "
      "\"backward_us\": %.1f},\n  \"configs\": [\n",
      host, sysconf(_SC_NPROCESSORS_ONLN), load_before, load_after, world_size, f.units, f.compute,
      f.root_unit, f.steps, f.warmup, f.reps, f.ratio, f.backward_factor, c.unit_bytes, c.ag_us,
      c.rs_us, c.ag_min_us, c.ag_max_us, c.rs_min_us, c.rs_max_us, c.fill_us, c.fwd_us, c.bwd_us);
  auto sample_json = [](const Sample& s) {
    return absl::StrFormat(
        "{\"step_ms\": %.3f, \"compute_ms\": %.3f, \"enqueue_ms\": %.3f, \"comm_ms\": %.3f, "
        "\"ideal_ms\": %.3f, \"no_overlap_ms\": %.3f, \"exposed_pct\": %.2f, "
        "\"beyond_unhideable_pct\": %.2f, \"sched_step_ms\": %.3f, \"sched_exposed_ms\": %.3f, "
        "\"sched_comm_ms\": %.3f, \"sched_overlap\": %.3f, \"hook_us_per_unit\": %.2f, "
        "\"peak_inflight_bytes\": %.0f, \"peak_inflight_units\": %.0f, \"deferred\": %.0f, "
        "\"overshoots\": %.0f, \"gathers\": %.0f, \"prefetched\": %.0f, \"reductions\": %.0f}",
        s.step_ms, s.compute_ms, s.enqueue_ms, s.comm_ms, s.ideal_ms, s.no_overlap_ms,
        s.exposed_pct, s.beyond_pct, s.sched_step_ms, s.sched_exposed_ms, s.sched_comm_ms,
        s.overlap, s.hook_us_per_unit, s.peak_inflight_bytes, s.peak_inflight_units, s.deferred,
        s.overshoots, s.gathers, s.prefetched, s.reductions);
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    absl::StrAppendFormat(
        &out,
        "    {\"name\": \"%s\", \"forward_prefetch\": %d, "
        "\"backward_prefetch\": \"%s\", \"backward_depth\": %d, "
        "\"budget_bytes\": %zu,\n     \"median\": %s,\n     \"samples\": [",
        r.config.name, r.config.forward, std::string(BackwardPrefetchName(r.config.backward)),
        r.config.backward_depth, r.budget_bytes, sample_json(MedianSample(r.samples)));
    for (size_t j = 0; j < r.samples.size(); ++j) {
      absl::StrAppend(&out, j == 0 ? "\n       " : ",\n       ", sample_json(r.samples[j]));
    }
    absl::StrAppend(&out, "]}", i + 1 < runs.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ]\n}\n");
  std::ofstream file(path);
  file << out;
  if (!file.good()) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status RunBench(std::shared_ptr<Communicator> world, const Flags& f) {
  const absl::Duration step_bound = absl::Seconds(f.timeout_s);
  SL_ASSIGN_OR_RETURN(std::vector<Config> configs, SelectConfigs(f.configs));
  const std::string load_before = LoadAverage();
  const bool leader = world->rank() == 0;

  SL_ASSIGN_OR_RETURN(Calibration c, Calibrate(*world, f, absl::Now() + step_bound));
  if (leader) {
    std::printf(
        "# calibrated: unit %zu bytes, AG %.0f us, RS %.0f us, forward %.0f us, "
        "backward %.0f us\n",
        c.unit_bytes, c.ag_us, c.rs_us, c.fwd_us, c.bwd_us);
  }

  std::unique_ptr<TraceWriter> trace;
  if (!f.trace.empty() && leader) trace = std::make_unique<TraceWriter>(world->rank());
  StreamOptions compute_options{.name = "compute", .trace = trace.get()};
  SL_ASSIGN_OR_RETURN(auto compute, f.compute == "caller" ? CreateCallerStream(compute_options)
                                                          : CreateHostStream(compute_options));

  // The minimum budget of these units (the scheduler's own figure), from a probe scheduler.
  uint64_t minimum = 0;
  {
    Config probe{.name = "probe"};
    SL_ASSIGN_OR_RETURN(auto s, MakeScheduler(world, *compute, f, probe, c.unit_bytes, 0, nullptr,
                                              absl::Now() + step_bound));
    minimum = s->MinimumBudgetBytes();
  }

  std::vector<Run> runs;
  for (const Config& config : configs) {
    Run r;
    r.config = config;
    switch (config.budget) {
      case Budget::kUnlimited:
        r.budget_bytes = 0;
        break;
      case Budget::kThreeUnits:
        r.budget_bytes = std::max<uint64_t>(3 * c.unit_bytes, minimum);
        break;
      case Budget::kMinimum:
        r.budget_bytes = minimum;
        break;
    }
    SL_ASSIGN_OR_RETURN(r.scheduler,
                        MakeScheduler(world, *compute, f, config, c.unit_bytes, r.budget_bytes,
                                      trace.get(), absl::Now() + step_bound));
    for (int i = 0; i < f.warmup; ++i) {
      SL_RETURN_IF_ERROR(RunStep(*r.scheduler, *compute, f, c, absl::Now() + step_bound).status());
    }
    runs.push_back(std::move(r));
  }
  for (int rep = 0; rep < f.reps; ++rep) {
    for (Run& r : runs) {
      for (int i = 0; i < f.steps; ++i) {
        SL_ASSIGN_OR_RETURN(Sample x,
                            RunStep(*r.scheduler, *compute, f, c, absl::Now() + step_bound));
        r.samples.push_back(x);
      }
    }
  }
  const std::string load_after = LoadAverage();
  if (leader) {
    PrintReport(f, c, world->size(), runs, load_before, load_after);
    if (!f.json.empty()) {
      SL_RETURN_IF_ERROR(WriteJson(f.json, f, c, world->size(), runs, load_before, load_after));
    }
    if (trace != nullptr) SL_RETURN_IF_ERROR(trace->WriteFile(f.trace));
  }
  runs.clear();  // the schedulers go before the compute stream
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  setlinebuf(stdout);
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok()) {
    if (absl::IsCancelled(flags.status())) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "overlap_bench: %s\n%s", std::string(flags.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  if (absl::StatusOr<std::vector<Config>> configs = SelectConfigs(flags->configs); !configs.ok()) {
    std::fprintf(stderr, "overlap_bench: %s\n", std::string(configs.status().message()).c_str());
    return 2;
  }
  InitOptions init;
  init.timeout = absl::Seconds(flags->timeout_s);
  absl::StatusOr<LaunchInfo> launch = ReadLaunchEnvironment();
  if (!launch.ok() && absl::IsNotFound(launch.status())) {
    LaunchInfo alone;  // no launcher: a world of one
    alone.master_port = 0;
    init.launch = alone;
  } else if (!launch.ok()) {
    std::fprintf(stderr, "overlap_bench: %s\n", launch.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<ProcessGroup> group = InitProcessGroup(init);
  if (!group.ok()) {
    std::fprintf(stderr, "overlap_bench: %s\n", group.status().ToString().c_str());
    return 1;
  }
  const absl::Status status = RunBench(group->world, *flags);
  if (!status.ok()) {
    std::fprintf(stderr, "overlap_bench: rank %d: %s\n", group->world->rank(),
                 status.ToString().c_str());
    group->world->Abort(status);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) { return shardline::Main(argc, argv); }
