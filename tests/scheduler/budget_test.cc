// File: tests/scheduler/budget_test.cc
// The scheduler's rate limiter on its own (scheduler/budget.h): Fits, Charge and Discharge
// against a plain model of what each unit holds, over random sequences; the step's peaks and
// overshoots; a deferral counted once per position.

#include "scheduler/budget.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace shardline {
namespace {

TEST(InflightBudgetTest, FitsByBytesAndByUnits) {
  InflightBudget budget({.bytes = 1000, .units = 2});
  BudgetCharge a, b;
  EXPECT_TRUE(budget.Fits(1000, /*new_unit=*/true));
  EXPECT_FALSE(budget.Fits(1001, /*new_unit=*/true));
  budget.Charge(a, 300, 0);
  budget.Charge(b, 300, 0);
  EXPECT_EQ(budget.inflight_units(), 2);
  // Bytes fit, a third unit does not; more bytes for a unit already holding a charge do.
  EXPECT_FALSE(budget.Fits(100, /*new_unit=*/true));
  EXPECT_TRUE(budget.Fits(100, /*new_unit=*/false));
  EXPECT_FALSE(budget.Fits(401, /*new_unit=*/false));
  budget.SetLimits(0, 0);  // unlimited
  EXPECT_TRUE(budget.Fits(UINT64_C(1) << 40, /*new_unit=*/true));
}

TEST(InflightBudgetTest, AUnitHoldsFromItsFirstByteToItsLast) {
  InflightBudget budget({.bytes = 0, .units = 0});
  BudgetCharge unit;
  budget.Charge(unit, 0, 0);  // nothing charged: not holding
  EXPECT_EQ(budget.inflight_units(), 0);
  budget.Charge(unit, 64, 0);
  budget.Charge(unit, 0, 32);
  EXPECT_EQ(budget.inflight_units(), 1);
  EXPECT_EQ(budget.inflight_bytes(), 96u);
  budget.Discharge(unit, /*params=*/true, /*grad=*/false);  // the gradient still holds it
  EXPECT_EQ(budget.inflight_units(), 1);
  EXPECT_EQ(budget.inflight_bytes(), 32u);
  EXPECT_EQ(unit.params, 0u);
  budget.Discharge(unit, /*params=*/true, /*grad=*/false);  // nothing more to take
  EXPECT_EQ(budget.inflight_bytes(), 32u);
  budget.Discharge(unit, /*params=*/false, /*grad=*/true);
  EXPECT_EQ(budget.inflight_units(), 0);
  EXPECT_EQ(budget.inflight_bytes(), 0u);
  EXPECT_EQ(unit.total(), 0u);
}

// Random charges and discharges of 7 units, checked after every call against a model that sums
// what each unit holds; the peaks against the model's maxima since BeginStep.
TEST(InflightBudgetTest, RandomSequencesMatchAPlainModel) {
  constexpr int kUnits = 7;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 rng(seed);
    const uint64_t limit_bytes = 500 + rng() % 3000;
    const int limit_units = 1 + static_cast<int>(rng() % kUnits);
    InflightBudget budget({.bytes = limit_bytes, .units = limit_units});
    std::vector<BudgetCharge> held(kUnits);
    std::vector<uint64_t> params(kUnits, 0), grad(kUnits, 0);
    uint64_t peak_bytes = 0;
    int peak_units = 0;
    budget.BeginStep();
    for (int op = 0; op < 400; ++op) {
      const int u = static_cast<int>(rng() % kUnits);
      uint64_t model_bytes = 0;
      int model_units = 0;
      for (int i = 0; i < kUnits; ++i) {
        model_bytes += params[i] + grad[i];
        model_units += (params[i] + grad[i]) > 0;
      }
      if (rng() % 2 == 0) {
        const uint64_t p = rng() % 3 == 0 ? 0 : 1 + rng() % 400;
        const uint64_t g = rng() % 2 == 0 ? 0 : 1 + rng() % 400;
        const bool is_new = params[u] + grad[u] == 0;
        const bool model_fits =
            model_bytes + p + g <= limit_bytes && (!is_new || model_units + 1 <= limit_units);
        ASSERT_EQ(budget.Fits(p + g, is_new), model_fits) << "seed " << seed << " op " << op;
        budget.Charge(held[u], p, g);
        params[u] += p;
        grad[u] += g;
      } else {
        const bool take_params = rng() % 2 == 0, take_grad = rng() % 2 == 0;
        budget.Discharge(held[u], take_params, take_grad);
        if (take_params) params[u] = 0;
        if (take_grad) grad[u] = 0;
      }
      model_bytes = 0;
      model_units = 0;
      for (int i = 0; i < kUnits; ++i) {
        ASSERT_EQ(held[i].params, params[i]) << "seed " << seed << " op " << op;
        ASSERT_EQ(held[i].grad, grad[i]) << "seed " << seed << " op " << op;
        model_bytes += params[i] + grad[i];
        model_units += (params[i] + grad[i]) > 0;
      }
      peak_bytes = std::max(peak_bytes, model_bytes);
      peak_units = std::max(peak_units, model_units);
      ASSERT_EQ(budget.inflight_bytes(), model_bytes) << "seed " << seed << " op " << op;
      ASSERT_EQ(budget.inflight_units(), model_units) << "seed " << seed << " op " << op;
    }
    EXPECT_EQ(budget.peak_bytes(), peak_bytes) << "seed " << seed;
    EXPECT_EQ(budget.peak_units(), peak_units) << "seed " << seed;
  }
}

TEST(InflightBudgetTest, AStepStartsFromWhatIsStillCharged) {
  InflightBudget budget({.bytes = 100, .units = 0});
  BudgetCharge kept, other;
  budget.Charge(kept, 40, 0);
  budget.Charge(other, 50, 0);
  budget.CountOvershoot();
  budget.Discharge(other, true, true);
  EXPECT_EQ(budget.peak_bytes(), 90u);
  EXPECT_EQ(budget.overshoots(), 1);
  budget.BeginStep();
  EXPECT_EQ(budget.peak_bytes(), 40u);  // the unit kept from the step before
  EXPECT_EQ(budget.peak_units(), 1);
  EXPECT_EQ(budget.overshoots(), 0);
}

TEST(InflightBudgetTest, APositionDeferredAgainIsCountedOnce) {
  InflightBudget budget({.bytes = 10, .units = 0});
  budget.BeginStep();
  budget.Defer(InflightBudget::Cursor::kForward, 3);
  budget.Defer(InflightBudget::Cursor::kForward, 3);   // the same prefetch, at the next hook
  budget.Defer(InflightBudget::Cursor::kBackward, 3);  // the other cursor counts apart
  budget.Defer(InflightBudget::Cursor::kForward, 4);
  EXPECT_EQ(budget.deferrals(), 3);
  budget.BeginStep();
  budget.Defer(InflightBudget::Cursor::kForward, 4);  // a new step counts it again
  EXPECT_EQ(budget.deferrals(), 1);
}

}  // namespace
}  // namespace shardline
