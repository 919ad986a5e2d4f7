// FlatParameter over the local backend, ranks as threads (each with a gather and a reduce host
// stream and a caller stream for compute):
//   * the gathered tensors equal the full tensors cast master → param dtype, bit for bit;
//   * the reduced gradient shard equals a double-precision reference (sum or average of every
//     rank's full gradient, sliced to the shard) within the policy's dtype tolerance, for 1-8
//     ranks and six precision policies;
//   * 4 micro-batches (accumulated unsharded then reduced once, or reduced 4 times into the
//     shard) equal one big batch; a 2 x 2 hybrid mesh averages over all 4 ranks;
//   * illegal calls are FailedPrecondition naming the unit, the call and the state;
//   * the pool holds the unsharded buffer only from Gather to Reshard + its event.
#include "scheduler/flat_parameter.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "collectives/process_mesh.h"
#include "runtime/caching_pool.h"
#include "runtime/check.h"
#include "testing/typed_values.h"
#include "tests/runtime/random_layout.h"

namespace shardline {
namespace {

using ::shardline::testing::GetElement;
using ::shardline::testing::SetElement;
using ::shardline::testing::UniformInt;

constexpr absl::Duration kTimeout = absl::Seconds(20);

absl::Time Deadline() { return absl::Now() + kTimeout; }

// ---- Fixtures ------------------------------------------------------------------------------

// What one rank owns: streams and allocators, declared before the unit so they outlive it.
struct RankRig {
  RankRig()
      : gather(*CreateHostStream({.name = "gather", .wait_timeout = kTimeout})),
        reduce(*CreateHostStream({.name = "reduce", .wait_timeout = kTimeout})),
        compute(*CreateCallerStream({.name = "compute", .wait_timeout = kTimeout})),
        backing(CreateHostAllocator(64, "backing")),
        pool(std::make_unique<CachingPool>(*backing, CachingPoolOptions{.name = "pool"})),
        shards(CreateHostAllocator(64, "shards")) {}

  FlatParameterOptions Options(std::string name = "unit") {
    return {.unsharded_pool = pool.get(), .shard_allocator = shards.get(), .name = name};
  }

  std::unique_ptr<Stream> gather, reduce, compute;
  std::unique_ptr<Allocator> backing;
  std::unique_ptr<CachingPool> pool;
  std::unique_ptr<Allocator> shards;
};

// Runs fn(rank) on `n` threads and joins them.
void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

constexpr DType kFloatDTypes[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};

// Up to 10 floating tensors of up to 400 elements, some tied, random alignment and block size.
FlatLayout RandomFloatLayout(std::mt19937_64& rng, int shards, DType element_dtype) {
  std::vector<TensorSpec> specs;
  const int count = UniformInt(rng, 1, 10);
  for (int i = 0; i < count; ++i) {
    TensorSpec spec;
    if (i > 0 && UniformInt(rng, 0, 7) == 0) {
      const TensorSpec& target = specs[UniformInt(rng, 0, i - 1)];
      spec = {absl::StrCat("tie", i), target.shape, target.dtype, target.name};
    } else {
      spec = {absl::StrCat("t", i), testing::RandomShape(rng), kFloatDTypes[UniformInt(rng, 0, 3)],
              ""};
    }
    specs.push_back(std::move(spec));
  }
  static constexpr size_t kAlignments[] = {8, 16, 16, 64};
  static constexpr size_t kBlocks[] = {1, 1, 3, 8};
  FlatLayoutOptions options{.num_shards = shards,
                            .element_dtype = element_dtype,
                            .alignment_bytes = kAlignments[UniformInt(rng, 0, 3)],
                            .block_elements = kBlocks[UniformInt(rng, 0, 3)]};
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, options);
  SL_CHECK(layout.ok());
  return *std::move(layout);
}

// The full tensors in their spec dtypes (ties and empty tensors get no data), values in [-1, 1].
struct FullTensors {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<const void*> pointers;
};

FullTensors MakeFullTensors(const FlatLayout& layout, std::mt19937_64& rng) {
  FullTensors full;
  full.bytes.resize(layout.num_tensors());
  full.pointers.assign(layout.num_tensors(), nullptr);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (int t = 0; t < layout.num_tensors(); ++t) {
    const FlatTensor& tensor = layout.tensor(t);
    if (tensor.is_tie() || tensor.numel == 0) continue;
    full.bytes[t].resize(tensor.numel * DTypeSize(tensor.spec.dtype));
    for (size_t i = 0; i < tensor.numel; ++i) {
      SetElement(tensor.spec.dtype, full.bytes[t].data(), i, dist(rng));
    }
    full.pointers[t] = full.bytes[t].data();
  }
  return full;
}

// `value` rounded to `dtype` (one rounding from a float, as the kernels do it).
double RoundTo(DType dtype, double value) {
  uint8_t bytes[8];
  SetElement(dtype, bytes, 0, value);
  return GetElement(dtype, bytes, 0);
}

// A deterministic gradient value in [-1, 1] per (seed, rank, micro-batch, tensor, element).
double GradValue(uint64_t seed, int rank, int micro, int tensor, size_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) * 1000003ull +
               static_cast<uint64_t>(micro) * 7919ull + static_cast<uint64_t>(tensor) * 104729ull +
               index * 31ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
}

