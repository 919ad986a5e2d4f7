// File: runtime/clock.h
// -----------------------------------------------------------------------------
// Time as a property of a stream. Every Stream has a Clock (Stream::clock()), and every deadline
// that concerns a stream's work — a stream's wait_timeout, a collective's timeout, an event's
// Synchronize(deadline) — is a time on that clock:
//
//   WallClock()   the system's real-time clock (WallNow()); host and CUDA streams use it.
//   ManualClock   a clock that only moves when its owner calls Advance() or Set(): the test double
//                 of a virtual clock. Waits bounded by a ManualClock deadline end when the clock
//                 is advanced past it, however long that takes in wall time.
//
// A wait on a clock is a condition-variable wait whose timeout is a time on that clock:
// Clock::WaitUntil. Code that waits for stream work calls it instead of cv.wait_until, so that
// the same code serves wall-clock and virtual-clock streams.
//
// Streams that wait on one another should share a clock: a deadline is read on the clock of the
// thing being waited for (an event's capture, a stream's queue).
//
// Thread safety: every method may be called from any thread.

#ifndef SHARDLINE_RUNTIME_CLOCK_H_
#define SHARDLINE_RUNTIME_CLOCK_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/time/time.h"

namespace shardline {

class Clock {
 public:
  virtual ~Clock() = default;

  // The current time on this clock.
  virtual absl::Time Now() const = 0;

  // With `lock` (a lock on the mutex that guards `done`) held: waits on `cv` until `done()` is
  // true or this clock reaches `deadline`. Returns done(). `cv` must be notified whenever `done`
  // may have become true. absl::InfiniteFuture() waits for `done` only. The clocks here first
  // wake the host-stream workers that the thread's HostStreamWakeBatch holds back
  // (runtime/stream.h), so a thread never blocks on work it held back; to do so they may release
  // `lock` for a moment, as the wait itself does, before they check `done`.
  virtual bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         absl::Time deadline, absl::FunctionRef<bool()> done) const = 0;

  // "wall", "manual"... for messages.
  virtual std::string name() const = 0;
};

// The system's real-time clock, read directly (clock_gettime(CLOCK_REALTIME), a vDSO call): the
// time absl::Now() tells, at a quarter of its cost on the VMs here (abseil interpolates a cycle
// counter between resynchronizations). Streams stamp every item they finish with it.
absl::Time WallNow();
// The same in nanoseconds since the Unix epoch.
int64_t WallNowNanos();

// The process's wall clock (WallNow()).
const Clock& WallClock();

// A clock that moves only when told to. Starts at `start`.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch()) : now_(start) {}

  absl::Time Now() const override;
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline, absl::FunctionRef<bool()> done) const override;
  std::string name() const override { return "manual"; }

  // Moves the clock forward by `d` (>= 0) and wakes every wait whose deadline has passed.
  void Advance(absl::Duration d);
  // Moves the clock to max(now, t).
  void Set(absl::Time t);

  // How many threads are blocked in WaitUntil with a finite deadline (for tests that advance the
  // clock once a waiter is known to be waiting).
  int waiters() const;

 private:
  mutable std::mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::condition_variable*> waiting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CLOCK_H_
