// File: scheduler/step_metrics.cc
// -----------------------------------------------------------------------------
// StepMetrics: FinishBackward records the step's counts and the events its times come from
// (RecordFinishedStep) and the hooks' host time (EndStepHookTime, with the hook timer of
// scheduler/internal/scheduler_internal.h); LastStepMetrics reads the times once the events
// completed. Also the issue log the tests read the scheduling decisions from.

#include "scheduler/scheduler.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/status.h"
#include "scheduler/internal/scheduler_internal.h"

namespace shardline {
namespace {

std::string Millis(const std::optional<absl::Duration>& d) {
  if (!d.has_value()) return "n/a";
  return absl::StrFormat("%.2f ms", absl::ToDoubleMilliseconds(*d));
}

std::optional<absl::Duration> Between(const std::shared_ptr<Event>& a,
                                      const std::shared_ptr<Event>& b) {
  if (a == nullptr || b == nullptr) return std::nullopt;
  absl::StatusOr<absl::Duration> d = ElapsedBetween(*a, *b);
  if (!d.ok()) return std::nullopt;
  return std::max(*d, absl::ZeroDuration());
}

}  // namespace

namespace scheduler_internal {

std::string FormatBytes(uint64_t bytes) {
  if (bytes >= (1ULL << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= (1ULL << 10)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

}  // namespace scheduler_internal

using scheduler_internal::FormatBytes;

std::string StepMetrics::ToString() const {
  std::string budget = budget_bytes == 0 ? "unlimited" : FormatBytes(budget_bytes);
  std::string out = absl::StrCat("step ", step, ": gathered ", FormatBytes(bytes_gathered),
                                 ", reduced ", FormatBytes(bytes_reduced), ", peak in flight ",
                                 FormatBytes(peak_inflight_bytes), " / ", budget, " (",
                                 peak_inflight_units, " units)");
  if (budget_overshoots > 0) absl::StrAppend(&out, ", ", budget_overshoots, " overshoots");
  absl::StrAppend(&out, ", exposed ", Millis(exposed_communication), " of step ",
                  Millis(step_time));
  if (overlap_fraction.has_value()) {
    absl::StrAppend(&out, absl::StrFormat(", overlap %.0f%%", *overlap_fraction * 100));
  }
  return out;
}

void Scheduler::RecordFinishedStep(std::shared_ptr<Event> end) {
  current_.accumulated_grad_bytes = 0;
  for (const Unit& unit : units_) {
    if (unit.param->has_unsharded_grad()) {
      current_.accumulated_grad_bytes += unit.backward_bytes - unit.param_bytes;
    }
  }
  current_.peak_inflight_bytes = budget_.peak_bytes();
  current_.peak_inflight_units = budget_.peak_units();
  current_.budget_overshoots = budget_.overshoots();
  current_.deferred_prefetches = budget_.deferrals();
  current_.gather_pool_peak_bytes = gather_pool_->stats().peak_bytes;
  current_.reduce_pool_peak_bytes = reduce_pool_->stats().peak_bytes;
  // The finished step replaces the one before in place: its vectors keep their capacity, and
  // the units' event-pair vectors trade places with the previous step's (emptied here).
  if (!finished_.has_value()) finished_.emplace();
  FinishedStep& finished = *finished_;
  std::vector<UnitStepMetrics> unit_metrics = std::move(finished.metrics.units);
  finished.metrics = current_;  // current_.units is always empty
  finished.metrics.units = std::move(unit_metrics);
  finished.metrics.units.resize(units_.size());
  finished.start = step_start_;
  finished.end = std::move(end);
  finished.computed = false;
  finished.waits.resize(units_.size());
  finished.comm.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    finished.metrics.units[u] = unit.metrics;
    finished.waits[u].swap(unit.waits);
    finished.comm[u].swap(unit.comm);
    unit.waits.clear();
    unit.comm.clear();
  }
}

void Scheduler::EndStepHookTime(const HookTimer& timer) {
  const absl::Duration elapsed = timer.elapsed();
  finished_->metrics.host_hook_time = hook_time_ + elapsed;
  finished_->metrics.hook_calls = hook_calls_ + 1;
  // This call belongs to the finished step: the timer's addition when it returns is offset.
  hook_time_ = -elapsed;
  hook_calls_ = -1;
}

absl::StatusOr<StepMetrics> Scheduler::LastStepMetrics(absl::Time deadline) {
  if (!finished_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("scheduler '", options_.name, "': LastStepMetrics() before any step ended"));
  }
  FinishedStep& f = *finished_;
  if (f.computed) return f.metrics;
  SL_RETURN_IF_ERROR(f.end->Synchronize(deadline));
  for (const auto& unit_comm : f.comm) {
    for (const auto& [start, done] : unit_comm) {
      if (done != nullptr) SL_RETURN_IF_ERROR(done->Synchronize(deadline));
    }
  }
  StepMetrics& m = f.metrics;
  m.step_time = Between(f.start, f.end);
  bool timed = m.step_time.has_value() && options_.time_communication;
  absl::Duration exposed, communication;
  for (size_t u = 0; u < f.waits.size(); ++u) {
    absl::Duration unit_exposed;
    for (const auto& [before, after] : f.waits[u]) {
      std::optional<absl::Duration> d = Between(before, after);
      if (!d.has_value()) timed = false;
      unit_exposed += d.value_or(absl::ZeroDuration());
    }
    if (timed) m.units[u].exposed_wait = unit_exposed;
    exposed += unit_exposed;
    for (const auto& [start, done] : f.comm[u]) {
      communication += Between(start, done).value_or(absl::ZeroDuration());
    }
  }
  if (timed) {
    m.exposed_communication = exposed;
    m.communication_time = communication;
    if (communication > absl::ZeroDuration()) {
      m.overlap_fraction = std::clamp(1.0 - absl::FDivDuration(exposed, communication), 0.0, 1.0);
    }
  }
  for (size_t u = 0; u < m.units.size(); ++u) m.units[u].name = units_[u].name;
  f.computed = true;
  // The events are no longer needed; the vectors' storage is, by the next step.
  for (std::vector<Unit::EventPair>& pairs : f.waits) pairs.clear();
  for (std::vector<Unit::EventPair>& pairs : f.comm) pairs.clear();
  return m;
}

std::vector<std::string> Scheduler::issue_log() const {
  std::vector<std::string> log;
  log.reserve(issue_log_.size());
  for (const IssueEntry& entry : issue_log_) {
    const std::string& name = units_[entry.unit].name;
    switch (entry.what) {
      case Issued::kGather:
        log.push_back(absl::StrCat("AG ", name));
        break;
      case Issued::kReduceScatter:
        log.push_back(absl::StrCat("RS ", name));
        break;
      case Issued::kAllReduce:
        log.push_back(absl::StrCat("AR ", name));
        break;
      case Issued::kAllReduceAccumulated:
        log.push_back(absl::StrCat("AR ", name, " (accumulated)"));
        break;
    }
  }
  return log;
}

}  // namespace shardline