// Unit roundoff of a floating dtype.
double Roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return std::ldexp(1.0, -53);
    case DType::kF32:
      return std::ldexp(1.0, -24);
    case DType::kF16:
      return std::ldexp(1.0, -11);
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    default:
      return 0;
  }
}

// Checks that every tensor view of the gathered unit equals the full tensor cast to the master
// and then to the param dtype, bit for bit.
void ExpectGathered(const FlatParameter& unit, const FullTensors& full) {
  const FlatLayout& layout = unit.layout();
  const MixedPrecisionPolicy& policy = unit.policy();
  for (int t = 0; t < layout.num_tensors(); ++t) {
    absl::StatusOr<TensorView> view = unit.View(t);
    ASSERT_TRUE(view.ok()) << view.status();
    const FlatTensor& tensor = layout.tensor(t);
    EXPECT_EQ(view->name, tensor.spec.name);
    EXPECT_EQ(view->numel, tensor.numel);
    EXPECT_EQ(view->dtype, policy.param_dtype);
    EXPECT_TRUE(std::equal(view->shape.begin(), view->shape.end(), tensor.spec.shape.begin(),
                           tensor.spec.shape.end()));
    if (tensor.numel == 0) {
      EXPECT_EQ(view->data, nullptr);
      continue;
    }
    const int storage = tensor.storage;
    const DType spec_dtype = layout.tensor(storage).spec.dtype;
    for (size_t i = 0; i < tensor.numel; ++i) {
      const double original = GetElement(spec_dtype, full.pointers[storage], i);
      const double expected = RoundTo(policy.param_dtype, RoundTo(policy.master_dtype, original));
      const double got = GetElement(policy.param_dtype, view->data, i);
      if (got != expected) {
        ADD_FAILURE() << "rank " << unit.shard_rank() << " tensor " << tensor.spec.name
                      << " element " << i << ": got " << got << ", expected " << expected
                      << " (original " << original << ", " << policy << ")";
        return;
      }
    }
  }
}

// Writes (or, with `accumulate`, adds) rank `rank`'s micro-batch `micro` gradient into the
// unsharded gradient (storage tensors only: a tie's gradient is its target's).
void WriteGrad(FlatParameter& unit, uint64_t seed, int rank, int micro, bool accumulate) {
  const FlatLayout& layout = unit.layout();
  for (int t = 0; t < layout.num_tensors(); ++t) {
    if (layout.tensor(t).is_tie() || layout.tensor(t).numel == 0) continue;
    absl::StatusOr<TensorView> view = unit.GradView(t);
    ASSERT_TRUE(view.ok()) << view.status();
    for (size_t i = 0; i < view->numel; ++i) {
      double v = GradValue(seed, rank, micro, t, i);
      if (accumulate) v += GetElement(view->dtype, view->data, i);
      SetElement(view->dtype, view->data, i, v);
    }
  }
}

// The reference sharded gradient of shard `shard`: the sum (or average over `divisor` ranks)
// over `ranks` and micro-batches [0, micros) of the gradients as written in param dtype,
// computed in double; `magnitude` gets the matching sums of absolute values (for tolerances).
void ReferenceShardGrad(const FlatLayout& layout, int shard, DType param_dtype, uint64_t seed,
                        const std::vector<int>& ranks, int micros, double divisor,
                        std::vector<double>& reference, std::vector<double>& magnitude) {
  reference.assign(layout.shard_elements(), 0.0);
  magnitude.assign(layout.shard_elements(), 0.0);
  for (const ShardSlice& slice : layout.ShardSlices(shard)) {
    for (size_t k = 0; k < slice.length; ++k) {
      double sum = 0, abs_sum = 0;
      for (int r : ranks) {
        for (int m = 0; m < micros; ++m) {
          const double q =
              RoundTo(param_dtype, GradValue(seed, r, m, slice.tensor, slice.tensor_offset + k));
          sum += q;
          abs_sum += std::abs(q);
        }
      }
      reference[slice.shard_offset + k] = sum / divisor;
      magnitude[slice.shard_offset + k] = abs_sum / divisor;
    }
  }
}

