// The scheduler's written promises, checked on random configurations (seeded: a failure prints
// its seed; scripts/run-long-tests.sh runs more seeds than CI does), on virtual time over the sim
// backend: every stream is a virtual stream, no thread sleeps and no memory is touched, so
// hundreds of configurations run in seconds. The hooks of all ranks are called in lockstep from
// the test's thread; the timeline runs once per micro-batch.
//
// A configuration draws: 2-8 ranks; a strategy (full shard, shard-grad-op, no-shard, hybrid with
// a shard size that divides the world); 3-24 units of odd shapes, each with its own precision
// (f32 / bf16 / f16 parameters and reductions, f32 or low-precision sharded gradients) and
// reshard-after-forward choice; a forward order with units used twice; forward prefetch depth
// 0-4, every backward prefetch mode at depth 0-4; a root unit or none; 1-3 micro-batches per
// step with sync, no_sync, no_sync + parameters kept after backward (SetReshardAfterBackward) or
// hybrid's deferred all-reduce; a budget in bytes and/or units at the exact minimum or above it.
//
// The promises (scheduler/scheduler.h, docs/scheduler.md) and the checks that cover them:
//
//   promise                                                      check
//   ----------------------------------------------------------   ------------------------------
//   bytes in flight never exceed budget_bytes                    peak_inflight_bytes <= budget
//   unsharded units in flight never exceed budget_units          peak_inflight_units <= units
//   a prefetch is issued only if it fits (bytes and count),      budget_overshoots == 0 on the
//   in every accumulation mode; demanded gathers overshoot        known order (every case here)
//   only off the known order, on a skipped backward or below
//   the minimum
//   MinimumBudgetBytes/Units suffice (kept units, units used     the budget is set AT the
//   twice, SetReshardAfterBackward(false) included)              minimum in a third of the cases
//   SetBudget refuses less than the minimum                      SetBudget(minimum - 1) fails
//   SetReshardAfterBackward(false) refuses a budget it breaks    refused below the new minimum
//   the hooks never block the host (deferrals included)          no hook drove the timeline
//   every rank issues the same collectives in the same order     the issue logs of all ranks
//                                                                are equal (and the sim checks
//                                                                every fingerprint, unit key
//                                                                included)
//   a gradient kept across micro-batches is reported             accumulated_grad_bytes > 0
//                                                                after a no_sync micro-batch
//   destroying a scheduler mid-step never aborts or hangs        a third of the cases end with
//                                                                the world destroyed mid-step
//
// Exact data, reductions, a rank that swaps units, sticky errors and destruction on real threads
// are in scheduler_test.cc (SchedulerPropertyTest, the toy model against an unsharded reference)
// and scheduler_teardown_test.cc.
#include <gtest/gtest.h>

#include <cstdlib>
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
#include "tests/common/sanitizers.h"
#include "tests/common/status_and_hash.h"
#include "tests/scheduler/virtual_world.h"

namespace shardline {
namespace {

using ::shardline::testing::Compute;
using ::shardline::testing::MakeWorld;
using ::shardline::testing::World;

enum class Accumulation { kSync, kNoSync, kNoSyncKeep, kDeferAllReduce };
const char* AccumulationName(Accumulation a) {
  switch (a) {
    case Accumulation::kSync:
      return "sync";
    case Accumulation::kNoSync:
      return "no_sync";
    case Accumulation::kNoSyncKeep:
      return "no_sync+keep";
    case Accumulation::kDeferAllReduce:
      return "defer_all_reduce";
  }
  return "?";
}

struct Config {
  uint64_t seed = 0;
  int ranks = 2;
  SchedulerOptions options;
  std::vector<UnitSpec> units;
  std::vector<int> uses;
  int micro = 1;
  Accumulation accumulation = Accumulation::kSync;
  bool budget_bytes = true;   // a byte budget
  bool budget_units = false;  // a unit budget
  uint64_t bytes_above = 0;   // over the minimum
  int units_above = 0;
  int teardown_after = -1;  // >= 0: destroy the world after this many hooks of the last step

