// The Scheduler over the local backend, ranks as threads, with an asynchronous compute stream (a
// host stream: the framework's compute is work enqueued on it, as on a GPU) or a caller stream.
//   * a toy model whose forward reads every gathered parameter and whose backward writes
//     gradients that depend on them, with a unit used twice (tied), trained for 3 steps with an
//     SGD step on the shards: the parameters equal a plain-loop unsharded reference (every
//     element) under full shard, shard-grad-op, no-shard and hybrid 2 x 2, for several prefetch
//     settings and budgets;
//   * the exact issue order of gathers and reductions for forward prefetch depths 0-2 and each
//     backward prefetch mode;
//   * a step that deviates from the recorded order trains correctly and is counted;
//   * ranks with different forward orders fail on every rank, naming both units;
//   * a unit whose backward is skipped on one rank still reduces (zero gradient), no hang;
//   * gradient accumulation (no sync) and deferred hybrid all-reduce equal one big batch;
//   * ClipGradNorm equals a plain global-norm reference, full shard and hybrid;
//   * bad calls are errors naming the unit.
#include "scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/status.h"
#include "tests/common/gate.h"
#include "tests/common/rank_threads.h"
#include "tests/common/sanitizers.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);
absl::Time Deadline() { return absl::Now() + kTimeout; }

using ::shardline::testing::HashMix;
using ::shardline::testing::RunRankThreads;

// A float in [-1, 1) from the key.
float HashFloat(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  const uint64_t h = HashMix(HashMix(HashMix(HashMix(a) ^ b) ^ c) ^ d);
  return static_cast<float>(static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0);
}

// ---- The toy model -------------------------------------------------------------------------

struct ToyModel {
  std::vector<std::vector<TensorSpec>> units;
  std::vector<int> uses;  // the forward's sequence of unit uses
};

ToyModel MakeToy(int num_units, bool tied) {
  ToyModel m;
  for (int u = 0; u < num_units; ++u) {
    const int64_t n = 37 + 13 * u, k = 5 + (u % 3);
    m.units.push_back({{.name = "w", .shape = {n}}, {.name = "b", .shape = {k}}});
  }
  for (int u = 0; u < num_units; ++u) m.uses.push_back(u);
  if (tied) m.uses.push_back(0);
  return m;
}

float InitialValue(int u, int t, size_t i) { return HashFloat(1, u, t, i); }
// The input of use `k` of the forward on `data_rank` in `step` (several micro-batches: `micro`).
float Input(int data_rank, int step, int micro, int k, int t, size_t i) {
  return HashFloat(2 + data_rank, step * 16 + micro, k * 4 + t, i);
}
float Coefficient(int data_rank, int step, int micro, int k) {
  return 0.5f + 0.25f * HashFloat(3 + data_rank, step * 16 + micro, k, 0);
}

// Forward of use k: act = sum_t sum_i w_t[i] * x(t, i). Backward of use k:
// grad_t[i] += w_t[i] * (coefficient + 1e-2 * act) + x(t, i). Both read the parameters, so a wrong
// or stale gather shows up in the gradients.
double ForwardUse(const std::vector<const float*>& w, const std::vector<size_t>& n, int data_rank,
                  int step, int micro, int k) {
  double act = 0;
  for (size_t t = 0; t < w.size(); ++t) {
    for (size_t i = 0; i < n[t]; ++i) act += w[t][i] * Input(data_rank, step, micro, k, t, i);
  }
  return act;
}
void BackwardUse(const std::vector<const float*>& w, const std::vector<float*>& g,
                 const std::vector<size_t>& n, int data_rank, int step, int micro, int k,
                 double act) {
  const float c = Coefficient(data_rank, step, micro, k) + 1e-2f * static_cast<float>(act);
  for (size_t t = 0; t < w.size(); ++t) {
    for (size_t i = 0; i < n[t]; ++i)
      g[t][i] += w[t][i] * c + Input(data_rank, step, micro, k, t, i);
  }
}

constexpr float kLearningRate = 0.05f;

// The unsharded reference: `data_ranks` ranks' gradients averaged, SGD, `steps` steps,
// `micro` micro-batches per step (gradients of all micro-batches averaged over ranks and summed
// over micro-batches, as FSDP's accumulation does). skip: (data_rank, unit) whose backward is
// not run on that rank.
std::vector<std::vector<std::vector<float>>> Reference(const ToyModel& m, int data_ranks, int steps,
                                                       int micro,
                                                       std::pair<int, int> skip = {-1, -1},
                                                       double clip = 0,
                                                       std::vector<double>* norms = nullptr) {
  std::vector<std::vector<std::vector<float>>> p(m.units.size());
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t t = 0; t < m.units[u].size(); ++t) {
      std::vector<float> v(m.units[u][t].shape[0]);
      for (size_t i = 0; i < v.size(); ++i) v[i] = InitialValue(u, t, i);
      p[u].push_back(v);
    }
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<std::vector<double>>> sum(m.units.size());
    for (size_t u = 0; u < m.units.size(); ++u) {
      for (auto& v : p[u]) sum[u].push_back(std::vector<double>(v.size(), 0.0));
    }
    for (int r = 0; r < data_ranks; ++r) {
      for (int mb = 0; mb < micro; ++mb) {
        std::vector<std::vector<std::vector<float>>> g(m.units.size());
        for (size_t u = 0; u < m.units.size(); ++u) {
          for (auto& v : p[u]) g[u].push_back(std::vector<float>(v.size(), 0.0f));
        }
        std::vector<double> acts;
        for (size_t k = 0; k < m.uses.size(); ++k) {
          const int u = m.uses[k];
          std::vector<const float*> w;
          std::vector<size_t> n;
          for (auto& v : p[u]) {
            w.push_back(v.data());
            n.push_back(v.size());
          }
          acts.push_back(ForwardUse(w, n, r, s, mb, k));
        }
        for (size_t k = m.uses.size(); k-- > 0;) {
          const int u = m.uses[k];
          if (r == skip.first && u == skip.second) continue;
          std::vector<const float*> w;
          std::vector<float*> gp;
          std::vector<size_t> n;
          for (size_t t = 0; t < p[u].size(); ++t) {
            w.push_back(p[u][t].data());
            gp.push_back(g[u][t].data());
            n.push_back(p[u][t].size());
          }
          BackwardUse(w, gp, n, r, s, mb, k, acts[k]);
        }
        for (size_t u = 0; u < m.units.size(); ++u) {
          for (size_t t = 0; t < p[u].size(); ++t) {
            for (size_t i = 0; i < p[u][t].size(); ++i) sum[u][t][i] += g[u][t][i];
          }
        }
      }
    }
    double scale = 1.0;
    if (clip > 0) {
      double squares = 0;
      for (auto& unit : sum) {
        for (auto& tensor : unit) {
          for (double g : tensor) squares += (g / data_ranks) * (g / data_ranks);
        }
      }
      const double norm = std::sqrt(squares);
      if (norms != nullptr) norms->push_back(norm);
      scale = std::min(1.0, clip / (norm + 1e-6));
    }
    for (size_t u = 0; u < m.units.size(); ++u) {
      for (size_t t = 0; t < p[u].size(); ++t) {
        for (size_t i = 0; i < p[u][t].size(); ++i) {
          const float g = static_cast<float>(sum[u][t][i] / data_ranks);
          p[u][t][i] -= kLearningRate * (clip > 0 ? static_cast<float>(g * scale) : g);
        }
      }
    }
  }
  return p;
}

