// A small model for the tests of shardline-checkpoint and of the full-weight files
// (checkpoint_cli_test.cc, checkpoint_fixture.cc and through it tests/python/test_safetensors.py):
// three units with odd shapes, a tie, a scalar, an empty tensor and an f64 master, and one
// registered state ("adam.m", f32), every element a hashed value that the Python tests compute
// the same way (FixtureValue: an exact multiple of 2^-23 in [-1, 1), so f32 holds it exactly).
#ifndef SHARDLINE_TESTS_SCHEDULER_CHECKPOINT_CHECKPOINT_FIXTURE_H_
#define SHARDLINE_TESTS_SCHEDULER_CHECKPOINT_CHECKPOINT_FIXTURE_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/scheduler.h"
#include "tests/common/local_ranks.h"

namespace shardline::fixture {

inline constexpr absl::Duration kTimeout = absl::Seconds(60);
inline absl::Time Deadline() { return absl::Now() + kTimeout; }

// SplitMix64's finalizer.
inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
// Element i of tensor t of unit u of the values `seed` (1: the master weights, 2: adam.m):
// k / 2^23 - 1 for a 24-bit k.
inline float FixtureValue(uint64_t seed, uint64_t u, uint64_t t, uint64_t i) {
  const uint64_t k = Mix((seed << 56) ^ (u << 48) ^ (t << 32) ^ i) >> 40;
  return static_cast<float>(static_cast<double>(k) / 8388608.0 - 1.0);
}

// bf16 bits of `f` rounded to nearest even, from the definition (no NaN in the fixture).
inline uint16_t RoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t lower = bits & 0xFFFF;
  uint32_t upper = bits >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1) != 0)) ++upper;
  return static_cast<uint16_t>(upper);
}
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct UnitDef {
  std::string name;
  std::vector<TensorSpec> tensors;
  DType master = DType::kF32;
};

inline std::vector<UnitDef> Model() {
  return {{.name = "embed",
           .tensors = {{.name = "emb", .shape = {13, 7}},
                       {.name = "bias", .shape = {5}},
                       {.name = "head", .shape = {13, 7}, .tied_to = "emb"}}},
          {.name = "block",
           .tensors = {{.name = "w", .shape = {3, 5, 7}},
                       {.name = "scale", .shape = {}},
                       {.name = "empty", .shape = {0, 4}},
                       {.name = "b", .shape = {11}}}},
          {.name = "tail", .tensors = {{.name = "big", .shape = {1031}}}, .master = DType::kF64}};
}

// One rank: its compute stream, scheduler, adam.m states and checkpointer.
struct Rank {
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> sched;
  std::vector<std::vector<float>> adam;  // per unit, shard-shaped
  std::unique_ptr<Checkpointer> ckpt;
};

