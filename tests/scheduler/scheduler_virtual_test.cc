// The Scheduler on virtual time (runtime/virtual_time.h) over the sim backend: every stream is a
// virtual stream, compute ops declare their duration, collectives take the sim cost model's time,
// no thread sleeps and no memory is touched (run_ops off). The schedulers are created from one
// thread per rank (creation splits communicators, a rendezvous); the hooks of all ranks are then
// called in lockstep from the test's thread, and the timeline runs once per step.
//   * a property test over a thousand random configurations (unit sizes, tied uses, forward
//     orders, prefetch depths and modes, byte and unit budgets at and above the minimum): the
//     bytes and units in flight never exceed the budget, no gather overshoots it, and no hook
//     ever blocks the host (the hooks never drive the timeline), deferred prefetches included;
//   * overlap, exactly: with prefetch the compute stream waits only for the first gather; without
//     it, for every gather.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/sim/sim_communicator.h"
#include "runtime/check.h"
#include "runtime/status.h"
#include "runtime/virtual_time.h"
#include "scheduler/scheduler.h"
#include "tests/scheduler/virtual_world.h"

namespace shardline {
namespace {

using ::shardline::testing::Compute;
using ::shardline::testing::MakeWorld;
using ::shardline::testing::World;

// One step of every rank in lockstep: forward over `uses`, backward in reverse. Returns whether
// any hook drove the timeline (blocked the host).
absl::StatusOr<bool> Step(World& w, const std::vector<int>& uses, absl::Duration forward,
                          absl::Duration backward) {
  const int64_t blocking = w.timeline->host_blocking_runs();
  const int ranks = static_cast<int>(w.schedulers.size());
  for (size_t k = 0; k < uses.size(); ++k) {
    for (int r = 0; r < ranks; ++r) {
      SL_RETURN_IF_ERROR(w.schedulers[r]->PreForward(uses[k]));
      SL_RETURN_IF_ERROR(Compute(*w.compute[r], forward, absl::StrCat("f", uses[k])));
      SL_RETURN_IF_ERROR(w.schedulers[r]->PostForward(uses[k]));
    }
  }
  for (size_t k = uses.size(); k-- > 0;) {
    for (int r = 0; r < ranks; ++r) {
      SL_RETURN_IF_ERROR(w.schedulers[r]->PreBackward(uses[k]));
      SL_RETURN_IF_ERROR(Compute(*w.compute[r], backward, absl::StrCat("b", uses[k])));
      SL_RETURN_IF_ERROR(w.schedulers[r]->PostBackward(uses[k]));
    }
  }
  for (int r = 0; r < ranks; ++r) SL_RETURN_IF_ERROR(w.schedulers[r]->FinishBackward());
  const bool blocked = w.timeline->host_blocking_runs() != blocking;
  SL_RETURN_IF_ERROR(w.timeline->RunUntilIdle());
  return blocked;
}

TEST(SchedulerVirtualTest, TheBudgetHoldsOnAThousandRandomConfigurations) {
  std::mt19937_64 rng(20261123);
  int deferred_total = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    std::uniform_int_distribution<int> units_dist(1, 9);
    const int units = units_dist(rng);
    const int ranks = 2;
    std::vector<std::vector<TensorSpec>> specs(units);
    for (int u = 0; u < units; ++u) {
      std::uniform_int_distribution<int64_t> numel(1, 5000);
      specs[u] = {{.name = "w", .shape = {numel(rng)}}, {.name = "b", .shape = {numel(rng) % 50}}};
    }
    // A random forward order, sometimes with a unit used twice (tied).
    std::vector<int> uses(units);
    for (int u = 0; u < units; ++u) uses[u] = u;
    std::shuffle(uses.begin(), uses.end(), rng);
    if (rng() % 3 == 0) uses.push_back(uses[rng() % units]);
    SchedulerOptions options;
    options.forward_prefetch = static_cast<int>(rng() % 4);
    options.backward_prefetch = static_cast<BackwardPrefetch>(rng() % 3);
    options.backward_prefetch_depth = 1 + static_cast<int>(rng() % 3);
    options.forward_order = uses;  // explicit: no cross-rank check (it would block once)
    options.root_unit = static_cast<int>(rng() % (units + 1)) - 1;
    // The units' minimum, then a random budget at or above it.
    absl::StatusOr<std::unique_ptr<World>> made = MakeWorld(ranks, options, 1e9);
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<World> w = *std::move(made);
    for (int r = 0; r < ranks; ++r) {
      for (int u = 0; u < units; ++u) {
        ASSERT_TRUE(w->schedulers[r]
                        ->RegisterUnit({.name = absl::StrCat("u", u), .tensors = specs[u]})
                        .ok());
      }
    }
    const uint64_t minimum = w->schedulers[0]->MinimumBudgetBytes();
    const int minimum_units = w->schedulers[0]->MinimumBudgetUnits();
    options.budget_bytes = minimum + rng() % (minimum * 2 + 1);
    options.budget_units = rng() % 2 == 0 ? 0 : minimum_units + static_cast<int>(rng() % 3);
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(w->schedulers[r]->SetBudget(options.budget_bytes, options.budget_units).ok());
      ASSERT_FALSE(w->schedulers[r]->SetBudget(minimum - 1, 0).ok());
    }
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<bool> blocked =
          Step(*w, uses, absl::Microseconds(rng() % 50), absl::Microseconds(rng() % 100));
      ASSERT_TRUE(blocked.ok()) << "trial " << trial << ": " << blocked.status();
      EXPECT_FALSE(*blocked) << "trial " << trial << ": a hook blocked the host";
      for (int r = 0; r < ranks; ++r) {
        auto m = w->schedulers[r]->LastStepMetrics(absl::InfiniteFuture());
        ASSERT_TRUE(m.ok()) << m.status();
        EXPECT_LE(m->peak_inflight_bytes, options.budget_bytes)
            << "trial " << trial << ": " << m->ToString();
        if (options.budget_units > 0) {
          EXPECT_LE(m->peak_inflight_units, options.budget_units) << "trial " << trial;
        }
        EXPECT_EQ(m->budget_overshoots, 0) << "trial " << trial << ": " << m->ToString();
        deferred_total += m->deferred_prefetches;
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  // The budgets were tight enough to defer prefetches (the property is not vacuous).
  EXPECT_GT(deferred_total, 100);
}

TEST(SchedulerVirtualTest, ExactIssueOrderPerPrefetchModeAndDepth) {
  // 5 units, u0 used again at the end (tied); every unit reshards after forward. The issue log of
  // the second step (the order is known) on both ranks.
  const std::vector<int> uses = {0, 1, 2, 3, 4, 0};
  struct Case {
    int forward;
    BackwardPrefetch backward;
    int depth;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {0, BackwardPrefetch::kOff, 1,
       "AG u0, AG u1, AG u2, AG u3, AG u4, AG u0, AG u0, AG u4, RS u4, AG u3, RS u3, AG u2, RS u2, "
       "AG u1, RS u1, AG u0, RS u0"},
      {1, BackwardPrefetch::kOff, 1,
       "AG u0, AG u1, AG u2, AG u3, AG u4, AG u0, AG u0, AG u4, RS u4, AG u3, RS u3, AG u2, RS u2, "
       "AG u1, RS u1, AG u0, RS u0"},
      {3, BackwardPrefetch::kBeforeGrad, 1,
       "AG u0, AG u1, AG u2, AG u3, AG u4, AG u0, AG u0, AG u4, AG u3, RS u4, AG u2, RS u3, AG u1, "
       "RS u2, AG u0, RS u1, RS u0"},
      // Depth 3 before the gradient: at u0's first backward use, u4, u3 and u2 are prefetched.
      {1, BackwardPrefetch::kBeforeGrad, 3,
       "AG u0, AG u1, AG u2, AG u3, AG u4, AG u0, AG u0, AG u4, AG u3, AG u2, AG u1, RS u4, AG u0, "
       "RS u3, RS u2, RS u1, RS u0"},
      // Depth 2 after the gradient: each prefetch follows the unit's backward, before its
      // reduction.
      {1, BackwardPrefetch::kAfterGrad, 2,
       "AG u0, AG u1, AG u2, AG u3, AG u4, AG u0, AG u0, AG u4, AG u3, AG u2, RS u4, AG u1, RS u3, "
       "AG u0, RS u2, RS u1, RS u0"},
  };
  for (const Case& c : cases) {
    SchedulerOptions options;
    options.forward_prefetch = c.forward;
    options.backward_prefetch = c.backward;
    options.backward_prefetch_depth = c.depth;
    options.forward_order = uses;
    options.root_unit = -1;
    absl::StatusOr<std::unique_ptr<World>> made = MakeWorld(2, options, 1e9);
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<World> w = *std::move(made);
    for (int r = 0; r < 2; ++r) {
      for (int u = 0; u < 5; ++u) {
        ASSERT_TRUE(w->schedulers[r]
                        ->RegisterUnit({.name = absl::StrCat("u", u),
                                        .tensors = {{.name = "w", .shape = {1000 + 7 * u}}}})
                        .ok());
      }
    }
    for (int step = 0; step < 2; ++step) {
      for (int r = 0; r < 2; ++r) w->schedulers[r]->ClearIssueLog();
      absl::StatusOr<bool> blocked =
          Step(*w, uses, absl::Microseconds(100), absl::Microseconds(200));
      ASSERT_TRUE(blocked.ok()) << blocked.status();
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(absl::StrJoin(w->schedulers[r]->issue_log(), ", "), c.expected)
          << "rank " << r << " forward " << c.forward << " backward "
          << BackwardPrefetchName(c.backward) << " depth " << c.depth;
    }
  }
}

TEST(SchedulerVirtualTest, PrefetchHidesEveryGatherButTheFirst) {
  // 4 units of 1 MiB on 2 ranks at 1 GB/s: an all-gather of a unit takes (n-1)(L + 512 KiB/B) =
  // 2 us + 524 us; forward compute 1 ms per unit, backward 2 ms: every prefetch fits under the
  // compute of the unit before it.
  std::vector<int> uses = {0, 1, 2, 3};
  auto run = [&](int prefetch, BackwardPrefetch backward) -> StepMetrics {
    SchedulerOptions options;
    options.forward_prefetch = prefetch;
    options.backward_prefetch = backward;
    options.forward_order = uses;
    options.root_unit = -1;
    absl::StatusOr<std::unique_ptr<World>> made = MakeWorld(2, options, 1e9);
    SL_CHECK(made.ok()) << made.status();
    std::unique_ptr<World> w = *std::move(made);
    for (int r = 0; r < 2; ++r) {
      for (int u = 0; u < 4; ++u) {
        SL_CHECK(w->schedulers[r]
                     ->RegisterUnit({.name = absl::StrCat("u", u),
                                     .tensors = {{.name = "w", .shape = {256 * 1024}}}})
                     .ok());
      }
    }
    absl::StatusOr<bool> blocked = Step(*w, uses, absl::Milliseconds(1), absl::Milliseconds(2));
    SL_CHECK(blocked.ok()) << blocked.status();
    SL_CHECK(!*blocked);
    auto m = w->schedulers[0]->LastStepMetrics(absl::InfiniteFuture());
    SL_CHECK(m.ok()) << m.status();
    return *m;
  };
  const double gather_us = 2 + 512.0 * 1024 / 1e9 * 1e6;  // one all-gather on the sim
  const StepMetrics on = run(1, BackwardPrefetch::kBeforeGrad);
  const StepMetrics off = run(0, BackwardPrefetch::kOff);
  ASSERT_TRUE(on.exposed_communication.has_value());
  ASSERT_TRUE(off.exposed_communication.has_value());
  // Prefetch: only the first gather (plus the cast into place, microseconds) is exposed.
  EXPECT_GE(absl::ToDoubleMicroseconds(*on.exposed_communication), gather_us);
  EXPECT_LE(absl::ToDoubleMicroseconds(*on.exposed_communication), gather_us + 50);
  // No prefetch: all 8 gathers (4 forward, 4 backward) are exposed.
  EXPECT_GE(absl::ToDoubleMicroseconds(*off.exposed_communication), 8 * gather_us);
  // And the step is shorter by the hidden gathers.
  ASSERT_TRUE(on.step_time.has_value() && off.step_time.has_value());
  EXPECT_LE(absl::ToDoubleMicroseconds(*off.step_time - *on.step_time), 7 * gather_us + 400);
  EXPECT_GE(absl::ToDoubleMicroseconds(*off.step_time - *on.step_time), 6 * gather_us);
}

TEST(SchedulerVirtualTest, UntimedCommunicationRunsTheSameStepAndLeavesItsTimesOut) {
  // SchedulerOptions::time_communication = false records no timing events: the same issue order
  // and, on virtual time, the same step; the communication times are absent, not zero.
  std::vector<int> uses = {0, 1, 2, 3, 1};
  struct Result {
    StepMetrics metrics;
    std::string issued;
  };
  auto run = [&](bool timed) -> Result {
    SchedulerOptions options;
    options.forward_order = uses;
    options.root_unit = -1;
    options.time_communication = timed;
    absl::StatusOr<std::unique_ptr<World>> made = MakeWorld(2, options, 1e9);
    SL_CHECK(made.ok()) << made.status();
    std::unique_ptr<World> w = *std::move(made);
    for (int r = 0; r < 2; ++r) {
      for (int u = 0; u < 4; ++u) {
        SL_CHECK(w->schedulers[r]
                     ->RegisterUnit({.name = absl::StrCat("u", u),
                                     .tensors = {{.name = "w", .shape = {77 * 1024 + u}}}})
                     .ok());
      }
    }
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<bool> blocked =
          Step(*w, uses, absl::Microseconds(300), absl::Microseconds(600));
      SL_CHECK(blocked.ok()) << blocked.status();
    }
    auto m = w->schedulers[0]->LastStepMetrics(absl::InfiniteFuture());
    SL_CHECK(m.ok()) << m.status();
    return {*m, absl::StrJoin(w->schedulers[0]->issue_log(), ", ")};
  };
  const Result timed = run(true);
  const Result untimed = run(false);
  EXPECT_EQ(untimed.issued, timed.issued);
  ASSERT_TRUE(timed.metrics.step_time.has_value() && untimed.metrics.step_time.has_value());
  EXPECT_EQ(*untimed.metrics.step_time, *timed.metrics.step_time);
  EXPECT_TRUE(timed.metrics.exposed_communication.has_value());
  EXPECT_TRUE(timed.metrics.communication_time.has_value());
  EXPECT_FALSE(untimed.metrics.exposed_communication.has_value());
  EXPECT_FALSE(untimed.metrics.communication_time.has_value());
  EXPECT_FALSE(untimed.metrics.overlap_fraction.has_value());
  EXPECT_EQ(untimed.metrics.bytes_gathered, timed.metrics.bytes_gathered);
  EXPECT_EQ(untimed.metrics.bytes_reduced, timed.metrics.bytes_reduced);
  EXPECT_EQ(untimed.metrics.peak_inflight_bytes, timed.metrics.peak_inflight_bytes);
  ASSERT_EQ(untimed.metrics.units.size(), 4u);
  for (int u = 0; u < 4; ++u) {
    EXPECT_TRUE(timed.metrics.units[u].exposed_wait.has_value()) << u;
    EXPECT_FALSE(untimed.metrics.units[u].exposed_wait.has_value()) << u;
    EXPECT_EQ(untimed.metrics.units[u].gathers, timed.metrics.units[u].gathers) << u;
    EXPECT_EQ(untimed.metrics.units[u].name, absl::StrCat("u", u));
  }
}

}  // namespace
}  // namespace shardline