struct RunOptions {
  int world = 2;
  SchedulerOptions scheduler;
  bool host_compute = true;
  int steps = 3;
  int micro = 1;  // micro-batches per step
  // How micro-batches before the last reduce: kSync (every one), kNoSync (accumulate unsharded,
  // SetRequiresGradientSync(false)), kDeferAllReduce (hybrid: SetRequiresAllReduce(false)).
  enum class Accumulation { kSync, kNoSync, kDeferAllReduce } accumulation = Accumulation::kNoSync;
  bool recompute = false;  // re-run each unit's forward inside its backward
  // SetReshardAfterBackward(u, false) for every unit before each micro-batch but the last.
  bool keep_after_backward = false;
  double clip = 0;  // > 0: ClipGradNorm(clip) before the optimizer
  // CPU offload into these allocators (one per rank); empty: no offload.
  std::vector<Allocator*> offload;
  std::pair<int, int> skip = {-1, -1};  // (world rank, unit) whose backward is skipped
  // A step (>= 1) in which the forward runs units in another order (reversed blocks).
  int deviate_step = -1;
  // Ranks whose first step runs another order.
  int odd_order_rank = -1;
  // In step `swap_step`, rank `swap_rank` runs its first two forward uses the other way round.
  int swap_rank = -1;
  int swap_step = -1;
  // >= 0: after registering, the budget is set this far above MinimumBudgetBytes (and units
  // above MinimumBudgetUnits; -1: no unit budget). With keep_after_backward the parameters are
  // marked kept first, so that the minimum counts them.
  int64_t budget_above = -1;
  int budget_units_above = -1;
};

struct RankResult {
  absl::Status status;
  std::vector<std::vector<std::vector<float>>> params;  // this rank's shard, per tensor slice
  std::vector<std::string> issue_log;                   // of the last step
  std::vector<StepMetrics> metrics;
  std::vector<double> norms;                 // ClipGradNorm's results
  std::vector<std::vector<size_t>> offsets;  // [unit][tensor] element offset of the shard start
  std::vector<FlightRecord> gather_flights;  // the flight records of the gather communicator
  uint64_t budget_bytes = 0;                 // the budget set (budget_above)
  int budget_units = 0;
  // After a failed run: what the next PreForward returned (the error must stay).
  absl::Status after_error;
};

// The element range of tensor t that shard `shard` of `layout` owns, as (first element in the
// tensor, count, offset in the shard).
struct Piece {
  size_t tensor_begin, count, shard_offset;
};
std::vector<Piece> Pieces(const FlatLayout& layout, int t, int shard) {
  std::vector<Piece> out;
  std::optional<ShardSlice> s = layout.Intersection(t, shard);
  if (s.has_value() && s->length > 0) {
    out.push_back({s->tensor_offset, s->length, s->shard_offset});
  }
  return out;
}

