// FlatParameter over the local backend, ranks as threads. Each rank has a gather and a reduce
// host stream and a compute stream, which is either a caller stream (the framework computes on
// the calling thread) or a host stream (asynchronous, as a GPU's is). The framework's compute —
// reading the views, writing the gradient, the optimizer reading the sharded gradient — is always
// work enqueued on the compute stream, so that an ordering bug shows up with a host stream.
//   * the gathered tensors equal the full tensors cast master → param dtype, bit for bit;
//   * the reduced gradient shard equals a double-precision reference (sum or average of every
//     rank's full gradient, sliced to the shard) within the policy's dtype tolerance, for 1-8
//     ranks and six precision policies;
//   * 4 micro-batches (accumulated unsharded then reduced once, or reduced 4 times into the
//     shard) equal one big batch; a 2 x 2 hybrid mesh averages over all 4 ranks, also with the
//     reduction split over three streams;
//   * illegal calls are FailedPrecondition naming the unit, the call and the state;
//   * a unit acquired by two streams keeps its buffer until the last release;
//   * the pool holds the unsharded buffer from Gather until the last reader (including work
//     already queued on an acquiring stream when the unit reshards or is destroyed);
//   * a gather and a reduction overlap on one communicator in either issue order, and a
//     training loop reuses the pool's blocks stream-ordered without blocking the host.
#include "scheduler/flat_parameter.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "collectives/process_mesh.h"
#include "runtime/caching_pool.h"
#include "runtime/check.h"
#include "runtime/trace.h"
#include "testing/typed_values.h"
#include "tests/common/gate.h"
#include "tests/common/rank_threads.h"
#include "tests/common/status_and_hash.h"
#include "tests/runtime/random_layout.h"

namespace shardline {
namespace {

using ::shardline::testing::Gate;
using ::shardline::testing::GetElement;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::SetElement;
using ::shardline::testing::UniformInt;

constexpr absl::Duration kTimeout = absl::Seconds(20);

absl::Time Deadline() { return absl::Now() + kTimeout; }

// ASSERT_TRUE / EXPECT_TRUE of status.ok(), showing the expression and the status.

// ---- Fixtures ------------------------------------------------------------------------------

enum class ComputeKind : uint8_t { kCaller, kHost };

const char* ComputeKindName(ComputeKind kind) {
  return kind == ComputeKind::kHost ? "host_compute" : "caller_compute";
}

std::unique_ptr<Stream> CreateComputeStream(ComputeKind kind, std::string name) {
  StreamOptions options{.name = std::move(name), .wait_timeout = kTimeout};
  return kind == ComputeKind::kHost ? *CreateHostStream(std::move(options))
                                    : *CreateCallerStream(std::move(options));
}

// Stream work that holds its stream until `gate` opens. Unlike testing::BlockOn it fails (and so
// poisons the stream) if the gate's bounded wait runs out: a test that relies on the host never
// waiting for the held work then fails instead of passing late.
Stream::Work Hold(Gate& gate) {
  return [&gate] {
    return gate.Wait() ? absl::OkStatus() : absl::DeadlineExceededError("test gate never opened");
  };
}

// What one rank owns: gates, streams and allocators, declared before the units so they outlive
// them.
struct RankRig {
  explicit RankRig(ComputeKind compute_kind = ComputeKind::kCaller)
      : gather(*CreateHostStream({.name = "gather", .wait_timeout = kTimeout})),
        reduce(*CreateHostStream({.name = "reduce", .wait_timeout = kTimeout})),
        compute(CreateComputeStream(compute_kind, "compute")),
        backing(CreateHostAllocator(64, "backing")),
        pool(std::make_unique<CachingPool>(*backing, CachingPoolOptions{.name = "pool"})),
        shards(CreateHostAllocator(64, "shards")) {}
  // Opens every gate first, so that held work runs before the pool drains and the streams join
  // (also when a failed assertion returned early).
  ~RankRig() {
    for (Gate& gate : gates) gate.Open();
  }

  FlatParameterOptions Options(std::string name = "unit") {
    return {.unsharded_pool = pool.get(), .shard_allocator = shards.get(), .name = name};
  }
  Gate& NewGate() { return gates.emplace_back(); }
  // Another host stream, owned by the rig.
  Stream& NewStream(std::string name) {
    return *more.emplace_back(
        *CreateHostStream({.name = std::move(name), .wait_timeout = kTimeout}));
  }