  std::string ToString() const {
    std::string units_text;
    for (const UnitSpec& u : units) {
      absl::StrAppend(&units_text, u.name, "[", u.tensors.size(), " tensors, ",
                      u.policy.precision.ToString(),
                      u.policy.reshard_after_forward.has_value()
                          ? (*u.policy.reshard_after_forward ? ", raf" : ", keep")
                          : "",
                      "] ");
    }
    return absl::StrCat(
        "seed ", seed, ": ", ranks, " ranks, ", ShardingStrategyName(options.strategy), " shard ",
        options.shard_size, ", forward prefetch ", options.forward_prefetch, ", backward ",
        BackwardPrefetchName(options.backward_prefetch), " depth ", options.backward_prefetch_depth,
        ", root ", options.root_unit, ", uses [", absl::StrJoin(uses, ","), "], ", micro,
        " micro-batches ", AccumulationName(accumulation), ", budget ",
        budget_bytes ? absl::StrCat("minimum+", bytes_above, " B") : "no bytes",
        budget_units ? absl::StrCat(", minimum+", units_above, " units") : "",
        teardown_after >= 0 ? absl::StrCat(", torn down after ", teardown_after) : "", "; units ",
        units_text);
  }
};

DType PickFloat(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      return DType::kBF16;
    case 1:
      return DType::kF16;
    default:
      return DType::kF32;
  }
}

Config Draw(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Config c;
  c.seed = seed;
  c.ranks = 2 + static_cast<int>(rng() % 7);
  switch (rng() % 5) {
    case 0:
      c.options.strategy = ShardingStrategy::kShardGradOp;
      break;
    case 1:
      c.options.strategy = ShardingStrategy::kNoShard;
      break;
    case 2: {
      std::vector<int> divisors;
      for (int d = 1; d <= c.ranks; ++d) {
        if (c.ranks % d == 0) divisors.push_back(d);
      }
      c.options.strategy = ShardingStrategy::kHybridShard;
      c.options.shard_size = divisors[rng() % divisors.size()];
      break;
    }
    default:
      c.options.strategy = ShardingStrategy::kFullShard;
  }
  const int units = 3 + static_cast<int>(rng() % 22);
  for (int u = 0; u < units; ++u) {
    UnitSpec spec;
    spec.name = absl::StrCat("u", u);
    const int tensors = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < tensors; ++t) {
      // Odd shapes: 1-D and 2-D, from one element to a few thousand.
      if (rng() % 2 == 0) {
        spec.tensors.push_back(
            {.name = absl::StrCat("t", t), .shape = {1 + static_cast<int64_t>(rng() % 3001)}});
      } else {
        spec.tensors.push_back({.name = absl::StrCat("t", t),
                                .shape = {1 + static_cast<int64_t>(rng() % 37),
                                          1 + static_cast<int64_t>(rng() % 61)}});
      }
    }
    if (rng() % 2 == 0) {
      spec.policy.precision.param_dtype = PickFloat(rng);
      spec.policy.precision.reduce_dtype = PickFloat(rng);
      spec.policy.precision.keep_low_precision_grads = rng() % 4 == 0;
    }
    if (rng() % 4 == 0) spec.policy.reshard_after_forward = rng() % 2 == 0;
    c.units.push_back(std::move(spec));
  }
  for (int u = 0; u < units; ++u) c.uses.push_back(u);
  std::shuffle(c.uses.begin(), c.uses.end(), rng);
  // Units used twice (a tied embedding, a shared block), sometimes back to back.
  for (int ties = static_cast<int>(rng() % 3); ties > 0; --ties) {
    const int u = c.uses[rng() % c.uses.size()];
    c.uses.insert(c.uses.begin() + static_cast<std::ptrdiff_t>(rng() % (c.uses.size() + 1)), u);
  }
  c.options.forward_prefetch = static_cast<int>(rng() % 5);
  c.options.backward_prefetch = static_cast<BackwardPrefetch>(rng() % 3);
  c.options.backward_prefetch_depth = static_cast<int>(rng() % 5);
  c.options.root_unit = static_cast<int>(rng() % (units + 1)) - 1;
  c.options.forward_order = c.uses;  // explicit: the minimum counts units used twice from start
  c.micro = 1 + static_cast<int>(rng() % 3);
  const int modes = c.options.strategy == ShardingStrategy::kHybridShard ? 4 : 3;
  c.accumulation = static_cast<Accumulation>(rng() % modes);
  switch (rng() % 3) {
    case 0:
      c.budget_bytes = true;
      c.budget_units = false;
      break;
    case 1:
      c.budget_bytes = false;
      c.budget_units = true;
      break;
    default:
      c.budget_bytes = c.budget_units = true;
  }
  // At the exact minimum a third of the time.
  if (rng() % 3 != 0) {
    c.bytes_above = rng() % 20000;
    c.units_above = static_cast<int>(rng() % 3);
  }
  if (rng() % 3 == 0) {
    c.teardown_after = static_cast<int>(rng() % (2 * c.uses.size() + 2));
  }
  return c;
}