// One rank of a training run. Returns its final master shards as full-size tensors with only its
// own elements filled (NaN elsewhere).
RankResult TrainRank(const ToyModel& m, const RunOptions& o, std::shared_ptr<Communicator> comm) {
  RankResult result;
  const int rank = comm->rank();
  auto run = [&]() -> absl::Status {
    StreamOptions so{.name = absl::StrCat("rank", rank, ".compute"), .wait_timeout = kTimeout};
    SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute,
                        o.host_compute ? CreateHostStream(so) : CreateCallerStream(so));
    SchedulerOptions sopt = o.scheduler;
    if (!o.offload.empty()) {
      sopt.cpu_offload = true;
      sopt.offload_allocator = o.offload[rank];
    }
    SL_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> sched,
                        Scheduler::Create(comm, *compute, sopt, Deadline()));
    // A failed run: the scheduler's next hook must return an error too (the step is
    // inconsistent across ranks). Runs before the scheduler goes away.
    bool finished = false;
    absl::Cleanup probe = [&] {
      if (!finished) result.after_error = sched->PreForward(0);
    };
    for (size_t u = 0; u < m.units.size(); ++u) {
      SL_ASSIGN_OR_RETURN(
          int id, sched->RegisterUnit({.name = absl::StrCat("u", u), .tensors = m.units[u]}));
      std::vector<std::vector<float>> init;
      std::vector<const void*> ptrs;
      for (size_t t = 0; t < m.units[u].size(); ++t) {
        init.emplace_back(m.units[u][t].shape[0]);
        for (size_t i = 0; i < init.back().size(); ++i) init.back()[i] = InitialValue(u, t, i);
      }
      for (auto& v : init) ptrs.push_back(v.data());
      SL_RETURN_IF_ERROR(sched->unit(id).SetShardFromTensors(ptrs, Deadline()));
    }
    if (o.budget_above >= 0) {
      if (o.keep_after_backward) {
        for (int u = 0; u < sched->num_units(); ++u) {
          SL_RETURN_IF_ERROR(sched->SetReshardAfterBackward(u, false));
        }
      }
      result.budget_bytes = sched->MinimumBudgetBytes() + static_cast<uint64_t>(o.budget_above);
      result.budget_units =
          o.budget_units_above >= 0 ? sched->MinimumBudgetUnits() + o.budget_units_above : 0;
      SL_RETURN_IF_ERROR(sched->SetBudget(result.budget_bytes, result.budget_units));
    }
    // The data rank: hybrid and no-shard replicas see different data too (every world rank is a
    // data-parallel rank).
    const int data_rank = rank;
    size_t seen = 0;
    // The scheduler's issue log interleaved with markers of the compute: "f3" (forward of u3),
    // "b3" (its backward).
    auto mark = [&](std::string marker) {
      const std::vector<std::string>& log = sched->issue_log();
      for (; seen < log.size(); ++seen) result.issue_log.push_back(log[seen]);
      if (!marker.empty()) result.issue_log.push_back(std::move(marker));
    };
    // With an asynchronous compute stream, the optimizer of step s is held back until step s+1
    // has issued its first gathers: they must wait for it (the post-optimizer ordering).
    std::shared_ptr<testing::Gate> held;
    // On an error, release the compute stream and let it finish before the scheduler (whose
    // memory the queued optimizer writes) goes away.
    absl::Cleanup drain = [&] {
      if (held != nullptr) held->Open();
      compute->Synchronize(Deadline()).IgnoreError();
    };
    for (int s = 0; s < o.steps; ++s) {
      sched->ClearIssueLog();
      seen = 0;
      result.issue_log.clear();
      std::vector<int> uses = m.uses;
      if ((s == o.deviate_step) || (s == 0 && rank == o.odd_order_rank)) {
        std::reverse(uses.begin() + 1, uses.end() - 1);
      }
      if (s == o.swap_step && rank == o.swap_rank) std::swap(uses[0], uses[1]);
      for (int mb = 0; mb < o.micro; ++mb) {
        const bool last = mb + 1 == o.micro;
        sched->SetRequiresGradientSync(o.accumulation != RunOptions::Accumulation::kNoSync || last);
        sched->SetRequiresAllReduce(o.accumulation != RunOptions::Accumulation::kDeferAllReduce ||
                                    last);
        if (o.keep_after_backward) {
          for (int u = 0; u < sched->num_units(); ++u) {
            SL_RETURN_IF_ERROR(sched->SetReshardAfterBackward(u, last));
          }
        }
        auto acts = std::make_shared<std::vector<double>>(uses.size(), 0.0);
        for (size_t k = 0; k < uses.size(); ++k) {
          const int u = uses[k];
          SL_RETURN_IF_ERROR(sched->PreForward(u));
          std::vector<const float*> w;
          std::vector<size_t> n;
          for (size_t t = 0; t < m.units[u].size(); ++t) {
            SL_ASSIGN_OR_RETURN(TensorView v, sched->unit(u).View(t));
            w.push_back(static_cast<const float*>(v.data));
            n.push_back(v.numel);
          }
          // The reference numbers uses by the canonical order: map k back.
          const int canonical_k = static_cast<int>(k);
          mark(absl::StrCat("f", u));
          if (held != nullptr && k == 0 && mb == 0) {
            held->Open();
            held.reset();
          }
          SL_RETURN_IF_ERROR(compute->Enqueue([=]() {
            (*acts)[canonical_k] = ForwardUse(w, n, data_rank, s, mb, canonical_k);
            return absl::OkStatus();
          }));
          SL_RETURN_IF_ERROR(sched->PostForward(u));
        }
        // The loss is computed: the forward is over (recomputations may follow).
        if (o.recompute) SL_RETURN_IF_ERROR(sched->EndForward());
        for (size_t k = uses.size(); k-- > 0;) {
          const int u = uses[k];
          if (rank == o.skip.first && u == o.skip.second) continue;
          if (o.recompute) {
            SL_RETURN_IF_ERROR(sched->PreForward(u));
            SL_RETURN_IF_ERROR(sched->unit(u).View(0).status());
            SL_RETURN_IF_ERROR(sched->PostForward(u));
          }
          SL_RETURN_IF_ERROR(sched->PreBackward(u));
          std::vector<const float*> w;
          std::vector<float*> g;
          std::vector<size_t> n;
          for (size_t t = 0; t < m.units[u].size(); ++t) {
            SL_ASSIGN_OR_RETURN(TensorView v, sched->unit(u).View(t));
            SL_ASSIGN_OR_RETURN(TensorView gv, sched->unit(u).GradView(t));
            w.push_back(static_cast<const float*>(v.data));
            g.push_back(static_cast<float*>(gv.data));
            n.push_back(v.numel);
          }
          const int canonical_k = static_cast<int>(k);
          mark(absl::StrCat("b", u));
          SL_RETURN_IF_ERROR(compute->Enqueue([=]() {
            BackwardUse(w, g, n, data_rank, s, mb, canonical_k, (*acts)[canonical_k]);
            return absl::OkStatus();
          }));
          SL_RETURN_IF_ERROR(sched->PostBackward(u));
        }
        SL_RETURN_IF_ERROR(sched->FinishBackward());
      }
      // SGD on the shards, on the compute stream, then zero_grad.
      if (o.clip > 0) {
        SL_ASSIGN_OR_RETURN(double norm, sched->ClipGradNorm(o.clip, Deadline()));
        result.norms.push_back(norm);
      }
      if (o.host_compute && s + 1 < o.steps) {
        held = std::make_shared<testing::Gate>();
        SL_RETURN_IF_ERROR(compute->Enqueue([gate = held]() {
          gate->Wait();
          return absl::OkStatus();
        }));
      }
      for (int u = 0; u < sched->num_units(); ++u) {
        FlatShardView p = sched->unit(u).master_shard();
        SL_ASSIGN_OR_RETURN(FlatShardView g, sched->unit(u).ShardGrad());
        SL_RETURN_IF_ERROR(compute->Enqueue([p, g]() {
          float* pw = static_cast<float*>(p.data);
          const float* gw = static_cast<const float*>(g.data);
          for (size_t i = 0; i < p.elements; ++i) pw[i] -= kLearningRate * gw[i];
          return absl::OkStatus();
        }));
      }
      SL_RETURN_IF_ERROR(sched->ZeroGrad());
      SL_ASSIGN_OR_RETURN(StepMetrics metrics, sched->LastStepMetrics(Deadline()));
      result.metrics.push_back(metrics);
      mark("");
    }
    SL_RETURN_IF_ERROR(compute->Synchronize(Deadline()));
    finished = true;
    result.gather_flights = sched->mesh().shard()->FlightRecords();
    for (int u = 0; u < sched->num_units(); ++u) {
      const FlatLayout& layout = sched->unit(u).layout();
      FlatShardView p = sched->unit(u).master_shard();
      std::vector<std::vector<float>> tensors;
      for (int t = 0; t < layout.num_tensors(); ++t) {
        std::vector<float> full(layout.tensor(t).numel, std::nanf(""));
        for (const Piece& piece : Pieces(layout, t, p.shard)) {
          for (size_t i = 0; i < piece.count; ++i) {
            full[piece.tensor_begin + i] =
                static_cast<const float*>(p.data)[piece.shard_offset + i];
          }
        }
        tensors.push_back(std::move(full));
      }
      result.params.push_back(std::move(tensors));
    }
    return absl::OkStatus();
  };
  result.status = run();
  return result;
}

std::vector<RankResult> Train(const ToyModel& m, const RunOptions& o) {
  auto comms = CreateLocalCommunicators(o.world, {.timeout = kTimeout});
  SL_CHECK(comms.ok());
  return RunRankThreads(o.world, [&](int r) { return TrainRank(m, o, (*comms)[r]); });
}

// Every element of the reference is owned by some rank's shard; each rank's element must match.
void ExpectMatchesReference(const ToyModel& m, const std::vector<RankResult>& results,
                            const std::vector<std::vector<std::vector<float>>>& ref) {
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_OK(results[r].status);
    for (size_t u = 0; u < m.units.size(); ++u) {
      for (size_t t = 0; t < m.units[u].size(); ++t) {
        double diff = 0, norm = 0;
        int compared = 0;
        for (size_t i = 0; i < ref[u][t].size(); ++i) {
          const float got = results[r].params[u][t][i];
          if (std::isnan(got)) continue;
          diff += (got - ref[u][t][i]) * double(got - ref[u][t][i]);
          norm += ref[u][t][i] * double(ref[u][t][i]);
          ++compared;
        }
        EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm) + 1e-12)
            << "rank " << r << " unit " << u << " tensor " << t << " (" << compared << " elements)";
      }
    }
  }
  // Every element is covered by some rank.
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t t = 0; t < m.units[u].size(); ++t) {
      for (size_t i = 0; i < ref[u][t].size(); ++i) {
        bool covered = false;
        for (const RankResult& rr : results) covered |= !std::isnan(rr.params[u][t][i]);
        ASSERT_TRUE(covered) << "unit " << u << " tensor " << t << " element " << i;
      }
    }
  }
}