  std::deque<Gate> gates;  // first: destroyed after every stream that may wait on one
  std::unique_ptr<Stream> gather, reduce, compute;
  std::vector<std::unique_ptr<Stream>> more;
  std::unique_ptr<Allocator> backing;
  std::unique_ptr<CachingPool> pool;
  std::unique_ptr<Allocator> shards;
};

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

// ---- Framework compute ---------------------------------------------------------------------
// Views are taken on the test thread (FlatParameter is single-threaded); the work that reads or
// writes through them is enqueued on a stream. A caller stream runs it at once (Enqueue returns
// its error); a host stream later, and an error poisons the stream, so the test's next wait on
// it (or on an event after it) fails with the message.

// What work on a stream should read from one view: every element, exactly.
struct ExpectedView {
  std::string what;  // "rank 1 'unit' tensor 't3'"
  TensorView view;
  std::vector<double> values;
};

// Work that reads every element of the views and compares it with the expected value.
Stream::Work CheckViews(std::vector<ExpectedView> expected) {
  return [expected = std::move(expected)]() -> absl::Status {
    for (const ExpectedView& e : expected) {
      for (size_t i = 0; i < e.values.size(); ++i) {
        const double got = GetElement(e.view.dtype, e.view.data, i);
        if (!(got == e.values[i])) {
          return absl::InternalError(absl::StrCat(e.what, " element ", i, " of ", e.values.size(),
                                                  ": read ", got, ", expected ", e.values[i]));
        }
      }
    }
    return absl::OkStatus();
  };
}

// The views of the gathered unit and what they must hold: the full tensor cast to the master and
// then to the param dtype. Checks the views' metadata here.
std::vector<ExpectedView> GatheredViews(const FlatParameter& unit, const FullTensors& full) {
  const FlatLayout& layout = unit.layout();
  const MixedPrecisionPolicy& policy = unit.policy();
  std::vector<ExpectedView> expected;
  for (int t = 0; t < layout.num_tensors(); ++t) {
    absl::StatusOr<TensorView> view = unit.View(t);
    if (!view.ok()) {
      ADD_FAILURE() << view.status();
      return {};
    }
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
    ExpectedView e{absl::StrCat("rank ", unit.shard_rank(), " '", unit.name(), "' tensor '",
                                tensor.spec.name, "' (", policy.ToString(), ")"),
                   *view,
                   {}};
    e.values.resize(tensor.numel);
    for (size_t i = 0; i < tensor.numel; ++i) {
      const double original = GetElement(spec_dtype, full.pointers[storage], i);
      e.values[i] = RoundTo(policy.param_dtype, RoundTo(policy.master_dtype, original));
    }
    expected.push_back(std::move(e));
  }
  return expected;
}

// Work that writes (or, with `accumulate`, adds) rank `rank`'s micro-batch `micro` gradient into
// the unsharded gradient (storage tensors only: a tie's gradient is its target's).
Stream::Work WriteGrad(const FlatParameter& unit, uint64_t seed, int rank, int micro,
                       bool accumulate) {
  std::vector<std::pair<int, TensorView>> views;
  const FlatLayout& layout = unit.layout();
  for (int t = 0; t < layout.num_tensors(); ++t) {
    if (layout.tensor(t).is_tie() || layout.tensor(t).numel == 0) continue;
    absl::StatusOr<TensorView> view = unit.GradView(t);
    if (!view.ok()) {
      ADD_FAILURE() << view.status();
      return [status = view.status()] { return status; };
    }
    views.emplace_back(t, *view);
  }
  return [views = std::move(views), seed, rank, micro, accumulate] {
    for (const auto& [t, view] : views) {
      for (size_t i = 0; i < view.numel; ++i) {
        double v = GradValue(seed, rank, micro, t, i);
        if (accumulate) v += GetElement(view.dtype, view.data, i);
        SetElement(view.dtype, view.data, i, v);
      }
    }
    return absl::OkStatus();
  };
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

// Relative tolerance of a reduction of `world` ranks' gradients, `micros` micro-batches each.
double GradTolerance(const MixedPrecisionPolicy& policy, int world, int micros) {
  return (world + 4) * Roundoff(policy.reduce_dtype) +
         (micros + 1) * (Roundoff(policy.param_dtype) + Roundoff(policy.sharded_grad_dtype()));
}

// The expected sharded gradient of a unit's shard, with the magnitudes its tolerance scales.
struct ShardReference {
  std::vector<double> values;
  std::vector<double> magnitude;
};

// The average (kAvg) or sum (kSum) over ranks [0, ranks) of their micro-batches [0, micros).
ShardReference ReferenceFor(const FlatParameter& unit, uint64_t seed, int ranks, int micros,
                            ReduceOp op) {
  std::vector<int> all(ranks);
  for (int r = 0; r < ranks; ++r) all[r] = r;
  ShardReference reference;
  ReferenceShardGrad(unit.layout(), unit.shard_rank(), unit.policy().param_dtype, seed, all, micros,
                     op == ReduceOp::kAvg ? ranks : 1, reference.values, reference.magnitude);
  return reference;
}

// Work that compares the unit's sharded gradient (taken now, read when the work runs) with the
// reference: |got - ref| <= tolerance * magnitude for tensor elements, exactly zero for padding.
Stream::Work CheckShardGrad(const FlatParameter& unit, ShardReference reference, double tolerance) {
  absl::StatusOr<FlatShardView> grad = unit.ShardGrad();
  if (!grad.ok()) {
    ADD_FAILURE() << grad.status();
    return [status = grad.status()] { return status; };
  }
  EXPECT_EQ(grad->dtype, unit.policy().sharded_grad_dtype());
  EXPECT_EQ(grad->elements, reference.values.size());
  std::vector<bool> is_tensor(grad->elements, false);
  for (const ShardSlice& slice : unit.layout().ShardSlices(unit.shard_rank())) {
    for (size_t k = 0; k < slice.length; ++k) is_tensor[slice.shard_offset + k] = true;
  }
  return
      [grad = *grad, is_tensor = std::move(is_tensor), reference = std::move(reference), tolerance,
       what = absl::StrCat("'", unit.name(), "' shard ", unit.shard_rank(), " (",
                           unit.policy().ToString(), ")")]() -> absl::Status {
        if (grad.elements != reference.values.size()) {
          return absl::InternalError(absl::StrCat(what, ": ", grad.elements, " elements, expected ",
                                                  reference.values.size()));
        }
        for (size_t i = 0; i < grad.elements; ++i) {
          const double got = GetElement(grad.dtype, grad.data, i);
          const double expected = reference.values[i];
          const double allowed = is_tensor[i] ? tolerance * reference.magnitude[i] : 0.0;
          if (!(std::abs(got - expected) <= allowed)) {
            return absl::InternalError(absl::StrCat(what, " gradient element ", i,
                                                    is_tensor[i] ? "" : " (padding)", ": got ", got,
                                                    ", expected ", expected, " +- ", allowed));
          }
        }
        return absl::OkStatus();
      };
}

// The same, checked now on the calling thread (the reduction must have finished).
void ExpectShardGrad(const FlatParameter& unit, ShardReference reference, double tolerance) {
  EXPECT_OK(CheckShardGrad(unit, std::move(reference), tolerance)());
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
  ComputeKind compute;
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
    RunRankThreads(n, [&](int r) {
      RankRig rig(GetParam().compute);
      absl::StatusOr<std::unique_ptr<FlatParameter>> created =
          FlatParameter::Create(layout, r, policy, rig.Options());
      ASSERT_TRUE(created.ok()) << created.status();
      FlatParameter& unit = **created;
      ASSERT_OK(unit.SetShardFromTensors(full.pointers));

      absl::StatusOr<Work> work = unit.Gather(*comms[r], *rig.gather);
      ASSERT_TRUE(work.ok()) << work.status();
      ASSERT_EQ(unit.state(), FlatParameterState::kGathering);
      ASSERT_OK(unit.WaitGathered(*rig.compute));
      ASSERT_EQ(unit.state(), FlatParameterState::kUnsharded);
      ASSERT_OK(rig.compute->Enqueue(CheckViews(GatheredViews(unit, full))));

      ASSERT_OK(unit.PrepareGrad(*rig.compute));
      ASSERT_OK(rig.compute->Enqueue(WriteGrad(unit, seed, r, 0, /*accumulate=*/false)));
      absl::StatusOr<std::shared_ptr<Event>> ready = RecordEvent(*rig.compute);
      ASSERT_TRUE(ready.ok());
      absl::StatusOr<std::shared_ptr<Event>> reduced =
          unit.ReduceGrad(*comms[r], nullptr, *rig.reduce, *ready, {.op = op});
      ASSERT_TRUE(reduced.ok()) << reduced.status();
      ASSERT_EQ(unit.state(), FlatParameterState::kReducing);
      ASSERT_OK(unit.WaitReduced(Deadline()));
      ASSERT_EQ(unit.state(), FlatParameterState::kSharded);
      ExpectShardGrad(unit, ReferenceFor(unit, seed, n, 1, op), GradTolerance(policy, n, 1));
      EXPECT_OK(rig.compute->Synchronize(Deadline()));
    });
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (ComputeKind compute : {ComputeKind::kCaller, ComputeKind::kHost}) {
    for (int n : {1, 2, 3, 4, 5, 8}) {
      for (int p = 0; p < static_cast<int>(std::size(kPolicies)); ++p) {
        for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum}) cases.push_back({n, p, op, compute});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(RanksPoliciesOps, FlatParameterCollectiveTest,
                         ::testing::ValuesIn(AllCases()), [](const auto& info) {
                           return absl::StrCat(info.param.ranks, "ranks_",
                                               kPolicies[info.param.policy].name, "_",
                                               ReduceOpName(info.param.op), "_",
                                               ComputeKindName(info.param.compute));
                         });

// ---- Gradient accumulation over micro-batches --------------------------------------------

class FlatParameterAccumulationTest
    : public ::testing::TestWithParam<std::tuple<int, ComputeKind>> {};

// 4 micro-batches, accumulated in the unsharded gradient (no_sync) and reduced once, or reduced
// after each into the sharded gradient: both equal the one big batch (the sum over micro-batches
// of the rank-average). Then ZeroShardGrad starts over. The optimizer's reads of the sharded
// gradient are work on the compute stream, after WaitReduced(compute).
TEST_P(FlatParameterAccumulationTest, FourMicroBatchesEqualOneBigBatch) {
  const auto [policy_index, compute_kind] = GetParam();
  const MixedPrecisionPolicy& policy = kPolicies[policy_index].policy;
  constexpr int kRanks = 3;
  constexpr int kMicros = 4;
  std::mt19937_64 rng(77 + policy_index);
  const FlatLayout layout = RandomFloatLayout(rng, kRanks, policy.master_dtype);
  const FullTensors full = MakeFullTensors(layout, rng);
  auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
  RunRankThreads(kRanks, [&](int r) {
    RankRig rig(compute_kind);
    Stream& compute = *rig.compute;
    for (const bool no_sync : {true, false}) {
      SCOPED_TRACE(no_sync ? "no_sync" : "reduce every micro-batch");
      const uint64_t seed = no_sync ? 11 : 12;
      auto unit = *FlatParameter::Create(layout, r, policy, rig.Options());
      ASSERT_OK(unit->SetShardFromTensors(full.pointers));
      for (int m = 0; m < kMicros; ++m) {
        ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
        ASSERT_OK(unit->WaitGathered(compute));
        ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(*unit, full))));
        ASSERT_OK(unit->PrepareGrad(compute));
        ASSERT_OK(compute.Enqueue(WriteGrad(*unit, seed, r, m, /*accumulate=*/true)));
        std::shared_ptr<Event> ready = *RecordEvent(compute);
        if (no_sync && m + 1 < kMicros) {
          ASSERT_OK(unit->Reshard(ready));
          EXPECT_TRUE(unit->has_unsharded_grad());
          continue;
        }
        ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, ready).ok());
        EXPECT_FALSE(unit->has_unsharded_grad());
        ASSERT_OK(unit->WaitReduced(compute));
      }
      ASSERT_OK(compute.Enqueue(
          CheckShardGrad(*unit, ReferenceFor(*unit, seed, kRanks, kMicros, ReduceOp::kAvg),
                         GradTolerance(policy, kRanks, kMicros))));

      // zero_grad, then one more step: only its gradient remains.
      ASSERT_OK(unit->ZeroShardGrad(compute));
      ShardReference zeros;
      zeros.values.assign(layout.shard_elements(), 0.0);
      zeros.magnitude.assign(layout.shard_elements(), 0.0);
      ASSERT_OK(compute.Enqueue(CheckShardGrad(*unit, std::move(zeros), 0.0)));
      ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
      ASSERT_OK(unit->WaitGathered(compute));
      ASSERT_OK(unit->PrepareGrad(compute));
      ASSERT_OK(compute.Enqueue(WriteGrad(*unit, seed + 100, r, 0, /*accumulate=*/false)));
      ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, *RecordEvent(compute)).ok());
      ASSERT_OK(unit->WaitReduced(Deadline()));
      ExpectShardGrad(*unit, ReferenceFor(*unit, seed + 100, kRanks, 1, ReduceOp::kAvg),
                      GradTolerance(policy, kRanks, 1));
      ASSERT_OK(compute.Synchronize(Deadline()));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Policies, FlatParameterAccumulationTest,
    ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kPolicies))),
                       ::testing::Values(ComputeKind::kCaller, ComputeKind::kHost)),
    [](const auto& info) {
      return absl::StrCat(kPolicies[std::get<0>(info.param)].name, "_",
                          ComputeKindName(std::get<1>(info.param)));
    });

