// File: scheduler/internal/scheduler_internal.h
// -----------------------------------------------------------------------------
// Internal to the Scheduler's sources (scheduler.cc: the hooks and their cursors;
// scheduler_setup.cc: creation, registration, the minimum budget; order_check.cc; clip_grad.cc;
// step_metrics.cc): what more than one of them needs. Not part of the public API (not installed).

#ifndef SHARDLINE_SCHEDULER_INTERNAL_SCHEDULER_INTERNAL_H_
#define SHARDLINE_SCHEDULER_INTERNAL_SCHEDULER_INTERNAL_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "runtime/stream.h"
#include "scheduler/scheduler.h"

namespace shardline {

// Times a hook, and holds back the wake-ups of the host streams' workers that the hook gives
// work to until it returns (HostStreamWakeBatch): one wake-up per stream per hook at most,
// instead of one per burst of submissions while the workers keep draining and falling asleep.
// Adds the wall time of the call to the step's host time (FinishBackward's call counts in the
// step it ends: EndStepHookTime).
class Scheduler::HookTimer {
 public:
  // steady_clock: a vDSO read, cheaper than absl::Now() (two per hook call).
  explicit HookTimer(Scheduler* s) : s_(s), start_(std::chrono::steady_clock::now()) {}
  ~HookTimer() {
    wakes_.End();  // inside the timed span: the wake-ups are the hook's cost
    s_->hook_time_ += elapsed();
    ++s_->hook_calls_;
  }
  absl::Duration elapsed() const {
    return absl::FromChrono(std::chrono::steady_clock::now() - start_);
  }

 private:
  Scheduler* s_;
  std::chrono::steady_clock::time_point start_;
  HostStreamWakeBatch wakes_;
};

namespace scheduler_internal {

// The unit as every collective the scheduler issues for it names it (CollectiveOptions::key):
// ranks that issue the same collective for different units fail it before any data moves.
inline uint64_t UnitKey(int unit) { return static_cast<uint64_t>(unit) + 1; }

// "512 B", "1.5 KiB", "12.0 MiB": sizes in messages and StepMetrics::ToString.
std::string FormatBytes(uint64_t bytes);

}  // namespace scheduler_internal
}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_INTERNAL_SCHEDULER_INTERNAL_H_