struct StrategyCase {
  const char* name;
  ShardingStrategy strategy;
  int world;
  int shard_size;
  int forward_prefetch;
  BackwardPrefetch backward;
  bool host_compute;
};

class SchedulerTrainingTest : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(SchedulerTrainingTest, MatchesTheUnshardedReference) {
  const StrategyCase& c = GetParam();
  ToyModel m = MakeToy(5, /*tied=*/true);
  RunOptions o;
  o.world = c.world;
  o.host_compute = c.host_compute;
  o.scheduler.strategy = c.strategy;
  o.scheduler.shard_size = c.shard_size;
  o.scheduler.forward_prefetch = c.forward_prefetch;
  o.scheduler.backward_prefetch = c.backward;
  std::vector<RankResult> results = Train(m, o);
  ExpectMatchesReference(m, results, Reference(m, c.world, o.steps, 1));
  for (const RankResult& r : results) {
    ASSERT_EQ(r.metrics.size(), 3u);
    EXPECT_EQ(r.metrics[2].order_deviations, 0);
    EXPECT_EQ(r.metrics[2].budget_overshoots, 0);
    EXPECT_GT(r.metrics[2].bytes_gathered, 0u);
    EXPECT_GT(r.metrics[2].bytes_reduced, 0u);
    ASSERT_TRUE(r.metrics[2].exposed_communication.has_value());
    ASSERT_TRUE(r.metrics[2].step_time.has_value());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, SchedulerTrainingTest,
    ::testing::Values(StrategyCase{"full_shard", ShardingStrategy::kFullShard, 2, 0, 1,
                                   BackwardPrefetch::kBeforeGrad, true},
                      StrategyCase{"full_shard_3_caller", ShardingStrategy::kFullShard, 3, 0, 2,
                                   BackwardPrefetch::kAfterGrad, false},
                      StrategyCase{"full_shard_no_prefetch", ShardingStrategy::kFullShard, 2, 0, 0,
                                   BackwardPrefetch::kOff, true},
                      StrategyCase{"shard_grad_op", ShardingStrategy::kShardGradOp, 2, 0, 1,
                                   BackwardPrefetch::kBeforeGrad, true},
                      StrategyCase{"no_shard", ShardingStrategy::kNoShard, 2, 0, 1,
                                   BackwardPrefetch::kBeforeGrad, true},
                      StrategyCase{"hybrid_2x2", ShardingStrategy::kHybridShard, 4, 2, 1,
                                   BackwardPrefetch::kBeforeGrad, true}),
    [](const ::testing::TestParamInfo<StrategyCase>& info) { return info.param.name; });

// ---- Issue order ---------------------------------------------------------------------------

std::string Log(const std::vector<std::string>& log) { return absl::StrJoin(log, ", "); }

TEST(SchedulerOrderTest, ExactIssueOrderPerPrefetchMode) {
  ToyModel m = MakeToy(4, /*tied=*/false);
  struct Case {
    int forward;
    BackwardPrefetch backward;
    int depth;
    std::string expected;  // the last step's issue log
  };
  const std::vector<Case> cases = {
      // No prefetch: every gather on demand, each reduction right after its backward.
      {0, BackwardPrefetch::kOff, 1,
       "AG u0, f0, AG u1, f1, AG u2, f2, AG u3, f3, AG u3, b3, RS u3, AG u2, b2, RS u2, AG u1, "
       "b1, RS u1, AG u0, b0, RS u0"},
      // Forward depth 1: the next unit's gather is issued before the current unit's compute.
      {1, BackwardPrefetch::kOff, 1,
       "AG u0, AG u1, f0, AG u2, f1, AG u3, f2, f3, AG u3, b3, RS u3, AG u2, b2, RS u2, AG u1, "
       "b1, RS u1, AG u0, b0, RS u0"},
      // Forward depth 2; backward before the gradient, depth 1.
      {2, BackwardPrefetch::kBeforeGrad, 1,
       "AG u0, AG u1, AG u2, f0, AG u3, f1, f2, f3, AG u3, AG u2, b3, RS u3, AG u1, b2, RS u2, "
       "AG u0, b1, RS u1, b0, RS u0"},
      // Backward before the gradient, depth 2.
      {1, BackwardPrefetch::kBeforeGrad, 2,
       "AG u0, AG u1, f0, AG u2, f1, AG u3, f2, f3, AG u3, AG u2, AG u1, b3, RS u3, AG u0, b2, "
       "RS u2, b1, RS u1, b0, RS u0"},
      // Backward after the gradient: the next gather follows the compute, before the
      // reduction.
      {1, BackwardPrefetch::kAfterGrad, 1,
       "AG u0, AG u1, f0, AG u2, f1, AG u3, f2, f3, AG u3, b3, AG u2, RS u3, b2, AG u1, RS u2, "
       "b1, AG u0, RS u1, b0, RS u0"},
  };
  for (const Case& c : cases) {
    RunOptions o;
    o.world = 2;
    o.steps = 2;
    o.scheduler.forward_prefetch = c.forward;
    o.scheduler.backward_prefetch = c.backward;
    o.scheduler.backward_prefetch_depth = c.depth;
    o.scheduler.root_unit = -1;  // every unit reshards after forward
    std::vector<RankResult> results = Train(m, o);
    for (const RankResult& r : results) {
      ASSERT_OK(r.status);
      EXPECT_EQ(Log(r.issue_log), c.expected)
          << "forward " << c.forward << " backward " << BackwardPrefetchName(c.backward)
          << " depth " << c.depth;
    }
    ExpectMatchesReference(m, results, Reference(m, 2, 2, 1));
  }
}

// The flight recorder sees every all-gather of the scheduler tagged with its unit's name, in the
// issue order of the scheduler's own log.
TEST(SchedulerOrderTest, GathersAreTaggedWithTheirUnit) {
  ToyModel m = MakeToy(4, /*tied=*/false);
  RunOptions o;
  o.world = 2;
  o.steps = 2;
  o.scheduler.forward_prefetch = 1;
  o.scheduler.backward_prefetch = BackwardPrefetch::kBeforeGrad;
  o.scheduler.root_unit = -1;
  std::vector<RankResult> results = Train(m, o);
  for (const RankResult& r : results) {
    ASSERT_OK(r.status);
    std::vector<std::string> expected;  // the last step's gathers, from the issue log
    for (const std::string& entry : r.issue_log) {
      if (absl::StartsWith(entry, "AG ")) expected.push_back(entry.substr(3));
    }
    ASSERT_EQ(expected.size(), 8u) << Log(r.issue_log);
    // First the membership exchange of the reduce communicator's Dup (untagged), then two
    // steps of gathers.
    ASSERT_EQ(r.gather_flights.size(), 1 + 2 * expected.size());
    EXPECT_EQ(r.gather_flights[0].kind, CollectiveKind::kAllGather);
    EXPECT_EQ(r.gather_flights[0].dtype, DType::kI32);
    EXPECT_EQ(r.gather_flights[0].tag, "");
    std::vector<std::string> tags;
    for (size_t i = 1; i < r.gather_flights.size(); ++i) {
      const FlightRecord& f = r.gather_flights[i];
      ASSERT_EQ(f.kind, CollectiveKind::kAllGather);
      EXPECT_EQ(f.state, FlightState::kDone);
      tags.push_back(f.tag);
    }
    EXPECT_EQ(std::vector<std::string>(tags.end() - expected.size(), tags.end()), expected);
  }
}

// ---- Orders, skipped backward, accumulation, recomputation, clipping, budgets --------------

TEST(SchedulerOrderTest, ADeviatingStepTrainsCorrectlyAndIsCounted) {
  ToyModel m = MakeToy(5, /*tied=*/true);
  RunOptions o;
  o.steps = 3;
  o.deviate_step = 1;
  o.scheduler.forward_prefetch = 2;
  std::vector<RankResult> results = Train(m, o);
  for (const RankResult& r : results) {
    ASSERT_OK(r.status);
    EXPECT_EQ(r.metrics[1].order_deviations, 1);
    EXPECT_EQ(r.metrics[2].order_deviations, 0);
    EXPECT_EQ(r.metrics[2].budget_overshoots, 0);
  }
  // Steps 0 and 2 follow the order; step 1 runs u0, u4, u3, u2, u1, u0. A run without any
  // prefetch (no order-dependent logic at all) computes the same arithmetic: compare bit for bit.
  {
    RunOptions plain = o;
    plain.scheduler.forward_prefetch = 0;
    plain.scheduler.backward_prefetch = BackwardPrefetch::kOff;
    std::vector<RankResult> expected = Train(m, plain);
    for (size_t r = 0; r < results.size(); ++r) {
      ASSERT_OK(expected[r].status);
      for (size_t u = 0; u < m.units.size(); ++u) {
        for (size_t t = 0; t < m.units[u].size(); ++t) {
          for (size_t i = 0; i < expected[r].params[u][t].size(); ++i) {
            const float want = expected[r].params[u][t][i];
            const float got = results[r].params[u][t][i];
            if (std::isnan(want)) {
              EXPECT_TRUE(std::isnan(got));
            } else {
              EXPECT_EQ(got, want)
                  << "rank " << r << " unit " << u << " tensor " << t << " i " << i;
            }
          }
        }
      }
    }
  }
}

TEST(SchedulerOrderTest, RanksWithDifferentOrdersFailOnEveryRank) {
  // Units of one size, so that the mismatched gathers do not fail on their counts: the unit in
  // every collective's fingerprint catches it at the first gather that differs, before any data
  // moves, on every rank.
  ToyModel m;
  for (int u = 0; u < 4; ++u) m.units.push_back({{.name = "w", .shape = {41}}});
  m.uses = {0, 1, 2, 3};
  RunOptions o;
  o.world = 2;
  o.steps = 2;
  o.odd_order_rank = 1;  // rank 1 runs u0, u2, u1, u3 in its first step
  std::vector<RankResult> results = Train(m, o);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::IsInvalidArgument(results[r].status)) << results[r].status;
    EXPECT_TRUE(IsPeerError(results[r].status)) << results[r].status;
    EXPECT_TRUE(absl::StrContains(results[r].status.message(),
                                  "rank 0 called all_gather(count=24, f32) for 'u1' but rank 1 "
                                  "called all_gather(count=24, f32) for 'u2'"))
        << results[r].status;
  }
}