// ---- Copies the dtypes make unnecessary ---------------------------------------------------

// Casts ("cast f32->bf16", "cast f32->f32") in a trace.
int CountCasts(const TraceWriter& trace) {
  const std::string json = trace.ToJson();
  int n = 0;
  for (size_t at = json.find("\"cast "); at != std::string::npos;
       at = json.find("\"cast ", at + 1)) {
    ++n;
  }
  return n;
}

// Where the sharded gradient was zeroed and is in the reduce dtype, the reduce-scatter writes it
// directly: after the first reduction (which creates the sharded gradient and copies into it), no
// cast on the reduce stream unless the gradient's dtype changes on the way in. A policy whose
// sharded gradient is in another dtype keeps its cast after the collective. The direct write
// still waits for the zero-fill, here on a held stream of its own (written after the reduction,
// it would erase the reduced shard); both cycles' values are checked against the reference. The
// gather casts (or copies) the shard into place once per gather in every policy.
TEST(FlatParameterCopyTest, AZeroedShardGradientIsWrittenByTheReductionAfterItsFill) {
  constexpr int kRanks = 2;
  for (const int policy_index : {0, 1, 5}) {  // f32 throughout; bf16 params; bf16 reduction
    const MixedPrecisionPolicy& policy = kPolicies[policy_index].policy;
    SCOPED_TRACE(kPolicies[policy_index].name);
    const bool reduce_casts_in = policy.reduce_dtype != policy.param_dtype;
    const bool direct_reduce = policy.sharded_grad_dtype() == policy.reduce_dtype;
    std::mt19937_64 rng(3100 + policy_index);
    const FlatLayout layout = RandomFloatLayout(rng, kRanks, policy.master_dtype);
    const FullTensors full = MakeFullTensors(layout, rng);
    auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
    RunRankThreads(kRanks, [&](int r) {
      TraceWriter gather_trace(r), reduce_trace(r);
      RankRig rig(ComputeKind::kHost);
      rig.gather =
          *CreateHostStream({.name = "gather", .wait_timeout = kTimeout, .trace = &gather_trace});
      rig.reduce =
          *CreateHostStream({.name = "reduce", .wait_timeout = kTimeout, .trace = &reduce_trace});
      Stream& compute = *rig.compute;
      Stream& optimizer = rig.NewStream("optimizer");
      auto unit = *FlatParameter::Create(layout, r, policy, rig.Options());
      ASSERT_OK(unit->SetShardFromTensors(full.pointers));
      std::shared_ptr<Event> reduced;
      auto cycle = [&](uint64_t seed) {
        ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
        ASSERT_OK(unit->WaitGathered(compute));
        ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(*unit, full))));
        ASSERT_OK(unit->PrepareGrad(compute));
        ASSERT_OK(compute.Enqueue(WriteGrad(*unit, seed, r, 0, /*accumulate=*/false)));
        absl::StatusOr<std::shared_ptr<Event>> done =
            unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, *RecordEvent(compute));
        ASSERT_TRUE(done.ok()) << done.status();
        reduced = *std::move(done);
      };

      ASSERT_NO_FATAL_FAILURE(cycle(41));
      ASSERT_OK(unit->WaitReduced(Deadline()));
      ExpectShardGrad(*unit, ReferenceFor(*unit, 41, kRanks, 1, ReduceOp::kAvg),
                      GradTolerance(policy, kRanks, 1));
      ASSERT_OK(rig.gather->Synchronize(Deadline()));
      EXPECT_EQ(CountCasts(gather_trace), 1);
      // The first reduction creates the sharded gradient and copies the reduced shard into it.
      EXPECT_EQ(CountCasts(reduce_trace), (reduce_casts_in ? 1 : 0) + 1);

      // zero_grad on a stream of its own, held until the second cycle is issued.
      Gate& gate = rig.NewGate();
      ASSERT_OK(optimizer.Enqueue(Hold(gate)));
      ASSERT_OK(unit->ZeroShardGrad(optimizer));
      ASSERT_NO_FATAL_FAILURE(cycle(42));
      // The reduction cannot finish while the zero-fill it must follow is held (a bounded wait
      // that must run out: a reduction not ordered after the fill finishes well within it, and
      // the fill then erases the reduced shard).
      EXPECT_FALSE(reduced->Synchronize(absl::Now() + absl::Milliseconds(200)).ok());
      gate.Open();
      ASSERT_OK(unit->WaitReduced(Deadline()));
      ExpectShardGrad(*unit, ReferenceFor(*unit, 42, kRanks, 1, ReduceOp::kAvg),
                      GradTolerance(policy, kRanks, 1));
      ASSERT_OK(rig.gather->Synchronize(Deadline()));
      EXPECT_EQ(CountCasts(gather_trace), 2);
      EXPECT_EQ(CountCasts(reduce_trace), (reduce_casts_in ? 2 : 0) + 1 + (direct_reduce ? 0 : 1));
      ASSERT_OK(compute.Synchronize(Deadline()));
    });
  }
}

