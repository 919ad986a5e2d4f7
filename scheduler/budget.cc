// File: scheduler/budget.cc
// -----------------------------------------------------------------------------
// The budget's accounting. A unit counts against budget_units from its first charged byte to its
// last discharged one, whatever mix of parameters and gradient it holds in between.

#include "scheduler/budget.h"

#include <algorithm>
#include <utility>

namespace shardline {

InflightBudget::InflightBudget(InflightBudgetOptions options) : options_(std::move(options)) {}

void InflightBudget::SetLimits(size_t bytes, int units) {
  options_.bytes = bytes;
  options_.units = units;
}

bool InflightBudget::Fits(uint64_t bytes, bool new_unit) const {
  if (options_.bytes > 0 && inflight_bytes_ + bytes > options_.bytes) return false;
  if (options_.units > 0 && new_unit && inflight_units_ + 1 > options_.units) return false;
  return true;
}

void InflightBudget::Charge(BudgetCharge& held, uint64_t params, uint64_t grad) {
  const uint64_t bytes = params + grad;
  if (bytes == 0) return;
  if (held.total() == 0) ++inflight_units_;
  held.params += params;
  held.grad += grad;
  inflight_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, inflight_bytes_);
  peak_units_ = std::max(peak_units_, inflight_units_);
  TraceCounter();
}

void InflightBudget::Discharge(BudgetCharge& held, bool params, bool grad) {
  const uint64_t bytes = (params ? held.params : 0) + (grad ? held.grad : 0);
  if (bytes == 0) return;
  if (params) held.params = 0;
  if (grad) held.grad = 0;
  inflight_bytes_ -= bytes;
  if (held.total() == 0) --inflight_units_;
  TraceCounter();
}

void InflightBudget::BeginStep() {
  peak_bytes_ = inflight_bytes_;
  peak_units_ = inflight_units_;
  overshoots_ = 0;
  deferrals_ = 0;
  deferred_forward_ = deferred_backward_ = SIZE_MAX;
}

void InflightBudget::Defer(Cursor cursor, size_t position) {
  size_t& last = cursor == Cursor::kForward ? deferred_forward_ : deferred_backward_;
  if (last != position) ++deferrals_;
  last = position;
}

void InflightBudget::TraceCounter() {
  if (options_.trace == nullptr) return;
  options_.trace->AddCounter(options_.counter, options_.clock->Now(),
                             {{"bytes", static_cast<double>(inflight_bytes_)},
                              {"budget", static_cast<double>(options_.bytes)}});
}

}  // namespace shardline