// A rank that runs two units of one size the other way round in a later step (issue 27, case
// 3): before the unit was part of the fingerprint, both ranks gathered each other's unit into
// the peer's half and trained on swapped gradients with no error. Now every rank fails at the
// first gather, naming both units and both ranks; the rank that deviated says so; the error
// stays (every later hook returns it).
TEST(SchedulerOrderTest, ARankThatSwapsUnitsFailsEveryRankNamingTheUnits) {
  for (const bool equal : {true, false}) {
    for (const int deviating : {0, 1}) {
      ToyModel m;
      for (int u = 0; u < 3; ++u) {
        m.units.push_back({{.name = "w", .shape = {equal ? 1000 : 1000 + 12 * u}}});
      }
      m.uses = {0, 1, 2};
      RunOptions o;
      o.world = 2;
      o.steps = 3;
      o.scheduler.root_unit = -1;
      o.swap_rank = deviating;
      o.swap_step = 2;  // runs [1, 0, 2]
      std::vector<RankResult> results = Train(m, o);
      for (int r = 0; r < 2; ++r) {
        const absl::Status& st = results[r].status;
        SCOPED_TRACE(absl::StrCat("equal sizes ", equal, ", rank ", deviating, " deviates, rank ",
                                  r, ": ", st.ToString()));
        // InvalidArgument, or Aborted for a later gather the poisoned stream refused (carrying
        // the mismatch), depending on timing: a peer error either way.
        ASSERT_FALSE(st.ok());
        EXPECT_TRUE(IsPeerError(st));
        EXPECT_TRUE(absl::StrContains(st.message(), "ranks disagree on the collective"));
        if (equal) {
          // rank 0's unit first: the deviating rank gathers 'u1' where the other gathers 'u0'.
          const std::string u0 = deviating == 0 ? "'u1'" : "'u0'";
          const std::string u1 = deviating == 0 ? "'u0'" : "'u1'";
          EXPECT_TRUE(absl::StrContains(
              st.message(),
              absl::StrCat("rank 0 called all_gather(count=500, f32) for ", u0,
                           " but rank 1 called all_gather(count=500, f32) for ", u1)));
        }
        // The host compute stream is asynchronous: the error surfaced from it (at the end of the
        // step). Sticky: the next hook returns the same error, and says whether this rank kept to
        // the order.
        const absl::Status& next = results[r].after_error;
        EXPECT_EQ(next.code(), st.code()) << next;
        EXPECT_TRUE(IsPeerError(next)) << next;
        // The same failure, from where the stream reports it on: the call that surfaced it first
        // (a hook, or ZeroShardGrad when the compute stream was late) names itself before that.
        absl::string_view failure = st.message();
        if (const size_t at = failure.find("stream '"); at != absl::string_view::npos) {
          failure.remove_prefix(at);
        }
        EXPECT_TRUE(absl::StrContains(next.message(), failure)) << next;
        EXPECT_TRUE(absl::StrContains(next.message(), r == deviating
                                                          ? "this rank deviated from the known "
                                                            "forward order in step 2: at position "
                                                            "0 it ran 'u1' where the order has "
                                                            "'u0'"
                                                          : "this rank's forward followed the "
                                                            "known order in steps"))
            << next;
        // Steps 0 and 1 trained; the swapped step failed at its first gather.
        EXPECT_EQ(results[r].metrics.size(), 2u);
      }
    }
  }
}

TEST(SchedulerBackwardTest, AUnitSkippedOnOneRankStillReducesAZeroGradient) {
  ToyModel m = MakeToy(5, /*tied=*/true);
  for (const std::pair<int, int>& skip : {std::pair{1, 2}, std::pair{0, 4}, std::pair{1, 1}}) {
    RunOptions o;
    o.skip = skip;
    std::vector<RankResult> results = Train(m, o);
    ExpectMatchesReference(m, results, Reference(m, 2, o.steps, 1, skip));
  }
}