// ---- Hybrid sharding ----------------------------------------------------------------------

class FlatParameterHybridTest : public ::testing::TestWithParam<ComputeKind> {};

// A 2 x 2 mesh: parameters sharded over each row, gradients averaged (or summed) over all four
// ranks; the two replicas of a shard end up bit-identical.
TEST_P(FlatParameterHybridTest, TwoByTwoMeshReducesOverAllRanks) {
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
      std::vector<std::vector<double>> results(kWorld);
      RunRankThreads(kWorld, [&](int r) {
        absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(world[r], kShard, Deadline());
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        RankRig rig(GetParam());
        auto unit = *FlatParameter::Create(layout, mesh->shard_rank(), policy, rig.Options());
        ASSERT_OK(unit->SetShardFromTensors(full.pointers));
        ASSERT_TRUE(unit->Gather(*mesh->shard(), *rig.gather).ok());
        ASSERT_OK(unit->WaitGathered(*rig.compute));
        ASSERT_OK(rig.compute->Enqueue(CheckViews(GatheredViews(*unit, full))));
        ASSERT_OK(unit->PrepareGrad(*rig.compute));
        ASSERT_OK(rig.compute->Enqueue(WriteGrad(*unit, 9, r, 0, /*accumulate=*/false)));
        ASSERT_TRUE(unit->ReduceGrad(*mesh->shard(), mesh->replicate().get(), *rig.reduce,
                                     *RecordEvent(*rig.compute), {.op = op})
                        .ok());
        ASSERT_OK(unit->WaitReduced(Deadline()));
        // Every rank's gradient goes into the reference: rank r is world rank r.
        ExpectShardGrad(*unit, ReferenceFor(*unit, 9, kWorld, 1, op),
                        GradTolerance(policy, kWorld, 1));
        const FlatShardView grad = *unit->ShardGrad();
        for (size_t i = 0; i < grad.elements; ++i) {
          results[r].push_back(GetElement(grad.dtype, grad.data, i));
        }
        EXPECT_OK(rig.compute->Synchronize(Deadline()));
      });
      // Ranks r and r + 2 hold the same shard (column r % 2).
      EXPECT_EQ(results[0], results[2]);
      EXPECT_EQ(results[1], results[3]);
    }
  }
}

// The reduction split over three streams: ReduceScatter on the reduce stream, AllReduce over the
// replicate communicator on a second, Accumulate on a third; two steps accumulate into the
// sharded gradient. Calls out of order are FailedPrecondition naming the call and change nothing.
TEST_P(FlatParameterHybridTest, SplitReductionOnThreeStreamsMatchesTheReference) {
  constexpr int kWorld = 4;
  constexpr int kShard = 2;
  constexpr int kSteps = 2;
  for (int policy_index : {1, 5}) {
    for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum}) {
      SCOPED_TRACE(absl::StrCat(kPolicies[policy_index].name, " ", ReduceOpName(op)));
      const MixedPrecisionPolicy& policy = kPolicies[policy_index].policy;
      std::mt19937_64 rng(50 + policy_index);
      const FlatLayout layout = RandomFloatLayout(rng, kShard, policy.master_dtype);
      const FullTensors full = MakeFullTensors(layout, rng);
      auto world = *CreateLocalCommunicators(kWorld, {.timeout = kTimeout});
      RunRankThreads(kWorld, [&](int r) {
        absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(world[r], kShard, Deadline());
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        RankRig rig(GetParam());
        Stream& compute = *rig.compute;
        Stream& allreduce = rig.NewStream("allreduce");
        Stream& accumulate = rig.NewStream("accumulate");
        auto unit = *FlatParameter::Create(layout, mesh->shard_rank(), policy, rig.Options("hsdp"));
        ASSERT_OK(unit->SetShardFromTensors(full.pointers));
        auto expect_out_of_order = [&](const absl::Status& status, absl::string_view call) {
          EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
          EXPECT_TRUE(absl::StrContains(status.message(), "'hsdp'")) << status;
          EXPECT_TRUE(absl::StrContains(status.message(), call)) << status;
        };
        for (int step = 0; step < kSteps; ++step) {
          ASSERT_TRUE(unit->Gather(*mesh->shard(), *rig.gather).ok());
          ASSERT_OK(unit->WaitGathered(compute));
          ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(*unit, full))));
          ASSERT_OK(unit->PrepareGrad(compute));
          ASSERT_OK(compute.Enqueue(WriteGrad(*unit, 21, r, step, /*accumulate=*/false)));
          std::shared_ptr<Event> ready = *RecordEvent(compute);

          expect_out_of_order(
              unit->AllReduce(mesh->replicate().get(), allreduce, {.op = op}).status(),
              "AllReduce()");
          expect_out_of_order(unit->Accumulate(accumulate).status(), "Accumulate()");
          EXPECT_EQ(unit->state(), FlatParameterState::kUnsharded);

          absl::StatusOr<std::shared_ptr<Event>> scattered =
              unit->ReduceScatter(*mesh->shard(), *rig.reduce, ready, {.op = op});
          ASSERT_TRUE(scattered.ok()) << scattered.status();
          EXPECT_EQ(unit->state(), FlatParameterState::kReducing);
          expect_out_of_order(unit->WaitReduced(compute), "WaitReduced()");
          expect_out_of_order(unit->WaitReduced(Deadline()), "WaitReduced()");
          absl::StatusOr<std::shared_ptr<Event>> allreduced =
              unit->AllReduce(mesh->replicate().get(), allreduce, {.op = op});
          ASSERT_TRUE(allreduced.ok()) << allreduced.status();
          expect_out_of_order(
              unit->AllReduce(mesh->replicate().get(), allreduce, {.op = op}).status(),
              "AllReduce()");
          expect_out_of_order(unit->WaitReduced(Deadline()), "WaitReduced()");
          absl::StatusOr<std::shared_ptr<Event>> accumulated = unit->Accumulate(accumulate);
          ASSERT_TRUE(accumulated.ok()) << accumulated.status();
          expect_out_of_order(unit->Accumulate(accumulate).status(), "Accumulate()");
          expect_out_of_order(
              unit->AllReduce(mesh->replicate().get(), allreduce, {.op = op}).status(),
              "AllReduce()");
          EXPECT_EQ(unit->state(), FlatParameterState::kReducing);
          ASSERT_OK(unit->WaitReduced(compute));
          EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
          ASSERT_OK(
              compute.Enqueue(CheckShardGrad(*unit, ReferenceFor(*unit, 21, kWorld, step + 1, op),
                                             GradTolerance(policy, kWorld, step + 1))));
        }
        EXPECT_OK(compute.Synchronize(Deadline()));
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ComputeStreams, FlatParameterHybridTest,
                         ::testing::Values(ComputeKind::kCaller, ComputeKind::kHost),
                         [](const auto& info) { return ComputeKindName(info.param); });

