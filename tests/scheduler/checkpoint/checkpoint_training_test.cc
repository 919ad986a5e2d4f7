// Training continued from a checkpoint matches the uninterrupted run, step by step. The example
// model (examples/model/tiny_lm.h) is trained by the scheduler (full shard, ranks as threads over
// the local backend) with AdamW, whose moments are registered as shard-shaped checkpoint states
// and whose step counter is a replicated state, on the same global batch of 48 examples per step
// at every world size:
//   * uninterrupted: world 4, K + N steps, a background save (SaveAsync) after step K while the
//     training goes on; every step's loss, parameters and moments are recorded as full tensors;
//   * a new job at world 4 loads the checkpoint: the state right after the load, then every
//     one of the N steps (loss, every parameter and moment element) is bit-identical;
//   * a new job at world 2 loads it: the state after the load is bit-identical; the N steps
//     then differ only by the order of the gradient sums (see kTolerance), every element checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/model/tiny_lm.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/scheduler.h"
#include "tests/common/local_ranks.h"

namespace shardline::examples {
namespace {

namespace fs = std::filesystem;

constexpr int kGlobalBatch = 48;
constexpr int kSavedSteps = 3;      // K
constexpr int kContinuedSteps = 4;  // N
constexpr absl::Duration kTimeout = absl::Seconds(60);
absl::Time Deadline() { return absl::Now() + kTimeout; }

ModelConfig Config(int world) {
  ModelConfig c;
  c.blocks = 3;
  c.dim = 20;
  c.hidden = 36;
  c.vocab = 37;
  c.tokens_per_rank = kGlobalBatch / world;
  return c;
}

// What the model sees of the scheduler: the gathered parameters and the unsharded gradients
// (f32), the compute being the calling thread.
class Access final : public UnitAccess {
 public:
  explicit Access(Scheduler& s) : s_(s) {}
  absl::Status PreForward(int unit) override { return s_.PreForward(unit); }
  absl::Status PostForward(int unit) override { return s_.PostForward(unit); }
  absl::Status PreBackward(int unit) override { return s_.PreBackward(unit); }
  absl::Status PostBackward(int unit) override { return s_.PostBackward(unit); }
  const float* Param(int unit, int tensor) override {
    absl::StatusOr<TensorView> v = s_.unit(unit).View(tensor);
    return v.ok() ? static_cast<const float*>(v->data) : nullptr;
  }
  float* Grad(int unit, int tensor) override {
    absl::StatusOr<TensorView> g = s_.unit(unit).GradView(tensor);
    return g.ok() ? static_cast<float*>(g->data) : nullptr;
  }