// Compares the unit's sharded gradient with the reference: |got - ref| <= tolerance * magnitude
// for tensor elements, exactly zero for padding.
void ExpectShardGrad(const FlatParameter& unit, const std::vector<double>& reference,
                     const std::vector<double>& magnitude, double tolerance) {
  absl::StatusOr<FlatShardView> grad = unit.ShardGrad();
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->dtype, unit.policy().sharded_grad_dtype());
  ASSERT_EQ(grad->elements, reference.size());
  const FlatLayout& layout = unit.layout();
  std::vector<bool> is_tensor(grad->elements, false);
  for (const ShardSlice& slice : layout.ShardSlices(unit.shard_rank())) {
    for (size_t k = 0; k < slice.length; ++k) is_tensor[slice.shard_offset + k] = true;
  }
  for (size_t i = 0; i < grad->elements; ++i) {
    const double got = GetElement(grad->dtype, grad->data, i);
    const double allowed = is_tensor[i] ? tolerance * magnitude[i] : 0.0;
    if (!(std::abs(got - reference[i]) <= allowed)) {
      ADD_FAILURE() << "shard " << unit.shard_rank() << " element " << i
                    << (is_tensor[i] ? "" : " (padding)") << ": got " << got << ", expected "
                    << reference[i] << " +- " << allowed << " (" << unit.policy() << ")";
      return;
    }
  }
}

// Relative tolerance of a reduction of `world` ranks' gradients, `micros` micro-batches each.
double GradTolerance(const MixedPrecisionPolicy& policy, int world, int micros) {
  return (world + 4) * Roundoff(policy.reduce_dtype) +
         (micros + 1) * (Roundoff(policy.param_dtype) + Roundoff(policy.sharded_grad_dtype()));
}

struct NamedPolicy {
  const char* name;
  MixedPrecisionPolicy policy;
};

const NamedPolicy kPolicies[] = {
    {"f32_f32_f32", {DType::kF32, DType::kF32, DType::kF32, false}},
    {"bf16_f32_f32", {DType::kBF16, DType::kF32, DType::kF32, false}},
    {"bf16_bf16_f32", {DType::kBF16, DType::kBF16, DType::kF32, false}},
    {"f16_f32_f32", {DType::kF16, DType::kF32, DType::kF32, false}},
    {"bf16_bf16_f32_keep", {DType::kBF16, DType::kBF16, DType::kF32, true}},
    // Reduce narrower than param: a cast down before, and an add through a temporary after.
    {"f32_bf16_f32", {DType::kF32, DType::kBF16, DType::kF32, false}},
};

// ---- Gather and reduce-scatter against the unsharded reference ---------------------------

struct Case {
  int ranks;
  int policy;  // index into kPolicies
  ReduceOp op;
};

class FlatParameterCollectiveTest : public ::testing::TestWithParam<Case> {};