TEST(SchedulerAccumulationTest, MicroBatchesMatchOneBigBatch) {
  ToyModel m = MakeToy(4, /*tied=*/true);
  struct Case {
    RunOptions::Accumulation mode;
    ShardingStrategy strategy;
    int world, shard;
  };
  for (const Case& c :
       {Case{RunOptions::Accumulation::kSync, ShardingStrategy::kFullShard, 2, 0},
        Case{RunOptions::Accumulation::kNoSync, ShardingStrategy::kFullShard, 2, 0},
        Case{RunOptions::Accumulation::kSync, ShardingStrategy::kHybridShard, 4, 2},
        Case{RunOptions::Accumulation::kDeferAllReduce, ShardingStrategy::kHybridShard, 4, 2}}) {
    RunOptions o;
    o.world = c.world;
    o.micro = 3;
    o.accumulation = c.mode;
    o.scheduler.strategy = c.strategy;
    o.scheduler.shard_size = c.shard;
    std::vector<RankResult> results = Train(m, o);
    ExpectMatchesReference(m, results, Reference(m, c.world, o.steps, 3));
    for (const RankResult& r : results) {
      ASSERT_OK(r.status);
      // 3 micro-batches per step: the metrics of the first two report the unsharded gradients
      // kept across micro-batches when they are not reduced.
      const StepMetrics& first = r.metrics.front();
      (void)first;
    }
  }
}

// SetReshardAfterBackward(false) while accumulating: the micro-batches after the first run their
// forward on the parameters their predecessor's backward left gathered (no all-gather), and the
// training still matches one big batch.
TEST(SchedulerAccumulationTest, KeptAfterBackwardSkipsTheNextForwardsGathers) {
  ToyModel m = MakeToy(4, /*tied=*/true);
  RunOptions o;
  o.micro = 3;
  o.accumulation = RunOptions::Accumulation::kNoSync;
  std::vector<RankResult> plain = Train(m, o);
  o.keep_after_backward = true;
  std::vector<RankResult> kept = Train(m, o);
  ExpectMatchesReference(m, kept, Reference(m, 2, o.steps, 3));
  auto gathers = [](const std::vector<std::string>& log, size_t end) {
    return std::count_if(log.begin(), log.begin() + end,
                         [](const std::string& e) { return e.rfind("AG ", 0) == 0; });
  };
  for (size_t r = 0; r < kept.size(); ++r) {
    ASSERT_OK(plain[r].status);
    ASSERT_OK(kept[r].status);
    const std::vector<std::string>& log = plain[r].issue_log;
    // The gathers of one micro-batch's forward: those before its last forward marker.
    size_t end = 0, forwards = 0;
    for (size_t i = 0; i < log.size() && forwards < m.uses.size(); ++i) {
      if (log[i][0] == 'f') {
        ++forwards;
        end = i;
      }
    }
    const auto per_forward = gathers(log, end);
    ASSERT_GT(per_forward, 0);
    EXPECT_EQ(gathers(kept[r].issue_log, kept[r].issue_log.size()),
              gathers(log, log.size()) - 2 * per_forward)
        << absl::StrJoin(kept[r].issue_log, " ");
  }
}

TEST(SchedulerBackwardTest, RecomputationIsServedByTheBackwardGather) {
  ToyModel m = MakeToy(4, /*tied=*/false);
  RunOptions plain;
  plain.steps = 2;
  plain.scheduler.root_unit = -1;
  RunOptions recompute = plain;
  recompute.recompute = true;
  std::vector<RankResult> a = Train(m, plain);
  std::vector<RankResult> b = Train(m, recompute);
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(a[r].status);
    ASSERT_OK(b[r].status);
    // The same gathers and reductions in the same order: no second gather, no recorded use.
    std::vector<std::string> ga, gb;
    for (const std::string& e : a[r].issue_log) {
      if (e[0] == 'A' || e[0] == 'R') ga.push_back(e);
    }
    for (const std::string& e : b[r].issue_log) {
      if (e[0] == 'A' || e[0] == 'R') gb.push_back(e);
    }
    EXPECT_EQ(Log(ga), Log(gb));
    EXPECT_EQ(b[r].metrics.back().order_deviations, 0);
  }
  ExpectMatchesReference(m, b, Reference(m, 2, plain.steps, 1));
}

TEST(SchedulerClipTest, ClipGradNormMatchesAGlobalNormReference) {
  ToyModel m = MakeToy(4, /*tied=*/true);
  for (const auto& [strategy, world, shard] : {std::tuple{ShardingStrategy::kFullShard, 3, 0},
                                               std::tuple{ShardingStrategy::kHybridShard, 4, 2}}) {
    RunOptions o;
    o.world = world;
    o.scheduler.strategy = strategy;
    o.scheduler.shard_size = shard;
    o.clip = 0.5;
    std::vector<double> norms;
    auto ref = Reference(m, world, o.steps, 1, {-1, -1}, o.clip, &norms);
    std::vector<RankResult> results = Train(m, o);
    ExpectMatchesReference(m, results, ref);
    for (const RankResult& r : results) {
      ASSERT_EQ(r.norms.size(), norms.size());
      for (size_t s = 0; s < norms.size(); ++s) {
        EXPECT_NEAR(r.norms[s], norms[s], 1e-5 * norms[s]) << "step " << s;
        EXPECT_GT(norms[s], o.clip);  // the clip is active
      }
    }
  }
}

TEST(SchedulerBudgetTest, TheMinimumBudgetDefersPrefetchesWithoutOvershooting) {
  ToyModel m = MakeToy(6, /*tied=*/false);
  // The minimum on 2 ranks, all f32: the root (u0, kept after forward) plus the largest backward
  // footprint (parameters + gradient of the largest unit).
  uint64_t root = 0, largest = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    auto layout = FlatLayout::Create(m.units[u], {.num_shards = 2});
    ASSERT_TRUE(layout.ok());
    const uint64_t param = layout->total_elements() * 4;
    if (u == 0) root = param;
    largest = std::max(largest, u == 0 ? param : 2 * param);
  }
  const uint64_t minimum = root + largest;
  RunOptions o;
  o.world = 2;
  o.scheduler.forward_prefetch = 3;
  o.scheduler.backward_prefetch_depth = 3;
  o.scheduler.budget_bytes = minimum - 1;
  std::vector<RankResult> refused = Train(m, o);
  ASSERT_TRUE(absl::IsInvalidArgument(refused[0].status)) << refused[0].status;
  EXPECT_TRUE(absl::StrContains(refused[0].status.message(),
                                absl::StrCat("is below the ", minimum, " bytes")))
      << refused[0].status;
  for (const uint64_t budget : {minimum, minimum + 300, 3 * minimum}) {
    o.scheduler.budget_bytes = budget;
    std::vector<RankResult> results = Train(m, o);
    ExpectMatchesReference(m, results, Reference(m, 2, o.steps, 1));
    for (const RankResult& r : results) {
      for (const StepMetrics& step : r.metrics) {
        EXPECT_LE(step.peak_inflight_bytes, budget) << step.ToString();
        EXPECT_EQ(step.budget_overshoots, 0) << step.ToString();
      }
      // Prefetch depth 3 does not fit in the minimum: prefetches were deferred, not dropped.
      if (budget == minimum) {
        EXPECT_GT(r.metrics.back().deferred_prefetches, 0);
      }
    }
  }
}