 private:
  Scheduler& s_;
};

// The full state after a step: [0] parameters, [1] AdamW m, [2] AdamW v, each [unit][tensor]
// [element], assembled from the ranks' shards (NaN where no rank wrote).
struct Snapshot {
  double loss = 0;
  std::vector<std::vector<std::vector<float>>> state[3];
};
// history[s]: the state after s + 1 steps.
using History = std::vector<Snapshot>;

History EmptyHistory(int steps) {
  const ModelConfig config = Config(1);
  History h(steps);
  for (Snapshot& snap : h) {
    for (auto& which : snap.state) {
      which.resize(config.num_units());
      for (int u = 0; u < config.num_units(); ++u) {
        for (size_t t = 0; t < ModelUnits(config)[u].tensors.size(); ++t) {
          which[u].emplace_back(TensorNumel(config, u, static_cast<int>(t)), NAN);
        }
      }
    }
  }
  return h;
}

struct Segment {
  int world = 4;
  int until = 0;               // train until this many steps are done
  std::string load;            // load this checkpoint first ("": the initial parameters)
  std::string save;            // SaveAsync into it ...
  int save_after = -1;         // ... once this many steps are done
  int* loaded_step = nullptr;  // rank 0 reports the step counter the load gave
};

// One rank of a segment; writes its shards into `history` (under `mu`).
absl::Status TrainRank(std::shared_ptr<Communicator> world, const Segment& seg, History* history,
                       std::mutex* mu) {
  const int rank = world->rank();
  const ModelConfig config = Config(seg.world);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute,
                      CreateCallerStream({.name = "compute", .wait_timeout = kTimeout}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> sched,
                      Scheduler::Create(world, *compute, {}, Deadline()));
  const std::vector<UnitDef> defs = ModelUnits(config);
  std::vector<std::vector<float>> m(defs.size()), v(defs.size());
  for (size_t u = 0; u < defs.size(); ++u) {
    SL_ASSIGN_OR_RETURN(int id, sched->RegisterUnit({.name = defs[u].name,
                                                     .tensors = defs[u].tensors,
                                                     .policy = {.reduce_op = ReduceOp::kSum}}));
    std::vector<std::vector<float>> values;
    InitUnit(config, id, values);
    std::vector<const void*> pointers;
    for (const auto& x : values) pointers.push_back(x.data());
    SL_RETURN_IF_ERROR(sched->unit(id).SetShardFromTensors(pointers, Deadline()));
    m[u].assign(sched->unit(id).layout().shard_elements(), 0.0f);
    v[u].assign(sched->unit(id).layout().shard_elements(), 0.0f);
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Checkpointer> ckpt,
                      Checkpointer::Create(*sched, {}, Deadline()));
  int64_t step = 0;  // steps done: AdamW's bias correction needs it after a load
  for (size_t u = 0; u < defs.size(); ++u) {
    const int unit = static_cast<int>(u);
    SL_RETURN_IF_ERROR(ckpt->AddState({.unit = unit, .name = "adamw.m", .data = m[u].data()}));
    SL_RETURN_IF_ERROR(ckpt->AddState({.unit = unit, .name = "adamw.v", .data = v[u].data()}));
  }
  SL_RETURN_IF_ERROR(ckpt->AddReplicatedState(
      {.name = "adamw.step", .shape = {}, .dtype = DType::kI64, .data = &step}));

  const auto record = [&](int index, double loss) {
    std::lock_guard<std::mutex> lock(*mu);
    Snapshot& snap = (*history)[index];
    if (rank == 0) snap.loss = loss;
    for (int u = 0; u < sched->num_units(); ++u) {
      const FlatLayout& layout = sched->unit(u).layout();
      const FlatShardView p = sched->unit(u).master_shard();
      const float* data[3] = {static_cast<const float*>(p.data), m[u].data(), v[u].data()};
      for (const ShardSlice& s : layout.ShardSlices(p.shard)) {
        for (int w = 0; w < 3; ++w) {
          std::memcpy(&snap.state[w][u][s.tensor][s.tensor_offset], data[w] + s.shard_offset,
                      s.length * sizeof(float));
        }
      }
    }
  };

  if (!seg.load.empty()) {
    SL_RETURN_IF_ERROR(ckpt->Load(seg.load, Deadline()));
    if (rank == 0 && seg.loaded_step != nullptr) *seg.loaded_step = static_cast<int>(step);
    if (step >= 1) record(static_cast<int>(step) - 1, NAN);  // the state right after the load
  }
  Access access(*sched);
  const AdamW adamw;
  const TrainOptions options;
  while (step < seg.until) {
    SL_ASSIGN_OR_RETURN(
        std::vector<Example> batch,
        SyntheticBatch(config, options.data_seed, static_cast<int>(step), rank, seg.world));
    SL_ASSIGN_OR_RETURN(
        double loss, TrainStepForwardBackward(config, access, batch, kGlobalBatch, options.step));
    SL_RETURN_IF_ERROR(sched->FinishBackward());
    for (int u = 0; u < sched->num_units(); ++u) {
      FlatShardView p = sched->unit(u).master_shard();
      SL_ASSIGN_OR_RETURN(FlatShardView g, sched->unit(u).ShardGrad());
      AdamWStep(adamw, static_cast<int>(step) + 1, static_cast<float*>(p.data),
                static_cast<const float*>(g.data), m[u].data(), v[u].data(), p.elements);
    }
    SL_RETURN_IF_ERROR(sched->ZeroGrad());
    ++step;
    ReduceOptions sum;
    sum.op = ReduceOp::kSum;
    SL_ASSIGN_OR_RETURN(Work work, world->AllReduce(&loss, &loss, 1, DType::kF64, *compute, sum));
    SL_RETURN_IF_ERROR(work.Wait(Deadline()));
    record(static_cast<int>(step) - 1, loss);
    if (step == seg.save_after) SL_RETURN_IF_ERROR(ckpt->SaveAsync(seg.save, Deadline()));
  }
  return ckpt->WaitForSave(Deadline());
}

History RunSegment(const Segment& seg, int total_steps) {
  History history = EmptyHistory(total_steps);
  std::mutex mu;
  const std::vector<absl::Status> statuses = testing::RunLocalRanks(
      seg.world, kTimeout,
      [&](int, std::shared_ptr<Communicator> comm) { return TrainRank(comm, seg, &history, &mu); });
  for (int r = 0; r < seg.world; ++r)
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
  return history;
}

// Every element of every parameter and moment tensor, and the loss, bit-identical.
void ExpectBitIdentical(const Snapshot& a, const Snapshot& b, bool loss, const std::string& what) {
  if (loss) {
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0)
        << what << ": loss " << a.loss << " vs " << b.loss;
  }
  for (int w = 0; w < 3; ++w) {
    for (size_t u = 0; u < a.state[w].size(); ++u) {
      for (size_t t = 0; t < a.state[w][u].size(); ++t) {
        const std::vector<float>& x = a.state[w][u][t];
        const std::vector<float>& y = b.state[w][u][t];
        size_t differ = 0, unset = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          differ += std::memcmp(&x[i], &y[i], 4) != 0;
          unset += std::isnan(y[i]);
        }
        EXPECT_EQ(unset, 0u) << what << ": the reference lacks elements";
        EXPECT_EQ(differ, 0u) << what << ": state " << w << " unit " << u << " tensor " << t << " ("
                              << x.size() << " elements)";
      }
    }
  }
}

class CheckpointTrainingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / absl::StrCat("shardline_ckpt_train_", getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }
  fs::path root_;
};

TEST_F(CheckpointTrainingTest, ContinuedRunMatchesTheUninterruptedOne) {
  const int total = kSavedSteps + kContinuedSteps;
  const std::string dir = (root_ / "step3").string();
  const History full =
      RunSegment({.world = 4, .until = total, .save = dir, .save_after = kSavedSteps}, total);
  // The run learns (so the comparison is of a run that moves).
  EXPECT_LT(full[total - 1].loss, full[0].loss);

  int loaded4 = -1, loaded2 = -1;
  const History at4 =
      RunSegment({.world = 4, .until = total, .load = dir, .loaded_step = &loaded4}, total);
  EXPECT_EQ(loaded4, kSavedSteps);
  ExpectBitIdentical(at4[kSavedSteps - 1], full[kSavedSteps - 1], false, "world 4, after load");
  for (int s = kSavedSteps; s < total; ++s) {
    ExpectBitIdentical(at4[s], full[s], true, absl::StrCat("world 4, step ", s));
  }

  const History at2 =
      RunSegment({.world = 2, .until = total, .load = dir, .loaded_step = &loaded2}, total);
  EXPECT_EQ(loaded2, kSavedSteps);
  ExpectBitIdentical(at2[kSavedSteps - 1], full[kSavedSteps - 1], false, "world 2, after load");
  // World 2 reduce-scatters sums of 2 partial gradients of 24 examples instead of 4 of 12: the
  // same sum in another order, each gradient element off by a few f32 roundings (~1e-7 relative).
  // AdamW divides m by sqrt(v): its update of an element is at most ~lr = 3e-3 and moves by at
  // most ~lr times the gradient's relative error, except where v is tiny (a gradient near 0,
  // where cancellation makes the relative error large but the update's absolute size stays
  // bounded by lr). So after n steps every parameter is within n * lr * 1e-3 of the
  // uninterrupted run's (the 1e-3 a generous bound on that relative perturbation of an update,
  // which the measured differences stay far below); m and v are sums of gradients and their
  // squares: relative 1e-4 plus an absolute floor for elements near 0. Losses: relative 1e-5.
  double worst[3] = {0, 0, 0};
  size_t differing = 0;
  for (int s = kSavedSteps; s < total; ++s) {
    const int n = s - kSavedSteps + 1;
    EXPECT_NEAR(at2[s].loss, full[s].loss, 1e-5 * std::abs(full[s].loss)) << "step " << s;
    for (int w = 0; w < 3; ++w) {
      for (size_t u = 0; u < full[s].state[w].size(); ++u) {
        for (size_t t = 0; t < full[s].state[w][u].size(); ++t) {
          const std::vector<float>& want = full[s].state[w][u][t];
          const std::vector<float>& got = at2[s].state[w][u][t];
          size_t bad = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
            const double tolerance =
                w == 0 ? n * 3e-3 * 1e-3 : 1e-4 * std::abs(want[i]) + (w == 1 ? 1e-7 : 1e-12);
            worst[w] = std::max(worst[w], diff / tolerance);
            differing += diff != 0;
            bad += !(diff <= tolerance);
          }
          EXPECT_EQ(bad, 0u) << "world 2, step " << s << " state " << w << " unit " << u
                             << " tensor " << t;
        }
      }
    }
  }
  std::cout << "world 2 vs 4: the largest difference is " << worst[0] << ", " << worst[1] << ", "
            << worst[2] << " of the tolerance (parameters, m, v); " << differing
            << " elements differ at all\n";
}

}  // namespace
}  // namespace shardline::examples
