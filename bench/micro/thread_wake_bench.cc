// The machine's floor under the scheduler's hooks (bench/micro/scheduler_hooks_bench.cc): what
// the thread that hands work to a host stream pays per wake-up of a sleeping worker, and per
// cache line that moves between two threads. On a virtual machine a wake-up of a thread whose
// vCPU is halted is an inter-processor interrupt and a VM exit; scheduler_hooks_bench's `wakes`
// counter times this figure is the part of its hook time that no user-space change can remove
// (short of never letting the workers sleep).
//
//   thread_wake_bench
//
// BM_NotifySleepingThread   condition_variable::notify_one of a thread asleep in wait(), timed
//                           on the notifying thread (the futex wake system call)
// BM_SubmitToSleepingWorker Stream::Submit of a no-op to a host stream whose worker sleeps,
//                           outside any HostStreamWakeBatch: the push and the wake-up
// BM_SubmitToBusyWorker     the same while the worker is held busy: the push alone
// BM_CacheLineHandOff       one atomic written alternately by two threads: per hand-off
//
// Each iteration's time is measured by hand (UseManualTime) around the call alone; the pauses
// that let the worker fall asleep (or get it busy) are not timed.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "runtime/check.h"
#include "runtime/stream.h"

namespace shardline {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// Long enough for a woken thread to finish its turn and go back to sleep.
constexpr auto kSettle = std::chrono::microseconds(300);

void BM_NotifySleepingThread(benchmark::State& state) {
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  bool asleep = false;
  bool stop = false;
  std::thread sleeper([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      asleep = true;
      cv.wait(lock, [&] { return go || stop; });
      asleep = false;
      go = false;
    }
  });
  for (auto _ : state) {
    while (true) {
      std::this_thread::sleep_for(kSettle);
      std::lock_guard<std::mutex> lock(mu);
      if (asleep) {
        go = true;
        break;
      }
    }
    const Clock::time_point t0 = Clock::now();
    cv.notify_one();
    state.SetIterationTime(Seconds(t0, Clock::now()));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  sleeper.join();
}

absl::Status NoOp() { return absl::OkStatus(); }

void BM_SubmitToSleepingWorker(benchmark::State& state) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "sleeping"});
  SL_CHECK(stream.ok()) << stream.status();
  for (auto _ : state) {
    // The worker ran everything and (no spin on a small machine, a short one otherwise) sleeps.
    SL_CHECK_OK((*stream)->Synchronize(absl::Now() + absl::Seconds(10)));
    std::this_thread::sleep_for(kSettle);
    const Clock::time_point t0 = Clock::now();
    SL_CHECK_OK((*stream)->Enqueue(NoOp));
    state.SetIterationTime(Seconds(t0, Clock::now()));
  }
}

void BM_SubmitToBusyWorker(benchmark::State& state) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "busy"});
  SL_CHECK(stream.ok()) << stream.status();
  std::atomic<bool> release{false};
  for (auto _ : state) {
    SL_CHECK_OK((*stream)->Synchronize(absl::Now() + absl::Seconds(10)));
    release = false;
    SL_CHECK_OK((*stream)->Enqueue([&release] {
      while (!release.load(std::memory_order_acquire)) std::this_thread::yield();
      return absl::OkStatus();
    }));
    const Clock::time_point t0 = Clock::now();
    SL_CHECK_OK((*stream)->Enqueue(NoOp));
    state.SetIterationTime(Seconds(t0, Clock::now()));
    release = true;
  }
  SL_CHECK_OK((*stream)->Synchronize(absl::Now() + absl::Seconds(10)));
}

void BM_CacheLineHandOff(benchmark::State& state) {
  std::atomic<int> flag{0};
  std::atomic<bool> done{false};
  std::thread pong([&] {
    while (!done.load(std::memory_order_relaxed)) {
      const int v = flag.load(std::memory_order_acquire);
      if (v & 1) flag.store(v + 1, std::memory_order_release);
    }
  });
  constexpr int kRounds = 1000;
  for (auto _ : state) {
    const Clock::time_point t0 = Clock::now();
    for (int i = 0; i < kRounds; ++i) {
      const int v = flag.load(std::memory_order_relaxed);
      flag.store(v + 1, std::memory_order_release);
      while (flag.load(std::memory_order_acquire) == v + 1) {
      }
    }
    state.SetIterationTime(Seconds(t0, Clock::now()) / (2 * kRounds));
  }
  done = true;
  pong.join();
}

BENCHMARK(BM_NotifySleepingThread)->UseManualTime()->Unit(benchmark::kNanosecond)->Iterations(500);
BENCHMARK(BM_SubmitToSleepingWorker)
    ->UseManualTime()
    ->Unit(benchmark::kNanosecond)
    ->Iterations(500);
BENCHMARK(BM_SubmitToBusyWorker)->UseManualTime()->Unit(benchmark::kNanosecond)->Iterations(500);
BENCHMARK(BM_CacheLineHandOff)->UseManualTime()->Unit(benchmark::kNanosecond)->Iterations(50);

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