// Runs one configuration; ADD_FAILUREs name the seed.
void RunConfig(const Config& c) {
  SCOPED_TRACE(c.ToString());
  absl::StatusOr<std::unique_ptr<World>> made = MakeWorld(c.ranks, c.options, /*bytes_per_s=*/5e9);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<World> w = *std::move(made);
  const int n = c.ranks;
  for (int r = 0; r < n; ++r) {
    for (const UnitSpec& spec : c.units) {
      UnitSpec copy;
      copy.name = spec.name;
      copy.tensors = spec.tensors;
      copy.policy = spec.policy;
      absl::StatusOr<int> id = w->schedulers[r]->RegisterUnit(std::move(copy));
      ASSERT_TRUE(id.ok()) << id.status();
    }
  }
  Scheduler& first = *w->schedulers[0];
  const bool keep = c.accumulation == Accumulation::kNoSyncKeep && c.micro > 1;
  if (keep) {
    // Parameters kept after backward are charged into the next micro-batch: the minimum with
    // them counted. Setting it below that minimum first is refused.
    for (int r = 0; r < n; ++r) {
      for (int u = 0; u < w->schedulers[r]->num_units(); ++u) {
        ASSERT_TRUE(w->schedulers[r]->SetReshardAfterBackward(u, false).ok());
      }
    }
  }
  const uint64_t minimum = first.MinimumBudgetBytes();
  const int minimum_units = first.MinimumBudgetUnits();
  const size_t budget = c.budget_bytes ? minimum + c.bytes_above : 0;
  const int budget_units = c.budget_units ? minimum_units + c.units_above : 0;
  for (int r = 0; r < n; ++r) {
    Scheduler& s = *w->schedulers[r];
    ASSERT_EQ(s.MinimumBudgetBytes(), minimum);
    ASSERT_FALSE(s.SetBudget(minimum - 1, 0).ok());
    if (minimum_units > 1) {
      ASSERT_FALSE(s.SetBudget(0, minimum_units - 1).ok());
    }
    ASSERT_TRUE(s.SetBudget(budget, budget_units).ok());
  }
  if (keep) {
    // With the budget at its minimum, a unit kept after backward that the minimum did not count
    // would break it: SetReshardAfterBackward is refused then (here: its minimum is counted
    // already, so setting it again is accepted).
    ASSERT_TRUE(first.SetReshardAfterBackward(0, false).ok());
  }

  std::vector<std::vector<std::string>> logs(n);
  std::mt19937_64 rng(c.seed ^ 0x5eed);
  const int steps = 3;
  for (int step = 0; step < steps; ++step) {
    for (int mb = 0; mb < c.micro; ++mb) {
      const bool last = mb + 1 == c.micro;
      for (int r = 0; r < n; ++r) {
        Scheduler& s = *w->schedulers[r];
        s.ClearIssueLog();
        const bool no_sync =
            c.accumulation == Accumulation::kNoSync || c.accumulation == Accumulation::kNoSyncKeep;
        s.SetRequiresGradientSync(!no_sync || last);
        s.SetRequiresAllReduce(c.accumulation != Accumulation::kDeferAllReduce || last);
        if (keep) {
          for (int u = 0; u < s.num_units(); ++u) {
            ASSERT_TRUE(s.SetReshardAfterBackward(u, last).ok());
          }
        }
      }
      const int64_t blocking = w->timeline->host_blocking_runs();
      const bool teardown = step == steps - 1 && last && c.teardown_after >= 0;
      int hooks = 0;
      auto each_rank = [&](auto&& hook) -> bool {
        if (teardown && hooks++ >= c.teardown_after) return false;
        for (int r = 0; r < n; ++r) {
          absl::Status status = hook(*w->schedulers[r], *w->compute[r]);
          EXPECT_TRUE(status.ok()) << "rank " << r << ": " << status;
          if (!status.ok()) return false;
        }
        return true;
      };
      bool going = true;
      for (size_t k = 0; k < c.uses.size() && going; ++k) {
        const int u = c.uses[k];
        const absl::Duration d = absl::Microseconds(static_cast<int64_t>(rng() % 80));
        going = each_rank([&](Scheduler& s, Stream& compute) -> absl::Status {
          SL_RETURN_IF_ERROR(s.PreForward(u));
          SL_RETURN_IF_ERROR(Compute(compute, d, absl::StrCat("f", u)));
          return s.PostForward(u);
        });
      }
      for (size_t k = c.uses.size(); k-- > 0 && going;) {
        const int u = c.uses[k];
        const absl::Duration d = absl::Microseconds(static_cast<int64_t>(rng() % 160));
        going = each_rank([&](Scheduler& s, Stream& compute) -> absl::Status {
          SL_RETURN_IF_ERROR(s.PreBackward(u));
          SL_RETURN_IF_ERROR(Compute(compute, d, absl::StrCat("b", u)));
          return s.PostBackward(u);
        });
      }
      if (going) {
        going = each_rank([](Scheduler& s, Stream&) { return s.FinishBackward(); });
      }
      if (::testing::Test::HasFailure()) return;
      if (!going) {
        // Torn down mid-step, with work issued and nothing driven: destroying the schedulers
        // must neither abort nor hang (their pools drain by driving the timeline).
        w.reset();
        return;
      }
      EXPECT_EQ(w->timeline->host_blocking_runs(), blocking) << "a hook blocked the host";
      absl::Status ran = w->timeline->RunUntilIdle();
      ASSERT_TRUE(ran.ok()) << "step " << step << " micro " << mb << ": " << ran;
      for (int r = 0; r < n; ++r) {
        Scheduler& s = *w->schedulers[r];
        absl::StatusOr<StepMetrics> m = s.LastStepMetrics(absl::InfiniteFuture());
        ASSERT_TRUE(m.ok()) << m.status();
        const std::string where =
            absl::StrCat("rank ", r, " step ", step, " micro-batch ", mb, ": ", m->ToString());
        if (budget > 0) {
          EXPECT_LE(m->peak_inflight_bytes, budget) << where;
        }
        if (budget_units > 0) {
          EXPECT_LE(m->peak_inflight_units, budget_units) << where;
        }
        EXPECT_EQ(m->budget_overshoots, 0) << where;
        EXPECT_EQ(m->order_deviations, 0) << where;
        const bool synced = !(c.accumulation == Accumulation::kNoSync ||
                              c.accumulation == Accumulation::kNoSyncKeep) ||
                            last;
        if (synced) {
          EXPECT_EQ(m->accumulated_grad_bytes, 0u) << where;
        } else {
          EXPECT_GT(m->accumulated_grad_bytes, 0u) << where;
        }
        logs[r] = s.issue_log();
      }
      for (int r = 1; r < n; ++r) {
        EXPECT_EQ(absl::StrJoin(logs[r], ", "), absl::StrJoin(logs[0], ", "))
            << "ranks 0 and " << r << " issued different collectives, step " << step;
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

int Seeds() {
  if (const char* env = std::getenv("SHARDLINE_PROPERTY_SEEDS")) return std::atoi(env);
  return testing::UnderSanitizer() ? 60 : 300;
}

uint64_t FirstSeed() {
  if (const char* env = std::getenv("SHARDLINE_PROPERTY_FIRST_SEED")) {
    return std::strtoull(env, nullptr, 10);
  }
  return 20261129;
}

TEST(SchedulerPropertyTest, RandomConfigurationsKeepEveryPromiseOnVirtualTime) {
  const uint64_t first = FirstSeed();
  const int seeds = Seeds();
  int torn_down = 0, at_minimum = 0, kept = 0;
  for (int i = 0; i < seeds; ++i) {
    const Config c = Draw(first + static_cast<uint64_t>(i));
    torn_down += c.teardown_after >= 0 ? 1 : 0;
    at_minimum += c.bytes_above == 0 ? 1 : 0;
    kept += c.accumulation == Accumulation::kNoSyncKeep ? 1 : 0;
    RunConfig(c);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "reproduce with SHARDLINE_PROPERTY_FIRST_SEED=" << c.seed
                    << " SHARDLINE_PROPERTY_SEEDS=1";
      return;
    }
  }
  // The draws reach the cases (not vacuous).
  if (seeds >= 60) {
    EXPECT_GT(torn_down, seeds / 6);
    EXPECT_GT(at_minimum, seeds / 6);
    EXPECT_GT(kept, seeds / 10);
  }
}

// --- The cases that broke the budget (issue 27), exactly -------------------------------------

// 2 ranks, full shard, 3 units of 1,000 f32 elements, order [0, 1, 2], forward prefetch 1,
// backward prefetch before the gradient.
std::unique_ptr<World> ThreeUnits(int backward_depth) {
  SchedulerOptions options;
  options.forward_order = {0, 1, 2};
  options.forward_prefetch = 1;
  options.backward_prefetch = BackwardPrefetch::kBeforeGrad;
  options.backward_prefetch_depth = backward_depth;
  options.root_unit = -1;
  absl::StatusOr<std::unique_ptr<World>> w = MakeWorld(2, options, /*bytes_per_s=*/5e9);
  SL_CHECK(w.ok()) << w.status();
  for (int r = 0; r < 2; ++r) {
    for (int u = 0; u < 3; ++u) {
      SL_CHECK((*w)->schedulers[r]
                   ->RegisterUnit(
                       {.name = absl::StrCat("u", u), .tensors = {{.name = "w", .shape = {1000}}}})
                   .ok());
    }
  }
  return *std::move(w);
}

// One micro-batch of every rank in lockstep; returns rank 0's metrics.
StepMetrics MicroBatch(World& w, bool sync) {
  for (auto& s : w.schedulers) s->SetRequiresGradientSync(sync);
  for (int u : {0, 1, 2}) {
    for (size_t r = 0; r < w.schedulers.size(); ++r) {
      SL_CHECK_OK(w.schedulers[r]->PreForward(u));
      SL_CHECK_OK(Compute(*w.compute[r], absl::Microseconds(10), "f"));
      SL_CHECK_OK(w.schedulers[r]->PostForward(u));
    }
  }
  for (int u : {2, 1, 0}) {
    for (size_t r = 0; r < w.schedulers.size(); ++r) {
      SL_CHECK_OK(w.schedulers[r]->PreBackward(u));
      SL_CHECK_OK(Compute(*w.compute[r], absl::Microseconds(20), "b"));
      SL_CHECK_OK(w.schedulers[r]->PostBackward(u));
    }
  }
  for (auto& s : w.schedulers) SL_CHECK_OK(s->FinishBackward());
  SL_CHECK_OK(w.timeline->RunUntilIdle());
  absl::StatusOr<StepMetrics> m = w.schedulers[0]->LastStepMetrics(absl::InfiniteFuture());
  SL_CHECK(m.ok()) << m.status();
  return *m;
}

TEST(SchedulerBudgetTest, AMicroBatchAfterNoSyncKeepsTheMinimumBudget) {
  std::unique_ptr<World> w = ThreeUnits(1);
  ASSERT_EQ(w->schedulers[0]->MinimumBudgetBytes(), 8000u);
  ASSERT_EQ(w->schedulers[0]->MinimumBudgetUnits(), 1);
  for (auto& s : w->schedulers) ASSERT_OK(s->SetBudget(8000, 1));
  const StepMetrics accumulate = MicroBatch(*w, /*sync=*/false);
  EXPECT_EQ(accumulate.accumulated_grad_bytes, 3 * 4000u);
  const StepMetrics reduce = MicroBatch(*w, /*sync=*/true);
  for (const StepMetrics& m : {accumulate, reduce}) {
    EXPECT_LE(m.peak_inflight_bytes, 8000u) << m.ToString();
    EXPECT_EQ(m.peak_inflight_units, 1) << m.ToString();
    EXPECT_EQ(m.budget_overshoots, 0) << m.ToString();
  }
}

TEST(SchedulerBudgetTest, AUnitBudgetHoldsAfterNoSyncWithDeepBackwardPrefetch) {
  std::unique_ptr<World> w = ThreeUnits(2);
  for (auto& s : w->schedulers) ASSERT_OK(s->SetBudget(0, 1));
  MicroBatch(*w, /*sync=*/false);
  const StepMetrics m = MicroBatch(*w, /*sync=*/true);
  EXPECT_EQ(m.peak_inflight_units, 1) << m.ToString();
  EXPECT_EQ(m.budget_overshoots, 0) << m.ToString();
  EXPECT_GT(m.deferred_prefetches, 0) << m.ToString();
}

TEST(SchedulerBudgetTest, ParametersKeptAfterBackwardAreCountedInTheMinimum) {
  std::unique_ptr<World> w = ThreeUnits(1);
  for (auto& s : w->schedulers) ASSERT_OK(s->SetBudget(8000, 1));
  // Kept after a backward that does not reduce, the parameters stay charged into the next
  // micro-batch: with the budget at the old minimum that is refused, naming the new one.
  absl::Status refused = w->schedulers[0]->SetReshardAfterBackward(1, false);
  ASSERT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_NE(refused.message().find("12000 bytes and 2 units"), std::string::npos) << refused;
  // At the new minimum (all three kept: 3 x 4,000 + the largest gradient), it holds.
  for (auto& s : w->schedulers) {
    for (int u = 0; u < 3; ++u) {
      ASSERT_OK(s->SetBudget(0, 0));
      ASSERT_OK(s->SetReshardAfterBackward(u, false));
    }
  }
  const uint64_t minimum = w->schedulers[0]->MinimumBudgetBytes();
  const int minimum_units = w->schedulers[0]->MinimumBudgetUnits();
  EXPECT_EQ(minimum, 16000u);
  EXPECT_EQ(minimum_units, 4);
  for (auto& s : w->schedulers) ASSERT_OK(s->SetBudget(minimum, minimum_units));
  MicroBatch(*w, /*sync=*/false);
  for (auto& s : w->schedulers) {
    for (int u = 0; u < 3; ++u) ASSERT_OK(s->SetReshardAfterBackward(u, true));
  }
  const StepMetrics m = MicroBatch(*w, /*sync=*/true);
  EXPECT_LE(m.peak_inflight_bytes, minimum) << m.ToString();
  EXPECT_LE(m.peak_inflight_units, minimum_units) << m.ToString();
  EXPECT_EQ(m.budget_overshoots, 0) << m.ToString();
  // The forward of the reducing micro-batch used the kept parameters: no gathers in it.
  EXPECT_EQ(m.units[0].gathers + m.units[1].gathers + m.units[2].gathers, 3) << m.ToString();
}

TEST(SchedulerTeardownTest, DestroyingSchedulersMidStepOnVirtualTimeDrainsTheTimeline) {
  // PreForward on both ranks, nothing driven, then destroy: the pools' guards are virtual
  // events; draining them drives the timeline instead of waiting on the wall clock.
  std::unique_ptr<World> w = ThreeUnits(1);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_OK(w->schedulers[r]->PreForward(0));
    ASSERT_OK(Compute(*w->compute[r], absl::Milliseconds(5), "f0"));
  }
  const absl::Time start = absl::Now();
  w->schedulers.clear();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_OK(w->timeline->RunUntilIdle());
}

}  // namespace
}  // namespace shardline