// ---- State machine ------------------------------------------------------------------------

FlatLayout SmallLayout(int shards, DType element_dtype = DType::kF32) {
  return *FlatLayout::Create({{"w", {3, 5}, DType::kF32, ""},
                              {"b", {5}, DType::kBF16, ""},
                              {"w_tied", {3, 5}, DType::kF32, "w"}},
                             {.num_shards = shards, .element_dtype = element_dtype});
}

// Odd sizes: a 37 x 29 weight, its bias, and a tie to the weight.
FlatLayout OddLayout(int shards) {
  return *FlatLayout::Create({{"w", {37, 29}, DType::kF32, ""},
                              {"b", {29}, DType::kF32, ""},
                              {"w_out", {37, 29}, DType::kF32, "w"}},
                             {.num_shards = shards, .element_dtype = DType::kF32});
}

void ExpectWrongState(const absl::Status& status, absl::string_view call, absl::string_view state) {
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "'block7'")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), call)) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("state ", state))) << status;
}

// A scheduler zero-fills the gradient on a side stream while the gather is in flight; the compute
// stream's PrepareGrad then only waits for that fill. The compute stream is asynchronous and the
// side stream held back until the compute stream's work is queued, so a missing wait would let
// the compute add into an unfilled (garbage) buffer.
TEST(FlatParameterStateTest, GradientPreparedWhileGathering) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  Communicator& comm = *comms[0];
  RankRig rig;
  auto side = *CreateHostStream({.name = "side", .wait_timeout = kTimeout});
  auto compute = *CreateHostStream({.name = "async compute", .wait_timeout = kTimeout});
  auto unit =
      *FlatParameter::Create(OddLayout(1), 0, MixedPrecisionPolicy{}, rig.Options("block7"));
  // A pool block full of garbage, so that an unfilled gradient shows.
  {
    std::vector<Buffer> dirty;
    for (int i = 0; i < 3; ++i) {
      dirty.push_back(*rig.pool->Allocate(unit->layout().total_elements() * 4));
      std::memset(dirty.back().data(), 0x7f, dirty.back().size());
    }
  }
  ASSERT_TRUE(unit->Gather(comm, *rig.gather).ok());
  testing::Gate gate;
  ASSERT_TRUE(side->Enqueue(testing::BlockOn(gate)).ok());
  ASSERT_TRUE(unit->PrepareGrad(*side).ok());  // gathering: allowed, filled on `side`
  ASSERT_TRUE(unit->WaitGathered(*compute).ok());
  ASSERT_TRUE(unit->PrepareGrad(*compute).ok());  // waits for the fill on `side`
  TensorView g = *unit->GradView("b");
  std::vector<float> seen(g.numel);
  ASSERT_TRUE(compute
                  ->Enqueue([g, &seen] {
                    std::memcpy(seen.data(), g.data, seen.size() * sizeof(float));
                    return absl::OkStatus();
                  })
                  .ok());
  gate.Open();
  ASSERT_TRUE(compute->Synchronize(Deadline()).ok());
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 0.0f) << i;
  ASSERT_TRUE(unit->Reshard(nullptr).ok());
  ASSERT_TRUE(side->Synchronize(Deadline()).ok());
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
  // (PrepareGrad is legal while gathering: GradientPreparedWhileGathering.)
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

// ---- Several users ------------------------------------------------------------------------

// A unit acquired by two compute streams (a tied weight used twice in one forward): the first
// Release keeps the buffer for the second user, whose work is held by a gate; the last Release
// returns it after its event. Release and Acquire in other states are FailedPrecondition.
TEST(FlatParameterAcquireTest, TwoUsersKeepTheBufferUntilTheLastRelease) {
  constexpr int kRanks = 2;
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  const FlatLayout layout = OddLayout(kRanks);
  std::mt19937_64 rng(404);
  const FullTensors full = MakeFullTensors(layout, rng);
  auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
  RunRankThreads(kRanks, [&](int r) {
    RankRig rig(ComputeKind::kHost);
    Stream& first = *rig.compute;
    Stream& second = rig.NewStream("compute2");
    Gate& gate = rig.NewGate();
    auto unit = *FlatParameter::Create(layout, r, policy, rig.Options("block7"));
    ASSERT_OK(unit->SetShardFromTensors(full.pointers));
    const size_t unsharded_bytes = layout.total_elements() * DTypeSize(policy.param_dtype);

    ExpectWrongState(unit->Release(nullptr), "Release()", "sharded");
    ExpectWrongState(unit->Acquire(first), "Acquire()", "sharded");
    ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
    ExpectWrongState(unit->Release(nullptr), "Release()", "gathering");
    EXPECT_EQ(unit->users(), 0);
    ASSERT_OK(unit->WaitGathered(first));
    ASSERT_OK(unit->Acquire(second));
    EXPECT_EQ(unit->users(), 2);
    const std::vector<ExpectedView> expected = GatheredViews(*unit, full);
    ASSERT_OK(first.Enqueue(CheckViews(expected)));
    std::shared_ptr<Event> first_use = *RecordEvent(first);
    ASSERT_OK(second.Enqueue(Hold(gate)));
    ASSERT_OK(second.Enqueue(CheckViews(expected)));
    std::shared_ptr<Event> second_use = *RecordEvent(second);

    // The first use ended and ran: the buffer stays, handed out (not even pending).
    ASSERT_OK(unit->Release(first_use));
    EXPECT_EQ(unit->state(), FlatParameterState::kUnsharded);
    EXPECT_EQ(unit->users(), 1);
    // (Streams, not events: the guards' completion callbacks have run once the stream is idle.)
    ASSERT_OK(first.Synchronize(Deadline()));
    ASSERT_OK(rig.gather->Synchronize(Deadline()));
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(unsharded_bytes));
    EXPECT_EQ(rig.pool->pending_blocks(), 0);
    // A block of the same size from the pool is another one; fill it with NaNs, which the held
    // reader would see if it were the unit's.
    Buffer scribble = *rig.pool->Allocate(unsharded_bytes);
    std::memset(scribble.data(), 0xff, scribble.size());

    // The last use ends: the unit reshards; the buffer waits for the held reader.
    ASSERT_OK(unit->Release(second_use));
    EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
    EXPECT_EQ(unit->users(), 0);
    ExpectWrongState(unit->Release(nullptr), "Release()", "sharded");
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(2 * unsharded_bytes));
    EXPECT_EQ(rig.pool->pending_blocks(), 1);
    gate.Open();
    ASSERT_OK(second.Synchronize(Deadline()));
    ASSERT_OK(first.Synchronize(Deadline()));  // it recorded a guard at the last Release too
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(unsharded_bytes));
    EXPECT_EQ(rig.pool->pending_blocks(), 0);
    scribble.Reset();

    // Still usable: Acquire is also the first use (from gathering), a stream may acquire twice,
    // and a reduction ends the remaining uses.
    ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
    ASSERT_OK(unit->Acquire(second));
    ASSERT_OK(unit->Acquire(second));
    EXPECT_EQ(unit->users(), 2);
    ASSERT_OK(second.Enqueue(CheckViews(GatheredViews(*unit, full))));
    ASSERT_OK(unit->Release(*RecordEvent(second)));
    ASSERT_OK(unit->PrepareGrad(second));
    ASSERT_OK(second.Enqueue(WriteGrad(*unit, 31, r, 0, /*accumulate=*/false)));
    ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, *RecordEvent(second)).ok());
    EXPECT_EQ(unit->users(), 0);
    ExpectWrongState(unit->Acquire(first), "Acquire()", "reducing");
    ExpectWrongState(unit->Release(nullptr), "Release()", "reducing");
    ASSERT_OK(unit->WaitReduced(Deadline()));
    ExpectShardGrad(*unit, ReferenceFor(*unit, 31, kRanks, 1, ReduceOp::kAvg),
                    GradTolerance(policy, kRanks, 1));
    EXPECT_OK(first.Synchronize(Deadline()));
    EXPECT_OK(second.Synchronize(Deadline()));
  });
}