TEST_P(FlatParameterCollectiveTest, GatherAndReduceMatchTheUnshardedReference) {
  const int n = GetParam().ranks;
  const int policy_index = GetParam().policy;
  const ReduceOp op = GetParam().op;
  const MixedPrecisionPolicy& policy = kPolicies[policy_index].policy;
  for (uint64_t seed = 1; seed <= 2; ++seed) {
    std::mt19937_64 rng(seed * 1000 + n * 10 + policy_index);
    const FlatLayout layout = RandomFloatLayout(rng, n, policy.master_dtype);
    const FullTensors full = MakeFullTensors(layout, rng);
    auto comms = *CreateLocalCommunicators(n, {.timeout = kTimeout});
    std::vector<int> all_ranks(n);
    for (int r = 0; r < n; ++r) all_ranks[r] = r;
    RunRanks(n, [&](int r) {
      RankRig rig;
      absl::StatusOr<std::unique_ptr<FlatParameter>> created =
          FlatParameter::Create(layout, r, policy, rig.Options());
      ASSERT_TRUE(created.ok()) << created.status();
      FlatParameter& unit = **created;
      ASSERT_TRUE(unit.SetShardFromTensors(full.pointers).ok());

      absl::StatusOr<Work> work = unit.Gather(*comms[r], *rig.gather);
      ASSERT_TRUE(work.ok()) << work.status();
      ASSERT_EQ(unit.state(), FlatParameterState::kGathering);
      ASSERT_TRUE(unit.WaitGathered(*rig.compute).ok());
      ASSERT_EQ(unit.state(), FlatParameterState::kUnsharded);
      ExpectGathered(unit, full);

      ASSERT_TRUE(unit.PrepareGrad(*rig.compute).ok());
      WriteGrad(unit, seed, r, 0, /*accumulate=*/false);
      absl::StatusOr<std::shared_ptr<Event>> ready = RecordEvent(*rig.compute);
      ASSERT_TRUE(ready.ok());
      absl::StatusOr<std::shared_ptr<Event>> reduced =
          unit.ReduceGrad(*comms[r], nullptr, *rig.reduce, *ready, {.op = op});
      ASSERT_TRUE(reduced.ok()) << reduced.status();
      ASSERT_EQ(unit.state(), FlatParameterState::kReducing);
      ASSERT_TRUE(unit.WaitReduced(Deadline()).ok());
      ASSERT_EQ(unit.state(), FlatParameterState::kSharded);

      std::vector<double> reference, magnitude;
      ReferenceShardGrad(layout, r, policy.param_dtype, seed, all_ranks, 1,
                         op == ReduceOp::kAvg ? n : 1, reference, magnitude);
      ExpectShardGrad(unit, reference, magnitude, GradTolerance(policy, n, 1));
    });
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int n : {1, 2, 3, 4, 5, 8}) {
    for (int p = 0; p < static_cast<int>(std::size(kPolicies)); ++p) {
      for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum}) cases.push_back({n, p, op});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(RanksPoliciesOps, FlatParameterCollectiveTest,
                         ::testing::ValuesIn(AllCases()), [](const auto& info) {
                           return absl::StrCat(info.param.ranks, "ranks_",
                                               kPolicies[info.param.policy].name, "_",
                                               ReduceOpName(info.param.op));
                         });

// ---- Gradient accumulation over micro-batches --------------------------------------------

class FlatParameterAccumulationTest : public ::testing::TestWithParam<int> {};

// 4 micro-batches, accumulated in the unsharded gradient (no_sync) and reduced once, or reduced
// after each into the sharded gradient: both equal the one big batch (the sum over micro-batches
// of the rank-average). Then ZeroShardGrad starts over.
TEST_P(FlatParameterAccumulationTest, FourMicroBatchesEqualOneBigBatch) {
  const MixedPrecisionPolicy& policy = kPolicies[GetParam()].policy;
  constexpr int kRanks = 3;
  constexpr int kMicros = 4;
  std::mt19937_64 rng(77 + GetParam());
  const FlatLayout layout = RandomFloatLayout(rng, kRanks, policy.master_dtype);
  const FullTensors full = MakeFullTensors(layout, rng);
  auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
  const std::vector<int> all_ranks = {0, 1, 2};
  RunRanks(kRanks, [&](int r) {
    RankRig rig;
    for (const bool no_sync : {true, false}) {
      SCOPED_TRACE(no_sync ? "no_sync" : "reduce every micro-batch");
      const uint64_t seed = no_sync ? 11 : 12;
      auto unit = *FlatParameter::Create(layout, r, policy, rig.Options());
      ASSERT_TRUE(unit->SetShardFromTensors(full.pointers).ok());
      for (int m = 0; m < kMicros; ++m) {
        ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
        ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
        ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
        WriteGrad(*unit, seed, r, m, /*accumulate=*/true);
        std::shared_ptr<Event> ready = *RecordEvent(*rig.compute);
        if (no_sync && m + 1 < kMicros) {
          ASSERT_TRUE(unit->Reshard(ready).ok());
          EXPECT_TRUE(unit->has_unsharded_grad());
          continue;
        }
        ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, ready).ok());
        EXPECT_FALSE(unit->has_unsharded_grad());
        ASSERT_TRUE(unit->WaitReduced(*rig.compute).ok());
      }
      std::vector<double> reference, magnitude;
      ReferenceShardGrad(layout, r, policy.param_dtype, seed, all_ranks, kMicros, kRanks, reference,
                         magnitude);
      ExpectShardGrad(*unit, reference, magnitude, GradTolerance(policy, kRanks, kMicros));

      // zero_grad, then one more step: only its gradient remains.
      ASSERT_TRUE(unit->ZeroShardGrad(*rig.compute).ok());
      absl::StatusOr<FlatShardView> zeroed = unit->ShardGrad();
      ASSERT_TRUE(zeroed.ok());
      for (size_t i = 0; i < zeroed->elements; ++i) {
        ASSERT_EQ(GetElement(zeroed->dtype, zeroed->data, i), 0.0);
      }
      ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
      ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
      ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
      WriteGrad(*unit, seed + 100, r, 0, /*accumulate=*/false);
      ASSERT_TRUE(
          unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, *RecordEvent(*rig.compute)).ok());
      ASSERT_TRUE(unit->WaitReduced(Deadline()).ok());
      ReferenceShardGrad(layout, r, policy.param_dtype, seed + 100, all_ranks, 1, kRanks, reference,
                         magnitude);
      ExpectShardGrad(*unit, reference, magnitude, GradTolerance(policy, kRanks, 1));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Policies, FlatParameterAccumulationTest,
                         ::testing::Range(0, static_cast<int>(std::size(kPolicies))),
                         [](const auto& info) { return kPolicies[info.param].name; });

// ---- Hybrid sharding ----------------------------------------------------------------------

// A 2 x 2 mesh: parameters sharded over each row, gradients averaged (or summed) over all four
// ranks; the two replicas of a shard end up bit-identical.
TEST(FlatParameterHybridTest, TwoByTwoMeshReducesOverAllRanks) {
  constexpr int kWorld = 4;
  constexpr int kShard = 2;
  for (int policy_index : {0, 2}) {
    for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum}) {
      SCOPED_TRACE(absl::StrCat(kPolicies[policy_index].name, " ", ReduceOpName(op)));
      const MixedPrecisionPolicy& policy = kPolicies[policy_index].policy;
      std::mt19937_64 rng(5 + policy_index);
      const FlatLayout layout = RandomFloatLayout(rng, kShard, policy.master_dtype);
      const FullTensors full = MakeFullTensors(layout, rng);
      auto world = *CreateLocalCommunicators(kWorld, {.timeout = kTimeout});
      const std::vector<int> all_ranks = {0, 1, 2, 3};
      std::vector<std::vector<double>> results(kWorld);
      RunRanks(kWorld, [&](int r) {
        absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(world[r], kShard, Deadline());
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        RankRig rig;
        auto unit = *FlatParameter::Create(layout, mesh->shard_rank(), policy, rig.Options());
        ASSERT_TRUE(unit->SetShardFromTensors(full.pointers).ok());
        ASSERT_TRUE(unit->Gather(*mesh->shard(), *rig.gather).ok());
        ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
        ExpectGathered(*unit, full);
        ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
        WriteGrad(*unit, 9, r, 0, /*accumulate=*/false);
        ASSERT_TRUE(unit->ReduceGrad(*mesh->shard(), mesh->replicate().get(), *rig.reduce,
                                     *RecordEvent(*rig.compute), {.op = op})
                        .ok());
        ASSERT_TRUE(unit->WaitReduced(Deadline()).ok());
        std::vector<double> reference, magnitude;
        ReferenceShardGrad(layout, mesh->shard_rank(), policy.param_dtype, 9, all_ranks, 1,
                           op == ReduceOp::kAvg ? kWorld : 1, reference, magnitude);
        ExpectShardGrad(*unit, reference, magnitude, GradTolerance(policy, kWorld, 1));
        const FlatShardView grad = *unit->ShardGrad();
        for (size_t i = 0; i < grad.elements; ++i) {
          results[r].push_back(GetElement(grad.dtype, grad.data, i));
        }
      });
      // Ranks r and r + 2 hold the same shard (column r % 2).
      EXPECT_EQ(results[0], results[2]);
      EXPECT_EQ(results[1], results[3]);
    }
  }
}