TEST(SchedulerOffloadTest, OffloadedShardsTrainLikeTheReference) {
  // No device here: the pools (the "device") and the offload allocator are separate host
  // allocators, so the copies between them really run; a missing copy would train on garbage.
  ToyModel m = MakeToy(5, /*tied=*/true);
  for (const auto& [strategy, world, shard] : {std::tuple{ShardingStrategy::kFullShard, 2, 0},
                                               std::tuple{ShardingStrategy::kHybridShard, 4, 2}}) {
    std::vector<std::unique_ptr<Allocator>> hosts;
    RunOptions o;
    o.world = world;
    o.micro = 2;
    o.accumulation = RunOptions::Accumulation::kSync;
    o.scheduler.strategy = strategy;
    o.scheduler.shard_size = shard;
    for (int r = 0; r < world; ++r) {
      hosts.push_back(CreateHostAllocator(64, absl::StrCat("offload", r)));
      o.offload.push_back(hosts.back().get());
    }
    std::vector<RankResult> results = Train(m, o);
    ExpectMatchesReference(m, results, Reference(m, world, o.steps, 2));
    for (int r = 0; r < world; ++r) {
      const MemoryStats stats = hosts[r]->stats();
      // The offload allocator held the master shards and sharded gradients (5 units x 2), and
      // the reduced shards copied back from the device, one per reduction (5 units x 2
      // micro-batches x 3 steps).
      EXPECT_GE(stats.total_allocations, 10 + 30) << "rank " << r;
      EXPECT_GT(stats.peak_bytes, 0);
    }
  }
}

// ---- Randomized: the toy model on real threads against the unsharded reference ---------------