// ---- Memory ---------------------------------------------------------------------------------

TEST(FlatParameterMemoryTest, UnshardedBufferLivesFromGatherToReshardPlusEvent) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  Stream& reader = rig.NewStream("reader");
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
    ASSERT_OK(unit->WaitGathered(*rig.compute));

    // A reader on another stream is still using the views: Reshard does not free the buffer.
    Gate& gate = rig.NewGate();
    ASSERT_OK(reader.Enqueue(Hold(gate)));
    std::shared_ptr<Event> last_use = *RecordEvent(reader);
    ASSERT_OK(unit->Reshard(last_use));
    EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, unsharded_bytes);
    gate.Open();
    ASSERT_OK(reader.Synchronize(Deadline()));
    rig.pool->Collect();
    EXPECT_EQ(rig.pool->stats().current_bytes, 0);
    EXPECT_EQ(rig.pool->stats().peak_bytes, unsharded_bytes);
  }
  // The shards were never touched by the gathers.
  EXPECT_EQ(rig.shards->stats().current_bytes, shard_bytes);
}

// GatherCompleted(): false before any gather and while one is held up on its stream, true once
// it ran, false again after a gather that failed.
TEST(FlatParameterStateTest, GatherCompletedFollowsTheLatestGather) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig(ComputeKind::kHost);
  Gate& gate = rig.NewGate();
  auto unit =
      *FlatParameter::Create(OddLayout(1), 0, MixedPrecisionPolicy{}, rig.Options("block7"));
  EXPECT_FALSE(unit->GatherCompleted());
  ASSERT_OK(rig.gather->Enqueue(Hold(gate)));
  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  EXPECT_FALSE(unit->GatherCompleted());
  gate.Open();
  ASSERT_OK(rig.gather->Synchronize(Deadline()));
  EXPECT_TRUE(unit->GatherCompleted());
  ASSERT_OK(unit->WaitGathered(*rig.compute));
  ASSERT_OK(unit->Reshard(nullptr));
  // Work queued before the next gather fails: the gather is dropped and its event fails.
  Gate& second = rig.NewGate();
  ASSERT_OK(rig.gather->Enqueue(Hold(second)));
  ASSERT_OK(rig.gather->Enqueue([] { return absl::InternalError("injected"); }));
  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  EXPECT_FALSE(unit->GatherCompleted());
  second.Open();
  EXPECT_EQ(rig.gather->Synchronize(Deadline()).code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(unit->GatherCompleted());
}

// Reshard(nullptr) ends the uses of two acquiring host streams whose work (held by a gate)
// still reads the views. The buffer must stay with the pool's in-use bytes until that work ran,
// although the gather itself finished long ago; the held reads see the gathered values (a
// same-sized block taken from the pool meanwhile and filled with NaNs is another block).
TEST(FlatParameterMemoryTest, ReshardWithoutEventWaitsForWorkQueuedOnAcquiringStreams) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig(ComputeKind::kHost);
  Stream& second = rig.NewStream("compute2");
  Gate& gate = rig.NewGate();
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  const FlatLayout layout = OddLayout(1);
  std::mt19937_64 rng(505);
  const FullTensors full = MakeFullTensors(layout, rng);
  auto unit = *FlatParameter::Create(layout, 0, policy, rig.Options());
  ASSERT_OK(unit->SetShardFromTensors(full.pointers));
  const size_t unsharded_bytes = layout.total_elements() * DTypeSize(policy.param_dtype);

  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  ASSERT_OK(unit->WaitGathered(*rig.compute));
  ASSERT_OK(unit->Acquire(second));
  ASSERT_OK(rig.gather->Synchronize(Deadline()));
  const std::vector<ExpectedView> expected = GatheredViews(*unit, full);
  for (Stream* stream : {rig.compute.get(), &second}) {
    ASSERT_OK(stream->Enqueue(Hold(gate)));
    ASSERT_OK(stream->Enqueue(CheckViews(expected)));
  }
  ASSERT_OK(unit->Reshard(nullptr));
  EXPECT_EQ(unit->state(), FlatParameterState::kSharded);
  EXPECT_EQ(unit->users(), 0);

  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(unsharded_bytes));
  EXPECT_EQ(rig.pool->pending_blocks(), 1);
  Buffer scribble = *rig.pool->Allocate(unsharded_bytes);
  std::memset(scribble.data(), 0xff, scribble.size());
  gate.Open();
  EXPECT_OK(rig.compute->Synchronize(Deadline()));
  EXPECT_OK(second.Synchronize(Deadline()));
  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(unsharded_bytes));  // scribble
  EXPECT_EQ(rig.pool->pending_blocks(), 0);
}

// Destroying a unit while work held on the host compute stream still reads the parameters
// and writes the gradient. Both buffers stay in use until that work ran; its reads see the
// gathered values.
TEST(FlatParameterMemoryTest, DestroyingWaitsForWorkQueuedOnTheComputeStream) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig(ComputeKind::kHost);
  Gate& gate = rig.NewGate();
  const MixedPrecisionPolicy policy{DType::kF32, DType::kF32, DType::kF32, false};
  const FlatLayout layout = OddLayout(1);
  std::mt19937_64 rng(606);
  const FullTensors full = MakeFullTensors(layout, rng);
  auto unit = *FlatParameter::Create(layout, 0, policy, rig.Options());
  ASSERT_OK(unit->SetShardFromTensors(full.pointers));
  const size_t bytes = layout.total_elements() * DTypeSize(policy.param_dtype);

  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  ASSERT_OK(unit->WaitGathered(*rig.compute));
  ASSERT_OK(unit->PrepareGrad(*rig.compute));
  // The gather and the zero-fill are done: only the held work below can keep the buffers.
  ASSERT_OK(rig.compute->Synchronize(Deadline()));
  ASSERT_OK(rig.gather->Synchronize(Deadline()));
  ASSERT_OK(rig.compute->Enqueue(Hold(gate)));
  ASSERT_OK(rig.compute->Enqueue(CheckViews(GatheredViews(*unit, full))));
  ASSERT_OK(rig.compute->Enqueue(WriteGrad(*unit, 61, 0, 0, /*accumulate=*/true)));
  unit.reset();

  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(2 * bytes));
  EXPECT_EQ(rig.pool->pending_blocks(), 2);
  Buffer scribble[2] = {*rig.pool->Allocate(bytes), *rig.pool->Allocate(bytes)};
  for (Buffer& buffer : scribble) std::memset(buffer.data(), 0xff, buffer.size());
  gate.Open();
  EXPECT_OK(rig.compute->Synchronize(Deadline()));
  rig.pool->Collect();
  rig.shards->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, static_cast<int64_t>(2 * bytes));  // scribbles
  EXPECT_EQ(rig.pool->pending_blocks(), 0);
  EXPECT_EQ(rig.shards->stats().current_bytes, 0);
}