// ---- State machine ------------------------------------------------------------------------

FlatLayout SmallLayout(int shards, DType element_dtype = DType::kF32) {
  return *FlatLayout::Create({{"w", {3, 5}, DType::kF32, ""},
                              {"b", {5}, DType::kBF16, ""},
                              {"w_tied", {3, 5}, DType::kF32, "w"}},
                             {.num_shards = shards, .element_dtype = element_dtype});
}

void ExpectWrongState(const absl::Status& status, absl::string_view call, absl::string_view state) {
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "'block7'")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), call)) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("state ", state))) << status;
}

TEST(FlatParameterStateTest, IllegalTransitionsAreFailedPrecondition) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  Communicator& comm = *comms[0];
  RankRig rig;
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  auto unit = *FlatParameter::Create(SmallLayout(1), 0, policy, rig.Options("block7"));
  std::shared_ptr<Event> none;

  // sharded
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
  ExpectWrongState(unit->View(0).status(), "View()", "sharded");
  ExpectWrongState(unit->View("w").status(), "View()", "sharded");
  ExpectWrongState(unit->GradView(0).status(), "GradView()", "sharded");
  ExpectWrongState(unit->WaitGathered(*rig.compute), "WaitGathered()", "sharded");
  ExpectWrongState(unit->Reshard(none), "Reshard()", "sharded");
  ExpectWrongState(unit->PrepareGrad(*rig.compute), "PrepareGrad()", "sharded");
  ExpectWrongState(unit->ReduceGrad(comm, nullptr, *rig.reduce, none).status(), "ReduceGrad()",
                   "sharded");
  ExpectWrongState(unit->WaitReduced(*rig.compute), "WaitReduced()", "sharded");
  ExpectWrongState(unit->WaitReduced(Deadline()), "WaitReduced()", "sharded");
  EXPECT_EQ(unit->ShardGrad().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(unit->ZeroShardGrad(*rig.compute).ok());  // no gradient: nothing to zero
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);

  // gathering
  ASSERT_TRUE(unit->Gather(comm, *rig.gather).ok());
  EXPECT_EQ(unit->state(), FlatParameterState::kGathering);
  ExpectWrongState(unit->Gather(comm, *rig.gather).status(), "Gather()", "gathering");
  ExpectWrongState(unit->Reshard(none), "Reshard()", "gathering");
  ExpectWrongState(unit->View(0).status(), "View()", "gathering");
  ExpectWrongState(unit->PrepareGrad(*rig.compute), "PrepareGrad()", "gathering");
  ExpectWrongState(unit->ReduceGrad(comm, nullptr, *rig.reduce, none).status(), "ReduceGrad()",
                   "gathering");
  ExpectWrongState(unit->SetShardFromTensors({nullptr, nullptr, nullptr}), "SetShardFromTensors()",
                   "gathering");
  EXPECT_EQ(unit->state(), FlatParameterState::kGathering);

  // unsharded
  ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
  EXPECT_EQ(unit->state(), FlatParameterState::kUnsharded);
  ExpectWrongState(unit->Gather(comm, *rig.gather).status(), "Gather()", "unsharded");
  ExpectWrongState(unit->WaitGathered(*rig.compute), "WaitGathered()", "unsharded");
  ExpectWrongState(unit->WaitReduced(*rig.compute), "WaitReduced()", "unsharded");
  absl::Status no_grad = unit->GradView(0).status();
  EXPECT_EQ(no_grad.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(no_grad.message(), "PrepareGrad()")) << no_grad;
  no_grad = unit->ReduceGrad(comm, nullptr, *rig.reduce, none).status();
  EXPECT_EQ(no_grad.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(no_grad.message(), "no unsharded gradient")) << no_grad;
  EXPECT_EQ(unit->View(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unit->View(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unit->View("nope").status().code(), absl::StatusCode::kNotFound);
  // A tie's view aliases its target.
  EXPECT_EQ(unit->View("w_tied")->data, unit->View("w")->data);
  EXPECT_TRUE(unit->View("b").ok());
  ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
  ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());  // idempotent within a step
  EXPECT_TRUE(unit->GradView("b").ok());
  // Bad arguments leave the unit unsharded.
  EXPECT_EQ(
      unit->ReduceGrad(comm, nullptr, *rig.reduce, none, {.op = ReduceOp::kMax}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unit->state(), FlatParameterState::kUnsharded);

  // reducing
  ASSERT_TRUE(unit->ReduceGrad(comm, nullptr, *rig.reduce, *RecordEvent(*rig.compute)).ok());
  EXPECT_EQ(unit->state(), FlatParameterState::kReducing);
  ExpectWrongState(unit->Gather(comm, *rig.gather).status(), "Gather()", "reducing");
  ExpectWrongState(unit->Reshard(none), "Reshard()", "reducing");
  ExpectWrongState(unit->View(0).status(), "View()", "reducing");
  ExpectWrongState(unit->ShardGrad().status(), "ShardGrad()", "reducing");
  ExpectWrongState(unit->ZeroShardGrad(*rig.compute), "ZeroShardGrad()", "reducing");
  ExpectWrongState(unit->ReleaseShardGrad(none), "ReleaseShardGrad()", "reducing");
  ExpectWrongState(unit->ReduceGrad(comm, nullptr, *rig.reduce, none).status(), "ReduceGrad()",
                   "reducing");

  // back to sharded
  ASSERT_TRUE(unit->WaitReduced(Deadline()).ok());
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
  EXPECT_TRUE(unit->ShardGrad().ok());
  ASSERT_TRUE(unit->ReleaseShardGrad(none).ok());
  EXPECT_FALSE(unit->has_shard_grad());
  EXPECT_EQ(unit->ShardGrad().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(FlatParameterStateTest, CreateRejectsInvalidArguments) {
  RankRig rig;
  const MixedPrecisionPolicy f32;
  auto expect_invalid = [](const absl::Status& status, absl::string_view needle) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), needle)) << status;
  };
  expect_invalid(
      FlatParameter::Create(SmallLayout(1), 0, {DType::kI32, DType::kF32, DType::kF32, false},
                            rig.Options())
          .status(),
      "param_dtype");
  expect_invalid(FlatParameter::Create(SmallLayout(1, DType::kF64), 0, f32, rig.Options()).status(),
                 "master_dtype is f32");
  expect_invalid(FlatParameter::Create(SmallLayout(2), 2, f32, rig.Options()).status(),
                 "shard_rank 2");
  expect_invalid(FlatParameter::Create(SmallLayout(2), -1, f32, rig.Options()).status(),
                 "shard_rank -1");
  expect_invalid(
      FlatParameter::Create(SmallLayout(1), 0, f32, {.unsharded_pool = nullptr}).status(),
      "unsharded_pool is null");
  const FlatLayout ints =
      *FlatLayout::Create({{"steps", {4}, DType::kI64, ""}}, {.element_dtype = DType::kF32});
  expect_invalid(FlatParameter::Create(ints, 0, f32, rig.Options()).status(), "'steps'");
  // The shard allocator defaults to the pool.
  auto unit = FlatParameter::Create(SmallLayout(1), 0, f32, {.unsharded_pool = rig.pool.get()});
  ASSERT_TRUE(unit.ok()) << unit.status();
  EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>((*unit)->layout().shard_bytes()));
}

