// File: scheduler/budget.h
// -----------------------------------------------------------------------------
// InflightBudget: the rate limiter of the scheduler's gathers and reductions in flight (FSDP's
// limit_all_gathers, by bytes and by units). It caps the memory that issued gathers hold (the
// unsharded parameters, and in backward the unsharded gradient and its reduce-dtype copies) from
// the gather's issue until the unit reshards or its reduction is issued. The scheduler
// (scheduler.h, "The budget") charges a unit's footprint when it issues the gather and takes it
// off at the reshard or the reduction, on the host and at issue time, so every decision depends
// only on the sequence of hook calls (never on clocks or completions) and ranks that see the same
// hooks decide the same. A prefetch is issued only if it Fits; a gather the compute needs now is
// issued anyway and counted as an overshoot.
//
//   InflightBudget budget({.bytes = 64 << 20, .units = 4});
//   BudgetCharge held;  // one per unit
//   if (budget.Fits(params, /*new_unit=*/held.total() == 0)) budget.Charge(held, params, 0);
//   ...
//   budget.Discharge(held, /*params=*/true, /*grad=*/true);
//
// Per step it keeps what StepMetrics report of it: the peaks in flight, the overshoots and the
// deferred prefetches. Not thread-safe: the scheduler's hooks run one at a time.

#ifndef SHARDLINE_SCHEDULER_BUDGET_H_
#define SHARDLINE_SCHEDULER_BUDGET_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/clock.h"
#include "runtime/trace.h"

namespace shardline {

// What one unit holds of the budget, in bytes.
struct BudgetCharge {
  uint64_t params = 0;  // the unsharded parameters (and, with CPU offload, the staging shard)
  uint64_t grad = 0;    // the unsharded gradient (+ its reduce_dtype copies)
  uint64_t total() const { return params + grad; }
};

struct InflightBudgetOptions {
  size_t bytes = 0;  // the limit in bytes; 0: unlimited
  int units = 0;     // the limit in units holding a charge; 0: unlimited
  // A Chrome-trace counter `counter` ({bytes, budget}) at every change, timed on `clock`. Null
  // trace: none. The writer and the clock must outlive the budget.
  TraceWriter* trace = nullptr;
  std::string counter;
  const Clock* clock = nullptr;
};

class InflightBudget {
 public:
  // The prefetch cursors whose deferrals are counted apart (each position once).
  enum class Cursor : uint8_t { kForward, kBackward };

  explicit InflightBudget(InflightBudgetOptions options);

  InflightBudget(const InflightBudget&) = delete;
  InflightBudget& operator=(const InflightBudget&) = delete;

  // Changes the limits (0: unlimited); what is charged stays charged.
  void SetLimits(size_t bytes, int units);
  size_t limit_bytes() const { return options_.bytes; }
  int limit_units() const { return options_.units; }

  // Whether `bytes` more fit, and one unit more if `new_unit` (a unit that holds no charge yet).
  bool Fits(uint64_t bytes, bool new_unit) const;
  // Adds `params` and `grad` bytes to what `held` holds (a unit starts holding at its first
  // non-zero charge). Always succeeds: whether it fit was the caller's decision (Fits).
  void Charge(BudgetCharge& held, uint64_t params, uint64_t grad);
  // Takes `held`'s parameter and/or gradient charge off the budget (the unit stops holding when
  // nothing is left).
  void Discharge(BudgetCharge& held, bool params, bool grad);

  // What is charged now.
  uint64_t inflight_bytes() const { return inflight_bytes_; }
  int inflight_units() const { return inflight_units_; }

  // --- The step's accounting --------------------------------------------------------------------
  // Starts a step: the peaks start from what is charged now (units kept from the step before),
  // the counts from zero, and no position is deferred.
  void BeginStep();
  // A gather the compute needed now was issued although it did not fit.
  void CountOvershoot() { ++overshoots_; }
  // The prefetch at `position` of `cursor` did not fit and waits for a later hook; a position
  // deferred again at the next hooks is counted once.
  void Defer(Cursor cursor, size_t position);
  uint64_t peak_bytes() const { return peak_bytes_; }
  int peak_units() const { return peak_units_; }
  int overshoots() const { return overshoots_; }
  int deferrals() const { return deferrals_; }

 private:
  void TraceCounter();

  InflightBudgetOptions options_;
  uint64_t inflight_bytes_ = 0;
  int inflight_units_ = 0;
  uint64_t peak_bytes_ = 0;
  int peak_units_ = 0;
  int overshoots_ = 0;
  int deferrals_ = 0;
  // The cursor positions whose prefetch was last deferred (a deferral is counted once).
  size_t deferred_forward_ = SIZE_MAX;
  size_t deferred_backward_ = SIZE_MAX;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_BUDGET_H_
