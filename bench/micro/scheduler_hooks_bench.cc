// Host overhead of the FSDP scheduler's hooks: the wall time the calling thread spends inside
// PreForward / PostForward / PreBackward / PostBackward / FinishBackward, per unit per step.
// The ranks are threads over the local backend (1 and 2 ranks: Google Benchmark's threads, one
// rank each, all running the same number of steps); the compute stream is a host stream and the
// "compute" between the hooks is a no-op op on it, so nothing but the scheduler's own work
// (bookkeeping, events, enqueueing gathers and reductions, pool allocations) is timed. Units are
// small (one f32 tensor of 1024 elements), so the collectives themselves stay
// off the host thread's path.
//
//   scheduler_hooks_bench                          # 16 units, 1 and 2 ranks
//   scheduler_hooks_bench --benchmark_filter=/threads:2
//
// Counters: hook_ns_per_unit = the hooks' host time per unit per step (averaged over steps and
// ranks; the target is < 10 us); hook_cpu_ns_per_unit = the calling thread's CPU time inside the
// hooks per unit per step (system calls included, time preempted by other threads excluded: on a
// loaded machine the wall figure is mostly waiting for a core); last_step_sched_ns_per_unit = the
// scheduler's own StepMetrics::host_hook_time of the last step per unit (a cross-check); steps =
// steps timed per rank. The benchmark's own time is the whole step (hooks + waiting for the
// streams).

#include <atomic>
#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "scheduler/scheduler.h"

namespace shardline {
namespace {

// One group of local communicators per world size for the whole process: every run of a
// benchmark (Google Benchmark runs each several times) builds its schedulers over it.
std::shared_ptr<Communicator> World(int size, int rank) {
  static std::mutex mu;
  static std::vector<std::vector<std::shared_ptr<Communicator>>> groups(8);
  std::lock_guard<std::mutex> lock(mu);
  if (groups[size].empty()) {
    absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
        CreateLocalCommunicators(size, {.name = absl::StrCat("hooks", size)});
    SL_CHECK(comms.ok()) << comms.status();
    groups[size] = std::move(*comms);
  }
  return groups[size][rank];
}

absl::Status NoOp(Stream& compute) {
  StreamOp op;
  op.name = "compute";
  op.kind = StreamOpKind::kCompute;
  op.run = []() -> absl::Status { return absl::OkStatus(); };
  return compute.Submit(std::move(op));
}

// CPU time of the calling thread, ns.
int64_t ThreadCpuNs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The time spent inside the hooks: wall (`wall_ns`) and the calling thread's CPU (`cpu_ns`).
struct HookTimes {
  int64_t wall_ns = 0;
  int64_t cpu_ns = 0;
};

// One step; adds the time spent inside the hooks to `*times`.
absl::Status Step(Scheduler& s, Stream& compute, int units, HookTimes* times) {
  using Clock = std::chrono::steady_clock;
  auto timed = [&](auto&& hook) -> absl::Status {
    // The CPU clock is a system call: read outside the wall-timed span.
    const int64_t c0 = ThreadCpuNs();
    const Clock::time_point t0 = Clock::now();
    const absl::Status status = hook();
    const Clock::time_point t1 = Clock::now();
    times->cpu_ns += ThreadCpuNs() - c0;
    times->wall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    return status;
  };
  for (int u = 0; u < units; ++u) {
    if (absl::Status st = timed([&] { return s.PreForward(u); }); !st.ok()) return st;
    if (absl::Status st = NoOp(compute); !st.ok()) return st;
    if (absl::Status st = timed([&] { return s.PostForward(u); }); !st.ok()) return st;
  }
  for (int u = units - 1; u >= 0; --u) {
    if (absl::Status st = timed([&] { return s.PreBackward(u); }); !st.ok()) return st;
    if (absl::Status st = NoOp(compute); !st.ok()) return st;
    if (absl::Status st = timed([&] { return s.PostBackward(u); }); !st.ok()) return st;
  }
  if (absl::Status st = timed([&] { return s.FinishBackward(); }); !st.ok()) return st;
  return compute.Synchronize(absl::Now() + absl::Seconds(60));
}

// Args: units, elements per unit (f32), forward prefetch depth (backward before-grad, same depth;
// 0: both off), budget in units' worth of parameters (0: unlimited; 2 is the minimum: one
// unit's parameters and gradient).
void BM_SchedulerHooks(benchmark::State& state) {
  const int ranks = state.threads();
  const int units = static_cast<int>(state.range(0));
  const int64_t elements = state.range(1);
  const int depth = static_cast<int>(state.range(2));
  const int64_t budget_units = state.range(3);
  std::shared_ptr<Communicator> world = World(ranks, state.thread_index());

  absl::StatusOr<std::unique_ptr<Stream>> compute = CreateHostStream({.name = "compute"});
  SL_CHECK(compute.ok()) << compute.status();
  SchedulerOptions options;
  options.forward_prefetch = depth;
  options.backward_prefetch = depth == 0 ? BackwardPrefetch::kOff : BackwardPrefetch::kBeforeGrad;
  options.backward_prefetch_depth = std::max(depth, 1);
  options.root_unit = -1;
  options.budget_bytes = static_cast<size_t>(budget_units * elements) * sizeof(float);
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler =
      Scheduler::Create(world, **compute, options, absl::Now() + absl::Seconds(60));
  SL_CHECK(scheduler.ok()) << scheduler.status();
  Scheduler& s = **scheduler;
  for (int u = 0; u < units; ++u) {
    absl::StatusOr<int> id = s.RegisterUnit(
        {.name = absl::StrCat("unit", u), .tensors = {{.name = "w", .shape = {elements}}}});
    SL_CHECK(id.ok()) << id.status();
  }
  // Warm-up: the first step records the order and compares it across ranks; the second fills
  // the pools.
  HookTimes ignored;
  for (int i = 0; i < 2; ++i) SL_CHECK_OK(Step(s, **compute, units, &ignored));

  HookTimes times;
  for (auto _ : state) {
    const absl::Status status = Step(s, **compute, units, &times);
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
  }
  // kAvgIterations divides the sum over the threads by the iterations of all threads together:
  // the mean per step per rank.
  state.counters["hook_ns_per_unit"] = benchmark::Counter(
      static_cast<double>(times.wall_ns) / units, benchmark::Counter::kAvgIterations);
  state.counters["hook_cpu_ns_per_unit"] = benchmark::Counter(
      static_cast<double>(times.cpu_ns) / units, benchmark::Counter::kAvgIterations);
  // Cross-check: the scheduler's own figure (StepMetrics::host_hook_time) of the last step.
  absl::StatusOr<StepMetrics> last = s.LastStepMetrics(absl::Now() + absl::Seconds(60));
  SL_CHECK(last.ok()) << last.status();
  state.counters["last_step_sched_ns_per_unit"] = benchmark::Counter(
      absl::ToDoubleNanoseconds(last->host_hook_time) / units, benchmark::Counter::kAvgThreads);
  state.counters["steps"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kAvgThreads);
  // The scheduler goes first (it drains its streams), then the compute stream.
  scheduler->reset();
}

BENCHMARK(BM_SchedulerHooks)
    ->ArgNames({"units", "elements", "depth", "budget"})
    ->Args({16, 1024, 1, 0})
    ->Args({16, 1024, 0, 0})
    ->Args({16, 1024, 4, 0})
    ->Args({16, 1024, 4, 2})
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