TEST(FlatParameterMemoryTest, ReductionReturnsEverythingButTheShards) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = kTimeout});
  RankRig rig;
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  auto unit = *FlatParameter::Create(SmallLayout(1), 0, policy, rig.Options());
  const int64_t total = unit->layout().total_elements();
  ASSERT_TRUE(unit->Gather(*comms[0], *rig.gather).ok());
  ASSERT_OK(unit->WaitGathered(*rig.compute));
  ASSERT_OK(unit->PrepareGrad(*rig.compute));
  EXPECT_EQ(rig.pool->stats().current_bytes, 2 * total * 2);  // parameters + gradient, bf16
  ASSERT_TRUE(unit->ReduceGrad(*comms[0], nullptr, *rig.reduce, *RecordEvent(*rig.compute)).ok());
  ASSERT_OK(unit->WaitReduced(Deadline()));
  rig.pool->Collect();
  EXPECT_EQ(rig.pool->stats().current_bytes, 0);
  // Peak: parameters + bf16 gradient + its f32 copy for the reduction.
  EXPECT_EQ(rig.pool->stats().peak_bytes, total * (2 + 2 + 4));
  // Master shard + f32 sharded gradient.
  const int64_t shard_elements = unit->layout().shard_elements();
  EXPECT_EQ(rig.shards->stats().current_bytes, 2 * shard_elements * 4);
  ASSERT_OK(unit->ReleaseShardGrad(nullptr));
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
        ASSERT_OK(unit->WaitGathered(*rig.compute));
      }
      if (stop >= 2) {
        ASSERT_OK(unit->PrepareGrad(*rig.compute));
      }
      if (stop >= 3) {
        ASSERT_TRUE(unit->ReduceGrad(*comms[0], nullptr, *rig.reduce, nullptr).ok());
      }
    }
    ASSERT_OK(rig.gather->Synchronize(Deadline()));
    ASSERT_OK(rig.reduce->Synchronize(Deadline()));
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
  RunRankThreads(n, [&](int r) {
    RankRig rig;
    auto unit = *FlatParameter::Create(layout, r, {}, rig.Options());
    ASSERT_OK(unit->SetShardFromTensors({nullptr}));
    ASSERT_TRUE(unit->Gather(*comms[r], *rig.gather).ok());
    ASSERT_OK(unit->WaitGathered(*rig.compute));
    EXPECT_EQ(unit->View("empty")->data, nullptr);
    ASSERT_OK(unit->PrepareGrad(*rig.compute));
    EXPECT_TRUE(unit->has_unsharded_grad());
    ASSERT_TRUE(unit->ReduceGrad(*comms[r], nullptr, *rig.reduce, nullptr).ok());
    ASSERT_OK(unit->WaitReduced(Deadline()));
    EXPECT_EQ(unit->ShardGrad()->elements, 0u);
  });
}

// ---- Overlap on one communicator ------------------------------------------------------------

// Two units on three ranks, one shard communicator: the all-gather of unit A (gather stream)
// and the reduction of unit B's gradient (reduce stream) are both in flight while the host
// compute stream is held, issued in either order, with ReduceGrad or the split ReduceScatter +
// Accumulate. A's gathered views and B's sharded gradient are checked element by element against
// the references, by work on the compute stream.
TEST(FlatParameterOverlapTest, GatherAndReductionOverlapOnOneCommunicator) {
  constexpr int kRanks = 3;
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  const FlatLayout layout_a =
      *FlatLayout::Create({{"a.w", {37, 29}, DType::kF32, ""},
                           {"a.b", {29}, DType::kBF16, ""},
                           {"a.v", {3, 7, 11}, DType::kF32, ""}},
                          {.num_shards = kRanks, .element_dtype = DType::kF32});
  const FlatLayout layout_b = *FlatLayout::Create(
      {{"b.w", {41, 23}, DType::kF32, ""},
       {"b.b", {23}, DType::kF32, ""},
       {"b.w_out", {41, 23}, DType::kF32, "b.w"}},
      {.num_shards = kRanks, .element_dtype = DType::kF32, .block_elements = 3});
  std::mt19937_64 rng(707);
  const FullTensors full_a = MakeFullTensors(layout_a, rng);
  const FullTensors full_b = MakeFullTensors(layout_b, rng);
  for (const bool gather_first : {true, false}) {
    for (const bool split : {false, true}) {
      SCOPED_TRACE(absl::StrCat(gather_first ? "gather first" : "reduction first",
                                split ? ", split reduction" : ", ReduceGrad"));
      const uint64_t seed = 70 + 2 * gather_first + split;
      auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
      RunRankThreads(kRanks, [&](int r) {
        RankRig rig(ComputeKind::kHost);
        Stream& compute = *rig.compute;
        Communicator& comm = *comms[r];
        Gate& gate = rig.NewGate();
        auto a = *FlatParameter::Create(layout_a, r, policy, rig.Options("a"));
        auto b = *FlatParameter::Create(layout_b, r, policy, rig.Options("b"));
        ASSERT_OK(a->SetShardFromTensors(full_a.pointers));
        ASSERT_OK(b->SetShardFromTensors(full_b.pointers));

        // B's backward, held: it reads B's parameters and writes B's gradient.
        ASSERT_TRUE(b->Gather(comm, *rig.gather).ok());
        ASSERT_OK(b->WaitGathered(compute));
        ASSERT_OK(b->PrepareGrad(compute));
        ASSERT_OK(compute.Enqueue(Hold(gate)));
        ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(*b, full_b))));
        ASSERT_OK(compute.Enqueue(WriteGrad(*b, seed, r, 0, /*accumulate=*/false)));
        std::shared_ptr<Event> b_ready = *RecordEvent(compute);

        auto gather_a = [&] { ASSERT_TRUE(a->Gather(comm, *rig.gather).ok()); };
        auto reduce_b = [&] {
          if (!split) {
            ASSERT_TRUE(b->ReduceGrad(comm, nullptr, *rig.reduce, b_ready).ok());
            return;
          }
          ASSERT_TRUE(b->ReduceScatter(comm, *rig.reduce, b_ready).ok());
          ASSERT_TRUE(b->Accumulate(*rig.reduce).ok());
        };
        if (gather_first) {
          ASSERT_NO_FATAL_FAILURE(gather_a());
          ASSERT_NO_FATAL_FAILURE(reduce_b());
        } else {
          ASSERT_NO_FATAL_FAILURE(reduce_b());
          ASSERT_NO_FATAL_FAILURE(gather_a());
        }
        ASSERT_OK(a->WaitGathered(compute));
        ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(*a, full_a))));
        ASSERT_OK(b->WaitReduced(compute));
        ASSERT_OK(
            compute.Enqueue(CheckShardGrad(*b, ReferenceFor(*b, seed, kRanks, 1, ReduceOp::kAvg),
                                           GradTolerance(policy, kRanks, 1))));
        std::shared_ptr<Event> checked = *RecordEvent(compute);
        // Everything above was issued without waiting for the held compute stream.
        EXPECT_EQ(checked->Query().value_or(true), false);
        gate.Open();
        EXPECT_OK(checked->Synchronize(Deadline()));
        ASSERT_OK(a->Reshard(checked));
      });
    }
  }
}