TEST(FlatParameterStateTest, MismatchedCommunicatorOrTensorsAreInvalidArgument) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  auto unit = *FlatParameter::Create(SmallLayout(2), 1, {}, rig.Options("block7"));
  const absl::Status status = unit->Gather(*comms[0], *rig.gather).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "has 1 ranks but the layout has 2 shards"))
      << status;
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
  EXPECT_EQ(rig.pool->stats().current_bytes, 0);

  EXPECT_EQ(unit->SetShardFromTensors({nullptr}).code(), absl::StatusCode::kInvalidArgument);
  // Shard 1 holds elements of "w" and "b": a null pointer for either is rejected; ties may be
  // null.
  const float w[15] = {};
  const uint16_t b[5] = {};
  EXPECT_EQ(unit->SetShardFromTensors({nullptr, b, nullptr}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(unit->SetShardFromTensors({w, b, nullptr}).ok());
}

// A failed gather (the communicator was aborted) leaves the unit sharded and frees the buffer.
TEST(FlatParameterStateTest, FailedGatherLeavesTheUnitSharded) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  auto unit = *FlatParameter::Create(SmallLayout(1), 0, {}, rig.Options());
  comms[0]->Abort(absl::InternalError("test abort"));
  const absl::Status status = unit->Gather(*comms[0], *rig.gather).status();
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(absl::StrContains(status.message(), "test abort")) << status;
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
  ASSERT_TRUE(rig.gather->Synchronize(Deadline()).ok());
  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, 0);
}

