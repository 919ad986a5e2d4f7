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
// ranks; the target is at most 3 us); hook_cpu_ns_per_unit = the calling thread's CPU time inside
// the hooks per unit per step (system calls included, time preempted by other threads excluded: on
// a loaded machine the wall figure is mostly waiting for a core); last_step_sched_ns_per_unit = the
// scheduler's own StepMetrics::host_hook_time of the last step per unit (a cross-check); steps =
// steps timed per rank; timer_cpu_ns_per_unit = the part of hook_cpu_ns_per_unit that is this
// benchmark's own timing (measured on an empty hook); submits, records, records_queued, waits,
// waits_queued, wakes, events, records_shared = what the hooks asked of the host streams per unit
// per step (ThisThreadHostStreamCallStats); allocs = heap allocations (operator new, every form)
// made by the calling thread inside the hooks per unit per step; with
// SHARDLINE_HOOKS_BENCH_SYSCALLS=1 also syscalls, futex, ctx_switches of the hook thread inside the
// hooks (SyscallCounters); with SHARDLINE_HOOKS_BENCH_CPU=0 no CPU-clock reads at all (wall only);
// with SHARDLINE_HOOKS_BENCH_UNTIMED=1 the schedulers do not time their communication
// (SchedulerOptions::time_communication).
// The benchmark's own time is the whole step (hooks + waiting for the streams).

#include <linux/perf_event.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
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