// ---- Stream-ordered reuse in a training loop ------------------------------------------------

// Two units of different size classes, two ranks, a CachingPool, gather + host compute + reduce
// streams, the reductions on a Dup() of the gather communicator (the ordering rule of
// collectives/communicator.h). Each step: forward (both gathers prefetched, views checked by
// compute work, resharded after it), backward in reverse order (A's gather prefetched while B's
// gradient is written), reductions, and an "optimizer" on the compute stream that checks the
// sharded gradients and zeroes them. After one warm-up step, the steady-state steps are issued
// while the reduce stream is held, so the gradient blocks the next gathers reuse are still
// pending: no step takes a new block from the backing allocator (the reuse is stream-ordered,
// the host never waits), and the pool's peak stays within the two units' parameter and gradient
// buffers. A gather that wrote into a gradient block before its reduction read it would show
// up in the gradients.
TEST(FlatParameterOverlapTest, SteadyStateStepsReuseBlocksWithoutBlockingTheHost) {
  constexpr int kRanks = 2;
  constexpr int kSteadySteps = 3;
  const MixedPrecisionPolicy policy;  // f32 throughout: no reduce-dtype temporaries
  // About 12 KB and 67 KB of f32: size classes 12288 and 81920 bytes.
  const FlatLayout layout_a = *FlatLayout::Create(
      {{"a.w", {61, 49}, DType::kF32, ""}, {"a.b", {49}, DType::kF32, ""}}, {.num_shards = kRanks});
  const FlatLayout layout_b =
      *FlatLayout::Create({{"b.w", {127, 131}, DType::kF32, ""}, {"b.b", {131}, DType::kF32, ""}},
                          {.num_shards = kRanks});
  const size_t class_a = CachingPool::SizeClass(layout_a.total_elements() * 4);
  const size_t class_b = CachingPool::SizeClass(layout_b.total_elements() * 4);
  ASSERT_NE(class_a, class_b);
  std::mt19937_64 rng(808);
  const FullTensors full_a = MakeFullTensors(layout_a, rng);
  const FullTensors full_b = MakeFullTensors(layout_b, rng);
  auto comms = *CreateLocalCommunicators(kRanks, {.timeout = kTimeout});
  RunRankThreads(kRanks, [&](int r) {
    RankRig rig(ComputeKind::kHost);
    Stream& gather = *rig.gather;
    Stream& compute = *rig.compute;
    Stream& reduce = *rig.reduce;
    Communicator& gather_comm = *comms[r];
    absl::StatusOr<std::shared_ptr<Communicator>> reduce_comm = gather_comm.Dup(Deadline());
    ASSERT_TRUE(reduce_comm.ok()) << reduce_comm.status();
    auto a = *FlatParameter::Create(layout_a, r, policy, rig.Options("a"));
    auto b = *FlatParameter::Create(layout_b, r, policy, rig.Options("b"));
    ASSERT_OK(a->SetShardFromTensors(full_a.pointers));
    ASSERT_OK(b->SetShardFromTensors(full_b.pointers));
    const uint64_t seed = 80;

    auto forward = [&](FlatParameter& unit, const FullTensors& full) {
      ASSERT_OK(unit.WaitGathered(compute));
      ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(unit, full))));
      ASSERT_OK(unit.Reshard(*RecordEvent(compute)));
    };
    auto backward = [&](FlatParameter& unit, const FullTensors& full, int step) {
      ASSERT_OK(unit.WaitGathered(compute));
      ASSERT_OK(unit.PrepareGrad(compute));
      ASSERT_OK(compute.Enqueue(CheckViews(GatheredViews(unit, full))));
      ASSERT_OK(compute.Enqueue(WriteGrad(unit, seed + step, r, 0, /*accumulate=*/false)));
      ASSERT_TRUE(unit.ReduceGrad(**reduce_comm, nullptr, reduce, *RecordEvent(compute)).ok());
    };
    auto optimizer = [&](FlatParameter& unit, int step) {
      ASSERT_OK(unit.WaitReduced(compute));
      ASSERT_OK(compute.Enqueue(
          CheckShardGrad(unit, ReferenceFor(unit, seed + step, kRanks, 1, ReduceOp::kAvg),
                         GradTolerance(policy, kRanks, 1))));
      ASSERT_OK(unit.ZeroShardGrad(compute));
    };
    auto step = [&](int s) {
      ASSERT_TRUE(a->Gather(gather_comm, gather).ok());
      ASSERT_TRUE(b->Gather(gather_comm, gather).ok());
      ASSERT_NO_FATAL_FAILURE(forward(*a, full_a));
      ASSERT_NO_FATAL_FAILURE(forward(*b, full_b));
      ASSERT_TRUE(b->Gather(gather_comm, gather).ok());
      ASSERT_TRUE(a->Gather(gather_comm, gather).ok());
      ASSERT_NO_FATAL_FAILURE(backward(*b, full_b, s));
      ASSERT_NO_FATAL_FAILURE(backward(*a, full_a, s));
      ASSERT_NO_FATAL_FAILURE(optimizer(*b, s));
      ASSERT_NO_FATAL_FAILURE(optimizer(*a, s));
    };

    ASSERT_NO_FATAL_FAILURE(step(0));  // warm-up: the pool reserves its blocks
    const PoolCacheStats warm = rig.pool->cache_stats();
    rig.pool->ResetPeak();
    Gate& gate = rig.NewGate();
    ASSERT_OK(reduce.Enqueue(Hold(gate)));
    for (int s = 1; s <= kSteadySteps; ++s) ASSERT_NO_FATAL_FAILURE(step(s));
    std::shared_ptr<Event> done = *RecordEvent(compute);
    // All steady steps were issued while no reduction could run.
    EXPECT_EQ(done->Query().value_or(true), false);
    const PoolCacheStats issued = rig.pool->cache_stats();
    gate.Open();
    ASSERT_OK(done->Synchronize(Deadline()));

    EXPECT_EQ(issued.misses, warm.misses);
    EXPECT_EQ(issued.reserved_bytes, warm.reserved_bytes);
    EXPECT_GT(issued.stream_ordered_hits, warm.stream_ordered_hits);
    // Each unit's parameters and gradient, once each.
    EXPECT_LE(warm.reserved_bytes, static_cast<int64_t>(2 * (class_a + class_b)));
    EXPECT_LE(
        rig.pool->stats().peak_bytes,
        static_cast<int64_t>(2 * 4 * (layout_a.total_elements() + layout_b.total_elements())));
    EXPECT_OK(gather.Synchronize(Deadline()));
    EXPECT_OK(reduce.Synchronize(Deadline()));
  });
}

}  // namespace
}  // namespace shardline