// The rank's units filled with the values (fill) or 0xCD garbage, and adam.m registered.
inline absl::StatusOr<std::unique_ptr<Rank>> MakeRank(std::shared_ptr<Communicator> comm,
                                                      int shard_size, bool fill,
                                                      FileSystem* fs = nullptr) {
  auto rank = std::make_unique<Rank>();
  SL_ASSIGN_OR_RETURN(rank->compute,
                      CreateCallerStream({.name = "compute", .wait_timeout = kTimeout}));
  SchedulerOptions options;
  if (shard_size > 0 && shard_size < comm->size()) {
    options.strategy = ShardingStrategy::kHybridShard;
    options.shard_size = shard_size;
  }
  SL_ASSIGN_OR_RETURN(rank->sched, Scheduler::Create(comm, *rank->compute, options, Deadline()));
  const std::vector<UnitDef> model = Model();
  for (size_t u = 0; u < model.size(); ++u) {
    UnitSpec spec{.name = model[u].name, .tensors = model[u].tensors};
    spec.policy.precision.master_dtype = model[u].master;
    SL_ASSIGN_OR_RETURN(int id, rank->sched->RegisterUnit(std::move(spec)));
    FlatParameter& unit = rank->sched->unit(id);
    if (fill) {
      std::vector<std::vector<float>> full(model[u].tensors.size());
      std::vector<const void*> ptrs;
      for (size_t t = 0; t < full.size(); ++t) {
        full[t].resize(unit.layout().tensor(t).numel);
        for (size_t i = 0; i < full[t].size(); ++i) full[t][i] = FixtureValue(1, u, t, i);
        ptrs.push_back(full[t].data());
      }
      SL_RETURN_IF_ERROR(unit.SetShardFromTensors(ptrs, Deadline()));
    } else {
      FlatShardView master = unit.master_shard();
      std::memset(master.data, 0xCD, master.elements * DTypeSize(master.dtype));
    }
  }
  SL_ASSIGN_OR_RETURN(
      rank->ckpt,
      Checkpointer::Create(*rank->sched,
                           {.file_system = fs, .checksum_block_bytes = 60, .read_chunk_bytes = 180},
                           Deadline()));
  const int shard = rank->sched->mesh().shard_rank();
  rank->adam.resize(model.size());
  for (size_t u = 0; u < model.size(); ++u) {
    const FlatLayout& layout = rank->sched->unit(u).layout();
    rank->adam[u].assign(layout.shard_elements(), 0.0f);
    for (const ShardSlice& s : layout.ShardSlices(shard)) {
      for (size_t j = 0; j < s.length; ++j) {
        rank->adam[u][s.shard_offset + j] = FixtureValue(2, u, s.tensor, s.tensor_offset + j);
      }
    }
    SL_RETURN_IF_ERROR(rank->ckpt->AddState({.unit = static_cast<int>(u),
                                             .name = "adam.m",
                                             .data = rank->adam[u].data(),
                                             .dtype = DType::kF32}));
  }
  return rank;
}

// Runs fn(rank, communicator) on `world` threads; returns their statuses.
inline std::vector<absl::Status> RunRanks(
    int world, const std::function<absl::Status(int, std::shared_ptr<Communicator>)>& fn) {
  return testing::RunLocalRanks(world, kTimeout, fn);
}

// The first error of `statuses` (OK if none).
inline absl::Status FirstError(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) return Annotate(statuses[r], absl::StrCat("rank ", r));
  }
  return absl::OkStatus();
}

// The number of master-shard elements of this rank that differ from the values as stored in
// `file_dtype` (f32/f64: exact; bf16: rounded to nearest even) and widened to the master dtype,
// plus the padding elements that are not zero.
inline size_t CountWrongElements(const Scheduler& sched, DType file_dtype) {
  const int shard = sched.mesh().shard_rank();
  size_t wrong = 0;
  for (int u = 0; u < sched.num_units(); ++u) {
    const FlatParameter& unit = sched.unit(u);
    const FlatLayout& layout = unit.layout();
    const DType master = unit.policy().master_dtype;
    const size_t size = DTypeSize(master);
    const char* data = static_cast<const char*>(unit.master_shard().data);
    for (const ShardSlice& s : layout.ShardSlices(shard)) {
      for (size_t j = 0; j < s.length; ++j) {
        float f = FixtureValue(1, u, s.tensor, s.tensor_offset + j);
        if (file_dtype == DType::kBF16) f = Bf16ToFloat(RoundToBf16(f));
        const double d = f;
        if (std::memcmp(master == DType::kF64 ? static_cast<const void*>(&d) : &f,
                        data + (s.shard_offset + j) * size, size) != 0) {
          ++wrong;
        }
      }
    }
    const size_t begin = layout.ShardBegin(shard);
    for (const PaddingRange& p : layout.ShardPadding(shard)) {
      for (size_t b = (p.begin - begin) * size; b < (p.end - begin) * size; ++b) {
        wrong += data[b] != 0;
      }
    }
  }
  return wrong;
}

}  // namespace shardline::fixture

#endif  // SHARDLINE_TESTS_SCHEDULER_CHECKPOINT_CHECKPOINT_FIXTURE_H_