// Heap allocations of the calling thread: every form of the global operator new counts, so that
// Timed() can report the hooks' allocations (allocs). Deallocation is plain free().
namespace {
thread_local int64_t thread_allocs = 0;

void* CountedAlloc(std::size_t size, std::size_t alignment) {
  ++thread_allocs;
  if (size == 0) size = 1;
  if (alignment <= alignof(std::max_align_t)) return std::malloc(size);
  // aligned_alloc needs a size that is a multiple of the alignment.
  return std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
}
void* CountedAllocOrThrow(std::size_t size, std::size_t alignment) {
  void* p = CountedAlloc(size, alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return CountedAllocOrThrow(size, 0); }
void* operator new[](std::size_t size) { return CountedAllocOrThrow(size, 0); }
void* operator new(std::size_t size, std::align_val_t al) {
  return CountedAllocOrThrow(size, static_cast<std::size_t>(al));
}
void* operator new[](std::size_t size, std::align_val_t al) {
  return CountedAllocOrThrow(size, static_cast<std::size_t>(al));
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return CountedAlloc(size, 0);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return CountedAlloc(size, 0);
}
void* operator new(std::size_t size, std::align_val_t al, const std::nothrow_t&) noexcept {
  return CountedAlloc(size, static_cast<std::size_t>(al));
}
void* operator new[](std::size_t size, std::align_val_t al, const std::nothrow_t&) noexcept {
  return CountedAlloc(size, static_cast<std::size_t>(al));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

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

// SHARDLINE_HOOKS_BENCH_SYSCALLS=1: the calling thread's system calls, futex calls and context
// switches inside the hooks, counted by the kernel (perf_event_open on the raw_syscalls:sys_enter
// tracepoint: root or perf_event_paranoid <= 1, and tracefs). Reading the counters is itself a
// system call (one per hook, subtracted) and makes the CPU figures larger.
class SyscallCounters {
 public:
  struct Values {
    uint64_t syscalls = 0, futex = 0, switches = 0;
  };
  static SyscallCounters* ForThisThread() {
    const char* env = std::getenv("SHARDLINE_HOOKS_BENCH_SYSCALLS");
    if (env == nullptr || std::strcmp(env, "1") != 0) return nullptr;
    auto counters = std::make_unique<SyscallCounters>();
    if (!counters->Open()) return nullptr;
    return counters.release();
  }
  ~SyscallCounters() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  Values Read() const {
    // PERF_FORMAT_GROUP: {nr, value[nr]}.
    uint64_t buf[1 + 3] = {};
    Values v;
    if (read(fds_[0], buf, sizeof(buf)) != static_cast<ssize_t>(sizeof(buf))) return v;
    v.syscalls = buf[1];
    v.futex = buf[2];
    v.switches = buf[3];
    return v;
  }

 private:
  bool Open() {
    int id = -1;
    for (const char* path : {"/sys/kernel/tracing/events/raw_syscalls/sys_enter/id",
                             "/sys/kernel/debug/tracing/events/raw_syscalls/sys_enter/id"}) {
      std::ifstream in(path);
      if (in >> id) break;
    }
    if (id < 0) {
      std::fprintf(stderr, "SHARDLINE_HOOKS_BENCH_SYSCALLS: no raw_syscalls tracepoint\n");
      return false;
    }
    auto open = [&](uint32_t type, uint64_t config, int group) {
      perf_event_attr attr{};
      attr.size = sizeof(attr);
      attr.type = type;
      attr.config = config;
      attr.read_format = PERF_FORMAT_GROUP;
      return static_cast<int>(syscall(SYS_perf_event_open, &attr, 0, -1, group, 0));
    };
    fds_[0] = open(PERF_TYPE_TRACEPOINT, static_cast<uint64_t>(id), -1);
    if (fds_[0] >= 0) fds_[1] = open(PERF_TYPE_TRACEPOINT, static_cast<uint64_t>(id), fds_[0]);
    if (fds_[1] >= 0) {
      fds_[2] = open(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CONTEXT_SWITCHES, fds_[0]);
    }
    char filter[] = "id == 202";  // futex on x86-64
    if (fds_[2] < 0 || ioctl(fds_[1], PERF_EVENT_IOC_SET_FILTER, filter) != 0) {
      std::fprintf(stderr, "SHARDLINE_HOOKS_BENCH_SYSCALLS: perf_event_open failed: %s\n",
                   std::strerror(errno));
      return false;
    }
    return true;
  }
  int fds_[3] = {-1, -1, -1};
};

// The time spent inside the hooks: wall (`wall_ns`) and the calling thread's CPU (`cpu_ns`),
// what the thread asked of the host streams, and (SyscallCounters) its system calls.
struct HookTimes {
  int64_t wall_ns = 0;
  int64_t cpu_ns = 0;
  int64_t hooks = 0;
  int64_t allocs = 0;  // heap allocations of the calling thread inside the hooks
  HostStreamCallStats calls;
  SyscallCounters::Values sys;
  SyscallCounters* counters = nullptr;
};

void Accumulate(const HostStreamCallStats& before, const HostStreamCallStats& after,
                HostStreamCallStats* sum) {
  sum->submits += after.submits - before.submits;
  sum->records += after.records - before.records;
  sum->records_queued += after.records_queued - before.records_queued;
  sum->waits += after.waits - before.waits;
  sum->waits_queued += after.waits_queued - before.waits_queued;
  sum->wakes += after.wakes - before.wakes;
  sum->events += after.events - before.events;
  sum->records_shared += after.records_shared - before.records_shared;
}

// SHARDLINE_HOOKS_BENCH_CPU=0: no CPU-clock reads around the hooks (hook_cpu_ns_per_unit and
// timer_cpu_ns_per_unit are then 0), so the wall figure is taken without their system calls
// next to every hook. Default 1.
bool MeasureCpu() {
  static const bool measure = [] {
    const char* env = std::getenv("SHARDLINE_HOOKS_BENCH_CPU");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return measure;
}

// Times `hook` into `*times`.
template <typename Hook>
absl::Status Timed(HookTimes* times, Hook&& hook) {
  using Clock = std::chrono::steady_clock;
  // The CPU clock is a system call: read outside the wall-timed span.
  const bool cpu = MeasureCpu();
  const int64_t c0 = cpu ? ThreadCpuNs() : 0;
  const HostStreamCallStats calls0 = ThisThreadHostStreamCallStats();
  const int64_t allocs0 = thread_allocs;
  SyscallCounters::Values sys0;
  if (times->counters != nullptr) sys0 = times->counters->Read();
  const Clock::time_point t0 = Clock::now();
  const absl::Status status = hook();
  const Clock::time_point t1 = Clock::now();
  times->allocs += thread_allocs - allocs0;
  if (times->counters != nullptr) {
    const SyscallCounters::Values sys1 = times->counters->Read();
    times->sys.syscalls += sys1.syscalls - sys0.syscalls - 1;  // the read
    times->sys.futex += sys1.futex - sys0.futex;
    times->sys.switches += sys1.switches - sys0.switches;
  }
  Accumulate(calls0, ThisThreadHostStreamCallStats(), &times->calls);
  ++times->hooks;
  if (cpu) times->cpu_ns += ThreadCpuNs() - c0;
  times->wall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  return status;
}

// The CPU time that Timed() itself adds to hook_cpu_ns per hook: the part of its two CPU-clock
// reads (system calls) that falls inside the measured span, and its bookkeeping. Measured on an
// empty hook.
double TimerCpuNsPerHook() {
  HookTimes empty;
  constexpr int kCalls = 2000;
  for (int i = 0; i < kCalls; ++i) (void)Timed(&empty, [] { return absl::OkStatus(); });
  return static_cast<double>(empty.cpu_ns) / kCalls;
}

// One step; adds the time spent inside the hooks to `*times`.
absl::Status Step(Scheduler& s, Stream& compute, int units, HookTimes* times) {
  auto timed = [&](auto&& hook) { return Timed(times, hook); };
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
  // SHARDLINE_HOOKS_BENCH_UNTIMED=1: SchedulerOptions::time_communication off.
  const char* untimed = std::getenv("SHARDLINE_HOOKS_BENCH_UNTIMED");
  options.time_communication = untimed == nullptr || std::strcmp(untimed, "1") != 0;
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

  const double timer_cpu_ns_per_hook = TimerCpuNsPerHook();
  HookTimes times;
  std::unique_ptr<SyscallCounters> counters(SyscallCounters::ForThisThread());
  times.counters = counters.get();
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
  // What the hooks asked of the host streams, per unit per step.
  auto per_unit = [&](const char* name, double value) {
    state.counters[name] = benchmark::Counter(value / units, benchmark::Counter::kAvgIterations);
  };
  per_unit("submits", static_cast<double>(times.calls.submits));
  per_unit("records", static_cast<double>(times.calls.records));
  per_unit("records_queued", static_cast<double>(times.calls.records_queued));
  per_unit("waits", static_cast<double>(times.calls.waits));
  per_unit("waits_queued", static_cast<double>(times.calls.waits_queued));
  per_unit("wakes", static_cast<double>(times.calls.wakes));
  per_unit("events", static_cast<double>(times.calls.events));
  per_unit("records_shared", static_cast<double>(times.calls.records_shared));
  per_unit("hooks", static_cast<double>(times.hooks));
  per_unit("allocs", static_cast<double>(times.allocs));
  // The share of hook_cpu_ns_per_unit that is the benchmark's own timing (subtract it for the
  // scheduler's).
  per_unit("timer_cpu_ns_per_unit", timer_cpu_ns_per_hook * static_cast<double>(times.hooks));
  if (counters != nullptr) {
    per_unit("syscalls", static_cast<double>(times.sys.syscalls));
    per_unit("futex", static_cast<double>(times.sys.futex));
    per_unit("ctx_switches", static_cast<double>(times.sys.switches));
  }
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