// ---- Memory ---------------------------------------------------------------------------------

// Holds a host stream's work until opened (bounded: it gives up after kTimeout).
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  absl::Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(20), [&] { return open_; })) {
      return absl::DeadlineExceededError("gate never opened");
    }
    return absl::OkStatus();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

TEST(FlatParameterMemoryTest, UnshardedBufferLivesFromGatherToReshardPlusEvent) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  auto blocker = *CreateHostStream({.name = "reader", .wait_timeout = kTimeout});
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  auto unit = *FlatParameter::Create(SmallLayout(1), 0, policy, rig.Options());
  const int64_t unsharded_bytes = unit->layout().total_elements() * DTypeSize(DType::kBF16);
  const int64_t shard_bytes = rig.shards->stats().current_bytes;
  EXPECT_EQ(shard_bytes, static_cast<int64_t>(unit->layout().shard_bytes()));
  EXPECT_EQ(rig.pool->stats().current_bytes, 0);

  for (int step = 0; step < 2; ++step) {
    rig.pool->ResetStats();
    // One allocation per gather: the all-gather's input is the buffer's own slice.
    ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
    EXPECT_EQ(rig.pool->stats().current_bytes, unsharded_bytes);
    EXPECT_EQ(rig.pool->stats().total_allocations, 1);
    ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());

    // A reader on another stream is still using the views: Reshard does not free the buffer.
    Gate gate;
    ASSERT_TRUE(blocker->Enqueue([&gate] { return gate.Wait(); }).ok());
    std::shared_ptr<Event> last_use = *RecordEvent(*blocker);
    ASSERT_TRUE(unit->Reshard(last_use).ok());
    EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, unsharded_bytes);
    gate.Open();
    ASSERT_TRUE(last_use->Synchronize(Deadline()).ok());
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, 0);
    EXPECT_EQ(rig.pool->stats().peak_bytes, unsharded_bytes);
  }
  // The shards were never touched by the gathers.
  EXPECT_EQ(rig.shards->stats().current_bytes, shard_bytes);
}