// Seeded random runs (a failure names its seed): worlds of 1-4 ranks, every strategy, 2-6 units
// with ties, forward prefetch 0-4, every backward mode at depth 0-4, 1-3 micro-batches with sync,
// no_sync, no_sync + parameters kept after backward or deferred all-reduce, activation
// recomputation, a root or none, budgets at or above the minimum (bytes, units). Each trains 3
// steps on asynchronous host compute streams and checks every element against the plain-loop
// reference, the budget (peak <= budget, no overshoot) and that every rank issued the same
// collectives. One run in five swaps two units on one rank in its last step instead: every rank
// must then fail with a peer error that stays (the next hook returns it).
TEST(SchedulerPropertyTest, RandomRunsTrainExactlyWithinTheBudget) {
  const int seeds = testing::UnderSanitizer() ? 12 : 40;
  int swapped = 0;
  for (int i = 0; i < seeds; ++i) {
    const uint64_t seed = 1129 + i;
    std::mt19937_64 rng(seed);
    const bool swap = rng() % 5 == 0;
    const int units = 2 + static_cast<int>(rng() % 5);
    ToyModel m = MakeToy(units, /*tied=*/rng() % 2 == 0);
    if (swap) {
      // Two units of one size, so that only the unit in the fingerprint tells them apart.
      m.units[1] = m.units[0];
    }
    RunOptions o;
    o.world = 1 + static_cast<int>(rng() % 4);
    o.steps = 3;
    switch (rng() % 4) {
      case 0:
        o.scheduler.strategy = ShardingStrategy::kShardGradOp;
        break;
      case 1:
        o.scheduler.strategy = ShardingStrategy::kNoShard;
        break;
      case 2:
        if (o.world == 4) {
          o.scheduler.strategy = ShardingStrategy::kHybridShard;
          o.scheduler.shard_size = 2;
        }
        break;
      default:
        break;
    }
    o.scheduler.forward_prefetch = static_cast<int>(rng() % 5);
    o.scheduler.backward_prefetch = static_cast<BackwardPrefetch>(rng() % 3);
    o.scheduler.backward_prefetch_depth = static_cast<int>(rng() % 5);
    o.scheduler.root_unit = static_cast<int>(rng() % (units + 1)) - 1;
    o.micro = 1 + static_cast<int>(rng() % 3);
    const int mode =
        static_cast<int>(rng() % (o.scheduler.strategy == ShardingStrategy::kHybridShard ? 4 : 3));
    o.accumulation = mode == 0   ? RunOptions::Accumulation::kSync
                     : mode == 3 ? RunOptions::Accumulation::kDeferAllReduce
                                 : RunOptions::Accumulation::kNoSync;
    o.keep_after_backward = mode == 2;
    o.recompute = rng() % 4 == 0;
    if (rng() % 4 != 0) {
      // An explicit order: its units used twice are in the minimum from the start (a recorded
      // order raises the minimum after the first step, with a warning).
      o.scheduler.forward_order = m.uses;
      o.budget_above = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 4000);
      o.budget_units_above = rng() % 2 == 0 ? -1 : static_cast<int>(rng() % 2);
    }
    if (swap && o.world > 1) {
      o.swap_rank = static_cast<int>(rng() % o.world);
      o.swap_step = 2;
      o.recompute = false;
      // The first two uses must be the two units of one size.
      m.uses = {0, 1};
      for (int u = 2; u < units; ++u) m.uses.push_back(u);
      if (!o.scheduler.forward_order.empty()) o.scheduler.forward_order = m.uses;
    }
    SCOPED_TRACE(absl::StrCat(
        "seed ", seed, ": ", o.world, " ranks, ", ShardingStrategyName(o.scheduler.strategy), ", ",
        units, " units, uses [", absl::StrJoin(m.uses, ","), "], forward prefetch ",
        o.scheduler.forward_prefetch, ", backward ",
        BackwardPrefetchName(o.scheduler.backward_prefetch), " depth ",
        o.scheduler.backward_prefetch_depth, ", root ", o.scheduler.root_unit, ", ", o.micro,
        " micro-batches mode ", mode, ", recompute ", o.recompute, ", budget +", o.budget_above,
        " units +", o.budget_units_above, ", swap rank ", o.swap_rank));
    std::vector<RankResult> results = Train(m, o);
    if (o.swap_rank >= 0) {
      ++swapped;
      for (const RankResult& r : results) {
        // The mismatch itself (InvalidArgument), or a later gather its poisoned stream refused
        // (Aborted, carrying it), depending on which hook saw it first: a peer error either way.
        EXPECT_TRUE(!r.status.ok() && IsPeerError(r.status)) << r.status;
        EXPECT_TRUE(absl::StrContains(r.status.message(), "ranks disagree on the collective"))
            << r.status;
        EXPECT_TRUE(absl::StrContains(r.status.message(), "'u0'") &&
                    absl::StrContains(r.status.message(), "'u1'"))
            << r.status;
        // Sticky: the next hook fails with the disagreement too, whether a hook or the compute
        // stream saw it first.
        EXPECT_TRUE(IsPeerError(r.after_error) &&
                    absl::StrContains(r.after_error.message(), "ranks disagree on the collective"))
            << r.after_error;
      }
    } else {
      ExpectMatchesReference(m, results, Reference(m, o.world, o.steps, o.micro));
      for (size_t r = 0; r < results.size(); ++r) {
        for (const StepMetrics& step : results[r].metrics) {
          if (results[r].budget_bytes > 0) {
            EXPECT_LE(step.peak_inflight_bytes, results[r].budget_bytes) << step.ToString();
          }
          if (results[r].budget_units > 0) {
            EXPECT_LE(step.peak_inflight_units, results[r].budget_units) << step.ToString();
          }
          EXPECT_EQ(step.budget_overshoots, 0) << step.ToString();
        }
        EXPECT_EQ(Log(results[r].issue_log), Log(results[0].issue_log))
            << "ranks 0 and " << r << " issued different collectives";
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(swapped, 0);
}

// One step over units 0..n-1 in order: each unit's forward, then the backward in reverse.
absl::Status RunStepOfUnits(Scheduler& s, int n) {
  for (int u = 0; u < n; ++u) {
    SL_RETURN_IF_ERROR(s.PreForward(u));
    SL_RETURN_IF_ERROR(s.PostForward(u));
  }
  for (int u = n - 1; u >= 0; --u) {
    SL_RETURN_IF_ERROR(s.PreBackward(u));
    SL_RETURN_IF_ERROR(s.PostBackward(u));
  }
  return s.FinishBackward();
}

// A peer's disagreement (InvalidArgument with the peer payload) leaves the step inconsistent
// across ranks: every later hook returns that same error (issue 27, case 4), also a hook that
// issues no collective (here: PreForward of the root unit, kept gathered since its first use).
// Caller compute streams, so that the error surfaces in the hook that waits for the gather.
TEST(SchedulerErrorsTest, APeersDisagreementIsSticky) {
  auto comms = CreateLocalCommunicators(2, {.timeout = kTimeout});
  ASSERT_OK(comms.status());
  std::vector<absl::Status> first(2), next(2), finish(2);
  RunRankThreads(2, [&](int r) {
    auto run = [&]() -> absl::Status {
      SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute, CreateCallerStream());
      SL_ASSIGN_OR_RETURN(
          std::unique_ptr<Scheduler> s,
          Scheduler::Create((*comms)[r], *compute,
                            {.forward_prefetch = 0, .forward_order = {0, 1, 2}}, Deadline()));
      for (int u = 0; u < 3; ++u) {
        SL_RETURN_IF_ERROR(s->RegisterUnit({.name = absl::StrCat("u", u),
                                            .tensors = {{.name = "w", .shape = {100 + 50 * u}}}})
                               .status());
      }
      SL_RETURN_IF_ERROR(RunStepOfUnits(*s, 3));
      // Step 1: the root u0 is gathered and kept; then rank 1 runs u2 where rank 0 runs u1.
      SL_RETURN_IF_ERROR(s->PreForward(0));
      SL_RETURN_IF_ERROR(s->PostForward(0));
      first[r] = s->PreForward(r == 0 ? 1 : 2);
      next[r] = s->PreForward(0);  // no collective: u0 is gathered
      finish[r] = s->FinishBackward();
      return absl::OkStatus();
    };
    EXPECT_OK(run());
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_TRUE(absl::IsInvalidArgument(first[r]) && IsPeerError(first[r])) << first[r];
    EXPECT_TRUE(absl::StrContains(first[r].message(), "ranks disagree on the collective"));
    EXPECT_EQ(next[r], first[r]);
    EXPECT_EQ(finish[r], first[r]);
  }
}

// A scheduler destroyed in the middle of a step (the framework gave up on an error no hook saw)
// owes its peers that step's collectives: it aborts its communicators, so that a peer fails at
// once, naming it, instead of at its deadline. Rank 1 leaves during its first forward; rank 0
// runs the whole step and the next one's first hook. With a caller compute stream (the hooks
// block on the gathers) and with a host one (nothing blocks until the order check).
TEST(SchedulerErrorsTest, ASchedulerDestroyedMidStepFailsItsPeersAtOnce) {
  for (const bool host_compute : {false, true}) {
    SCOPED_TRACE(host_compute ? "host compute stream" : "caller compute stream");
    auto comms = CreateLocalCommunicators(2, {.timeout = absl::Seconds(20)});
    ASSERT_OK(comms.status());
    absl::Status survivor;
    RunRankThreads(2, [&](int r) {
      auto run = [&]() -> absl::Status {
        SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute,
                            host_compute ? CreateHostStream({}) : CreateCallerStream());
        absl::Status status = [&]() -> absl::Status {
          SL_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> s,
                              Scheduler::Create((*comms)[r], *compute, {}, Deadline()));
          for (int u = 0; u < 3; ++u) {
            SL_RETURN_IF_ERROR(s->RegisterUnit({.name = absl::StrCat("u", u),
                                                .tensors = {{.name = "w", .shape = {37 + 5 * u}}}})
                                   .status());
          }
          if (r == 1) return s->PreForward(0);  // and the scheduler goes
          SL_RETURN_IF_ERROR(RunStepOfUnits(*s, 3));
          return s->PreForward(0);
        }();
        compute->Synchronize(Deadline()).IgnoreError();
        return status;
      };
      absl::Status status = run();
      if (r == 0) {
        survivor = status;
      } else {
        EXPECT_OK(status);
      }
    });
    ASSERT_FALSE(survivor.ok());
    EXPECT_FALSE(absl::IsDeadlineExceeded(survivor)) << "waited out the deadline: " << survivor;
    EXPECT_TRUE(IsPeerError(survivor)) << survivor;
    EXPECT_TRUE(absl::StrContains(survivor.message(),
                                  "scheduler 'fsdp' was destroyed in the middle of step 0"))
        << survivor;
  }
}

TEST(SchedulerErrorsTest, BadCallsNameTheUnit) {
  auto comms = CreateLocalCommunicators(1);
  ASSERT_TRUE(comms.ok());
  auto compute = CreateCallerStream();
  ASSERT_TRUE(compute.ok());
  auto sched = Scheduler::Create((*comms)[0], **compute, {}, Deadline());
  ASSERT_TRUE(sched.ok()) << sched.status();
  Scheduler& s = **sched;
  ASSERT_TRUE(s.RegisterUnit({.name = "block0", .tensors = {{.name = "w", .shape = {3}}}}).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      s.RegisterUnit({.name = "block0", .tensors = {{.name = "w", .shape = {3}}}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(s.PreForward(7)));
  absl::Status status = s.PostForward(0);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "'block0'")) << status;
  status = s.PreBackward(0);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition(s.FinishBackward()));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.LastStepMetrics(Deadline()).status()));
  // A full step works after the errors.
  ASSERT_OK(s.PreForward(0));
  ASSERT_OK(s.PostForward(0));
  ASSERT_OK(s.PreBackward(0));
  ASSERT_OK(s.PostBackward(0));
  ASSERT_OK(s.FinishBackward());
  EXPECT_TRUE(absl::IsFailedPrecondition(
      s.RegisterUnit({.name = "late", .tensors = {{.name = "w", .shape = {3}}}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(s.ClipGradNorm(0, Deadline()).status()));
}

}  // namespace
}  // namespace shardline