TEST(FlatParameterMemoryTest, ReductionReturnsEverythingButTheShards) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  auto unit = *FlatParameter::Create(SmallLayout(1), 0, policy, rig.Options());
  const int64_t total = unit->layout().total_elements();
  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
  ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
  EXPECT_EQ(rig.pool->stats().current_bytes, 2 * total * 2);  // parameters + gradient, bf16
  ASSERT_TRUE(unit->ReduceGrad(*comms[0], nullptr, *rig.reduce, *RecordEvent(*rig.compute)).ok());
  ASSERT_TRUE(unit->WaitReduced(Deadline()).ok());
  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, 0);
  // Peak: parameters + bf16 gradient + its f32 copy for the reduction.
  EXPECT_EQ(rig.pool->stats().peak_bytes, total * (2 + 2 + 4));
  // Master shard + f32 sharded gradient.
  const int64_t shard_elements = unit->layout().shard_elements();
  EXPECT_EQ(rig.shards->stats().current_bytes, 2 * shard_elements * 4);
  ASSERT_TRUE(unit->ReleaseShardGrad(nullptr).ok());
  rig.shards->Collect();
  EXPECT_EQ(rig.shards->stats().current_bytes, shard_elements * 4);
}

// Destroying a unit in any state returns its memory once the streams are done with it.
TEST(FlatParameterMemoryTest, DestroyingInAnyStateFreesEverything) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  for (int stop = 0; stop < 4; ++stop) {
    {
      auto unit = *FlatParameter::Create(SmallLayout(1), 0, {}, rig.Options());
      ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
      if (stop >= 1) {
        ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
      }
      if (stop >= 2) {
        ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
      }
      if (stop >= 3) {
        ASSERT_TRUE(unit->ReduceGrad(*comms[0], nullptr, *rig.reduce, nullptr).ok());
      }
    }
    ASSERT_TRUE(rig.gather->Synchronize(Deadline()).ok());
    ASSERT_TRUE(rig.reduce->Synchronize(Deadline()).ok());
    rig.pool->Collect();
    rig.shards->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, 0) << stop;
    EXPECT_EQ(rig.shards->stats().current_bytes, 0) << stop;
  }
}

// A unit whose tensors have no elements: every operation works on empty buffers.
TEST(FlatParameterMemoryTest, EmptyUnitRunsTheWholeCycle) {
  const int n = 2;
  const FlatLayout layout =
      *FlatLayout::Create({{"empty", {0, 3}, DType::kF32, ""}}, {.num_shards = n});
  ASSERT_EQ(layout.total_elements(), 0u);
  auto comms = *CreateLocalCommunicators(n, {.timeout = kTimeout});
  RunRanks(n, [&](int r) {
    RankRig rig;
    auto unit = *FlatParameter::Create(layout, r, {}, rig.Options());
    ASSERT_TRUE(unit->SetShardFromTensors({nullptr}).ok());
    ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
    ASSERT_TRUE(unit->WaitGathered(*rig.compute).ok());
    EXPECT_EQ(unit->View("empty")->data, nullptr);
    ASSERT_TRUE(unit->PrepareGrad(*rig.compute).ok());
    EXPECT_TRUE(unit->has_unsharded_grad());
    ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, nullptr).ok());
    ASSERT_TRUE(unit->WaitReduced(Deadline()).ok());
    EXPECT_EQ(unit->ShardGrad()->elements, 0u);
  });
}

}  // namespace
}  // namespace shardline
