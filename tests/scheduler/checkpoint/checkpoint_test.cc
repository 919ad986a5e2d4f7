// Sharded checkpoints (scheduler/checkpoint/) over the local backend, ranks as threads, on the
// real file system under the test's temporary directory:
//   * CRC-32C against published check values and a bit-at-a-time reference;
//   * save at world 4 (full shard), load at 2, 3, 1 and hybrid 2 x 2, and save at hybrid 2 x 2,
//     load at 3: every master-shard element and every registered state (f32, f64, bf16, i64;
//     hashed bits, odd shapes, a tie, a scalar, an empty tensor, an f64 master) bit-identical to
//     the reference gathered from the saving ranks, every padding element zero;
//   * the manifest: the mesh, one file per shard, no absolute path, a round trip through JSON;
//   * the order of file operations: every file fsynced and closed before the rename, the
//     manifest written last, the directory fsynced before and its parent after the rename;
//   * a failure injected at every file operation of every rank of a save: every rank fails, the
//     earlier checkpoint still loads bit-identically, the partial one is reported incomplete;
//   * background saves (SaveAsync): training steps on an asynchronous compute stream change
//     every state and run collectives while the writer is held back, and the checkpoint holds
//     the snapshot bit for bit; a second save waits for the first; a failure injected at every
//     file operation of the background writer of every rank reaches every rank (through
//     WaitForSave, or the next save if nobody collected it); the snapshot cap; destruction
//     finishes a pending save;
//   * corruption and mismatches, each a named error: a flipped byte, a truncated file, a deleted
//     file, an edited shape in the manifest, a unit of another shape, a missing state, another
//     master dtype, an incomplete directory, an existing target, a garbled manifest, a path
//     that is a plain file, ranks that pass different paths (save and load), a FIFO in place
//     of the manifest or of a data file (a load fails at once, bounded by the test).
#include "scheduler/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/crc32c.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/manifest.h"
#include "scheduler/scheduler.h"
#include "tests/common/local_ranks.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kTimeout = absl::Seconds(30);
absl::Time Deadline() { return absl::Now() + kTimeout; }

using ::shardline::testing::HashMix;
uint64_t Hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return HashMix(HashMix(HashMix(HashMix(a) ^ b) ^ c) ^ d);
}
// A float in [-1, 1) from the key.
float HashFloat(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return static_cast<float>(static_cast<double>(Hash(a, b, c, d) >> 11) / 4503599627370496.0 - 1.0);
}

// ---- CRC-32C ------------------------------------------------------------------------------

// Bit at a time, straight from the definition: the independent reference.
uint32_t SlowCrc32c(const unsigned char* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
  }
  return ~crc;
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  // RFC 3720 appendix B.4.
  unsigned char buf[32];
  std::memset(buf, 0, 32);
  EXPECT_EQ(Crc32c(buf, 32), 0x8A9136AAu);
  std::memset(buf, 0xFF, 32);
  EXPECT_EQ(Crc32c(buf, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(Crc32c(buf, 32), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(Crc32c(buf, 32), 0x113FDB5Cu);
}

TEST(Crc32cTest, MatchesReferenceAtEveryLengthAndSplit) {
  std::vector<unsigned char> data(301);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(Hash(7, i, 0, 0));
  for (size_t n = 0; n <= data.size(); ++n) {
    // Unaligned starts too: the 8-byte steps must not depend on alignment.
    const size_t start = n % 5;
    const size_t len = std::min(n, data.size() - start);
    const uint32_t want = SlowCrc32c(data.data() + start, len);
    ASSERT_EQ(Crc32c(data.data() + start, len), want) << "length " << len;
    const size_t split = len / 3;
    ASSERT_EQ(
        Crc32cExtend(Crc32c(data.data() + start, split), data.data() + start + split, len - split),
        want);
  }
}

// ---- The model ----------------------------------------------------------------------------

struct StateDef {
  std::string name;
  DType dtype;
};

// A unit as the test defines it (UnitSpec itself holds a Buffer: not copyable).
struct UnitDef {
  std::string name;
  std::vector<TensorSpec> tensors;
  UnitPolicy policy;
};

struct Model {
  std::vector<UnitDef> units;
  std::vector<std::vector<StateDef>> states;  // per unit, registered states
};

Model MakeModel() {
  Model m;
  m.units.push_back({.name = "embed",
                     .tensors = {{.name = "emb", .shape = {13, 7}},
                                 {.name = "bias", .shape = {5}},
                                 {.name = "head", .shape = {13, 7}, .tied_to = "emb"}}});
  m.units.push_back({.name = "block",
                     .tensors = {{.name = "w", .shape = {3, 5, 7}},
                                 {.name = "scale", .shape = {}},
                                 {.name = "empty", .shape = {0, 4}},
                                 {.name = "b", .shape = {11}}}});
  UnitDef tail{.name = "tail", .tensors = {{.name = "big", .shape = {1031}}}};
  tail.policy.precision.master_dtype = DType::kF64;
  m.units.push_back(tail);
  const std::vector<StateDef> adam = {
      {"adam.m", DType::kF32}, {"adam.v", DType::kF64}, {"ema", DType::kBF16}};
  m.states = {adam, adam, {{"adam.m", DType::kF32}, {"step", DType::kI64}}};
  return m;
}

// The saved bits of element i of tensor t of state k (0: the master shard) of unit u; `version`
// salts them (0: what MakeRank fills in; others: the shards after a training step).
void ElementBits(int u, int k, int t, size_t i, DType dtype, char* out, int version = 0) {
  const uint64_t salt = 7919 * static_cast<uint64_t>(version);
  if (k == 0) {
    const float f = HashFloat(1 + salt, u, t, i);
    if (dtype == DType::kF64) {
      const double d = f;
      std::memcpy(out, &d, 8);
    } else {
      std::memcpy(out, &f, 4);
    }
    return;
  }
  const uint64_t h = Hash(100 + k + salt, u, t, i);
  std::memcpy(out, &h, DTypeSize(dtype));
}

// reference[u][k][t]: the bytes of tensor t (numel elements of the state's dtype).
using Reference = std::vector<std::vector<std::vector<std::string>>>;

struct RunConfig {
  int world = 4;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_size = 0;
  uint64_t block_bytes = 64;
  bool fill = true;  // false: shards and states hold garbage (0xCD) instead of the values
  std::function<void(Model&)> edit;
  bool host_compute = false;  // the compute stream: a host stream (asynchronous), else a caller one
  uint64_t max_snapshot_bytes = 0;
  bool replicated = false;  // registers kReplicated (rank 0 filled with version 0, others 0xAB)
  std::function<void(std::vector<CheckpointReplicatedState>&)> edit_replicated;
  bool stable_states = false;  // registers the states with CheckpointState::stable
};

// The replicated states of the tests: a scalar step counter, a small f64 vector, odd-sized bytes
// and an empty one (data filled in by MakeRank).
std::vector<CheckpointReplicatedState> ReplicatedDefs() {
  return {{.name = "step", .shape = {}, .dtype = DType::kI64},
          {.name = "lr.schedule", .shape = {3}, .dtype = DType::kF64},
          {.name = "rng", .shape = {5}, .dtype = DType::kU8},
          {.name = "none", .shape = {0, 2}, .dtype = DType::kF32}};
}

size_t Numel(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (const int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

// The bytes of replicated state `i` at `version`.
std::string ReplicatedBytes(size_t i, const CheckpointReplicatedState& def, int version) {
  std::string out(Numel(def.shape) * DTypeSize(def.dtype), '\0');
  for (size_t b = 0; b < out.size(); ++b) {
    out[b] = static_cast<char>(Hash(900 + version, i, b, 0));
  }
  return out;
}

// One rank: its compute stream, scheduler, states and checkpointer (destroyed in reverse).
struct Rank {
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> sched;
  Model model;
  std::vector<std::vector<std::vector<char>>> states;  // [u][k - 1]
  std::vector<CheckpointReplicatedState> replicated_defs;
  std::vector<std::string> replicated;  // their memory
  std::unique_ptr<Checkpointer> ckpt;

  DType StateDType(int u, int k) const {
    return k == 0 ? sched->unit(u).policy().master_dtype : model.states[u][k - 1].dtype;
  }
  char* StateData(int u, int k) const {
    return k == 0 ? static_cast<char*>(sched->unit(u).master_shard().data)
                  : const_cast<char*>(states[u][k - 1].data());
  }
  int NumStates(int u) const { return 1 + static_cast<int>(model.states[u].size()); }
};

absl::StatusOr<std::unique_ptr<Rank>> MakeRank(const RunConfig& setup,
                                               std::shared_ptr<Communicator> comm, FileSystem* fs) {
  auto rank = std::make_unique<Rank>();
  rank->model = MakeModel();
  if (setup.edit) setup.edit(rank->model);
  const StreamOptions compute{.name = absl::StrCat("rank", comm->rank(), ".compute"),
                              .wait_timeout = kTimeout};
  SL_ASSIGN_OR_RETURN(rank->compute,
                      setup.host_compute ? CreateHostStream(compute) : CreateCallerStream(compute));
  SL_ASSIGN_OR_RETURN(
      rank->sched,
      Scheduler::Create(comm, *rank->compute,
                        {.strategy = setup.strategy, .shard_size = setup.shard_size}, Deadline()));
  for (size_t u = 0; u < rank->model.units.size(); ++u) {
    const UnitDef& spec = rank->model.units[u];
    SL_ASSIGN_OR_RETURN(int id,
                        rank->sched->RegisterUnit(
                            {.name = spec.name, .tensors = spec.tensors, .policy = spec.policy}));
    FlatParameter& unit = rank->sched->unit(id);
    if (setup.fill) {
      std::vector<std::vector<float>> full(spec.tensors.size());
      std::vector<const void*> ptrs;
      for (size_t t = 0; t < spec.tensors.size(); ++t) {
        full[t].resize(unit.layout().tensor(t).numel);
        for (size_t i = 0; i < full[t].size(); ++i) full[t][i] = HashFloat(1, u, t, i);
        ptrs.push_back(full[t].data());
      }
      SL_RETURN_IF_ERROR(unit.SetShardFromTensors(ptrs, Deadline()));
    } else {
      FlatShardView master = unit.master_shard();
      std::memset(master.data, 0xCD, master.elements * DTypeSize(master.dtype));
    }
  }
  SL_ASSIGN_OR_RETURN(rank->ckpt,
                      Checkpointer::Create(*rank->sched,
                                           {.file_system = fs,
                                            .checksum_block_bytes = setup.block_bytes,
                                            .read_chunk_bytes = 3 * setup.block_bytes,
                                            .max_snapshot_bytes = setup.max_snapshot_bytes},
                                           Deadline()));
  rank->states.resize(rank->model.units.size());
  for (size_t u = 0; u < rank->model.units.size(); ++u) {
    const FlatLayout& layout = rank->sched->unit(u).layout();
    const int shard = rank->sched->mesh().shard_rank();
    for (size_t s = 0; s < rank->model.states[u].size(); ++s) {
      const StateDef& def = rank->model.states[u][s];
      const size_t size = DTypeSize(def.dtype);
      std::vector<char> data(layout.shard_elements() * size, static_cast<char>(0xCD));
      if (setup.fill) {
        for (const ShardSlice& slice : layout.ShardSlices(shard)) {
          for (size_t j = 0; j < slice.length; ++j) {
            ElementBits(u, s + 1, slice.tensor, slice.tensor_offset + j, def.dtype,
                        &data[(slice.shard_offset + j) * size]);
          }
        }
      }
      rank->states[u].push_back(std::move(data));
      SL_RETURN_IF_ERROR(rank->ckpt->AddState({.unit = static_cast<int>(u),
                                               .name = def.name,
                                               .data = rank->states[u].back().data(),
                                               .dtype = def.dtype,
                                               .stable = setup.stable_states}));
    }
  }
  if (setup.replicated) {
    rank->replicated_defs = ReplicatedDefs();
    if (setup.edit_replicated) setup.edit_replicated(rank->replicated_defs);
    for (size_t i = 0; i < rank->replicated_defs.size(); ++i) {
      const CheckpointReplicatedState& def = rank->replicated_defs[i];
      rank->replicated.push_back(
          comm->rank() == 0 && setup.fill
              ? ReplicatedBytes(i, def, 0)
              : std::string(Numel(def.shape) * DTypeSize(def.dtype), static_cast<char>(0xAB)));
    }
    for (size_t i = 0; i < rank->replicated_defs.size(); ++i) {
      CheckpointReplicatedState def = rank->replicated_defs[i];
      def.data = rank->replicated[i].data();
      SL_RETURN_IF_ERROR(rank->ckpt->AddReplicatedState(def));
    }
  }
  return rank;
}

// Runs fn(rank index, communicator) on `world` threads; returns their statuses.
std::vector<absl::Status> RunRanks(
    int world, const std::function<absl::Status(int, std::shared_ptr<Communicator>)>& fn) {
  return testing::RunLocalRanks(world, kTimeout, fn);
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
  }
}

// Adds this rank's shard of every state to `ref` (the gathered reference).
void Gather(const Rank& rank, Reference* ref, std::mutex* mu) {
  std::lock_guard<std::mutex> lock(*mu);
  const int shard = rank.sched->mesh().shard_rank();
  ref->resize(rank.model.units.size());
  for (size_t u = 0; u < rank.model.units.size(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    (*ref)[u].resize(rank.NumStates(u));
    for (int k = 0; k < rank.NumStates(u); ++k) {
      const size_t size = DTypeSize(rank.StateDType(u, k));
      auto& tensors = (*ref)[u][k];
      tensors.resize(layout.num_tensors());
      for (int t = 0; t < layout.num_tensors(); ++t) {
        tensors[t].resize(layout.tensor(t).numel * size);
      }
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        std::memcpy(&tensors[s.tensor][s.tensor_offset * size],
                    rank.StateData(u, k) + s.shard_offset * size, s.length * size);
      }
    }
  }
}

// Writes version `version` of every state's elements into this rank's shards (what a training
// step does to them), padding as zeros.
void FillShards(const Rank& rank, int version) {
  const int shard = rank.sched->mesh().shard_rank();
  for (size_t u = 0; u < rank.model.units.size(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    for (int k = 0; k < rank.NumStates(u); ++k) {
      const DType dtype = rank.StateDType(u, k);
      const size_t size = DTypeSize(dtype);
      char* data = rank.StateData(u, k);
      std::memset(data, 0, layout.shard_elements() * size);
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        for (size_t j = 0; j < s.length; ++j) {
          ElementBits(u, k, s.tensor, s.tensor_offset + j, dtype,
                      data + (s.shard_offset + j) * size, version);
        }
      }
    }
  }
}

// The reference of version `version` of the model, straight from ElementBits.
Reference MakeReference(const Rank& rank, int version) {
  Reference ref(rank.model.units.size());
  for (size_t u = 0; u < ref.size(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    for (int k = 0; k < rank.NumStates(u); ++k) {
      const DType dtype = rank.StateDType(u, k);
      const size_t size = DTypeSize(dtype);
      std::vector<std::string> tensors(layout.num_tensors());
      for (int t = 0; t < layout.num_tensors(); ++t) {
        tensors[t].resize(layout.tensor(t).numel * size);
        for (size_t i = 0; i < layout.tensor(t).numel; ++i) {
          ElementBits(u, k, t, i, dtype, &tensors[t][i * size], version);
        }
      }
      ref[u].push_back(std::move(tensors));
    }
  }
  return ref;
}

// Every element of this rank's shards equals the reference's bits; every padding byte is 0.
void ExpectMatches(const Rank& rank, const Reference& ref, absl::string_view label) {
  const int shard = rank.sched->mesh().shard_rank();
  for (size_t u = 0; u < rank.model.units.size(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    for (int k = 0; k < rank.NumStates(u); ++k) {
      const size_t size = DTypeSize(rank.StateDType(u, k));
      const char* data = rank.StateData(u, k);
      size_t mismatches = 0;
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        for (size_t j = 0; j < s.length; ++j) {
          if (std::memcmp(data + (s.shard_offset + j) * size,
                          &ref[u][k][s.tensor][(s.tensor_offset + j) * size], size) != 0) {
            ++mismatches;
          }
        }
      }
      const size_t begin = layout.ShardBegin(shard);
      size_t dirty = 0;
      for (const PaddingRange& p : layout.ShardPadding(shard)) {
        for (size_t b = (p.begin - begin) * size; b < (p.end - begin) * size; ++b) {
          if (data[b] != 0) ++dirty;
        }
      }
      EXPECT_EQ(mismatches, 0u) << label << ": unit " << u << " state " << k << " shard " << shard;
      EXPECT_EQ(dirty, 0u) << label << ": padding bytes not zero, unit " << u << " state " << k;
    }
  }
}

// The reference agrees with the values the ranks were given (an independent check that the
// gathered reference is the saved state, not an artefact of the gathering).
void ExpectReferenceIsTheModel(const Reference& ref) {
  Model m = MakeModel();
  ASSERT_EQ(ref.size(), m.units.size());
  for (size_t u = 0; u < ref.size(); ++u) {
    for (size_t k = 0; k < ref[u].size(); ++k) {
      const DType dtype =
          k == 0 ? m.units[u].policy.precision.master_dtype : m.states[u][k - 1].dtype;
      const size_t size = DTypeSize(dtype);
      for (size_t t = 0; t < ref[u][k].size(); ++t) {
        if (!m.units[u].tensors[t].tied_to.empty()) continue;
        const std::string& bytes = ref[u][k][t];
        char want[8];
        for (size_t i = 0; i * size < bytes.size(); ++i) {
          ElementBits(u, k, t, i, dtype, want);
          ASSERT_EQ(std::memcmp(want, &bytes[i * size], size), 0)
              << "unit " << u << " state " << k << " tensor " << t << " element " << i;
        }
      }
    }
  }
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) /
            absl::StrCat("shardline_ckpt_", getpid(), "_", info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::string Dir(absl::string_view name) const { return (root_ / std::string(name)).string(); }

  // Saves the model under `setup` into `dir`; returns the reference gathered from the ranks.
  Reference SaveModel(const RunConfig& setup, const std::string& dir) {
    Reference ref;
    std::mutex mu;
    ExpectAllOk(RunRanks(setup.world, [&](int r, std::shared_ptr<Communicator> comm) {
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, nullptr));
      if (rank->sched->mesh().replicate_rank() == 0) Gather(*rank, &ref, &mu);
      return rank->ckpt->Save(dir, Deadline());
    }));
    return ref;
  }

  // Loads `dir` under `setup` (shards start as garbage) and checks every rank against `ref`.
  // The values of every state at `version` (a fresh world-1 rank's reference: built from the
  // hash, never read from the ranks).
  Reference ReferenceAt(int version) {
    Reference ref;
    ExpectAllOk(RunRanks(1, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 1}, comm, nullptr));
      ref = MakeReference(*rank, version);
      return absl::OkStatus();
    }));
    return ref;
  }

  void LoadAndCheck(const RunConfig& setup, const std::string& dir, const Reference& ref,
                    absl::string_view label) {
    RunConfig s = setup;
    s.fill = false;
    ExpectAllOk(RunRanks(s.world, [&](int r, std::shared_ptr<Communicator> comm) {
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank(s, comm, nullptr));
      SL_RETURN_IF_ERROR(rank->ckpt->Load(dir, Deadline()));
      ExpectMatches(*rank, ref, absl::StrCat(label, " rank ", r));
      return absl::OkStatus();
    }));
  }

  // Loads `dir` under `setup`; returns every rank's status.
  std::vector<absl::Status> TryLoad(const RunConfig& setup, const std::string& dir) {
    RunConfig s = setup;
    s.fill = false;
    return RunRanks(s.world, [&](int r, std::shared_ptr<Communicator> comm) {
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank(s, comm, nullptr));
      return rank->ckpt->Load(dir, Deadline());
    });
  }

  fs::path root_;
};

TEST_F(CheckpointTest, SaveAtFourLoadsAtTwoThreeOneAndHybrid) {
  const std::string dir = Dir("step1");
  const Reference ref = SaveModel({.world = 4}, dir);
  ExpectReferenceIsTheModel(ref);

  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), dir);
  ASSERT_OK(m.status());
  EXPECT_EQ(m->world_size, 4);
  EXPECT_EQ(m->replicate_size, 1);
  EXPECT_EQ(m->shard_size, 4);
  EXPECT_EQ(m->library_version, "0.1.0");
  EXPECT_EQ(m->checksum_block_bytes, 64u);
  ASSERT_EQ(m->files.size(), 4u);
  ASSERT_EQ(m->units.size(), 3u);
  EXPECT_EQ(m->units[1].states.size(), 4u);
  EXPECT_EQ(m->units[2].states[2].name, "step");
  for (const CheckpointFileRecord& f : m->files) {
    EXPECT_EQ(f.name.find('/'), std::string::npos) << f.name;
    EXPECT_EQ(fs::file_size(fs::path(dir) / f.name), f.bytes) << f.name;
  }
  // No absolute path (nor the directory's own name) anywhere in the manifest.
  std::ifstream in(fs::path(dir) / "manifest.json");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_FALSE(absl::StrContains(text.str(), root_.string())) << text.str();
  // A round trip through the JSON form changes nothing.
  absl::StatusOr<CheckpointManifest> again = ParseCheckpointManifest(CheckpointManifestToJson(*m));
  ASSERT_OK(again.status());
  EXPECT_EQ(CheckpointManifestToJson(*again), text.str());
  // The directory holds the manifest and the four shard files only (no temporary left behind).
  int entries = 0;
  for (const auto& e : fs::directory_iterator(root_)) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "step1");
  }
  EXPECT_EQ(entries, 1);

  LoadAndCheck({.world = 2}, dir, ref, "world 2");
  LoadAndCheck({.world = 3}, dir, ref, "world 3");
  LoadAndCheck({.world = 1}, dir, ref, "world 1");
  LoadAndCheck({.world = 4}, dir, ref, "world 4");
  LoadAndCheck({.world = 4, .strategy = ShardingStrategy::kHybridShard, .shard_size = 2}, dir, ref,
               "hybrid 2x2");
}

TEST_F(CheckpointTest, HybridSaveWritesOneReplicaAndLoadsAtThree) {
  const std::string dir = Dir("hybrid");
  const RunConfig hybrid{
      .world = 4, .strategy = ShardingStrategy::kHybridShard, .shard_size = 2, .block_bytes = 40};
  const Reference ref = SaveModel(hybrid, dir);
  ExpectReferenceIsTheModel(ref);
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), dir);
  ASSERT_OK(m.status());
  EXPECT_EQ(m->replicate_size, 2);
  EXPECT_EQ(m->shard_size, 2);
  ASSERT_EQ(m->files.size(), 2u);
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 3);  // two shard files and the manifest
  LoadAndCheck({.world = 3}, dir, ref, "world 3 from hybrid");
  LoadAndCheck(hybrid, dir, ref, "hybrid from hybrid");
}

// At world 3 from world 4, each rank reads exactly the checksum blocks that cover what its shard
// owns (computed here from the manifest and the new layouts), a fraction of the whole.
TEST_F(CheckpointTest, LoadReadsOnlyTheBlocksItNeeds) {
  const std::string dir = Dir("step1");
  const Reference ref = SaveModel({.world = 4}, dir);
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), dir);
  ASSERT_OK(m.status());
  uint64_t total = 0;
  for (const CheckpointFileRecord& f : m->files) total += f.bytes;
  const uint64_t block = m->checksum_block_bytes;

  std::vector<uint64_t> read(3, 0), expected(3, 0);
  ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) {
    RecordingFileSystem recorder;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 3, .fill = false}, comm, &recorder));
    SL_RETURN_IF_ERROR(rank->ckpt->Load(dir, Deadline()));
    ExpectMatches(*rank, ref, absl::StrCat("world 3 rank ", r));
    for (const FileRead& f : recorder.reads()) {
      if (absl::EndsWith(f.path, ".bin")) read[r] += f.bytes;
    }
    const int shard = rank->sched->mesh().shard_rank();
    for (size_t u = 0; u < m->units.size(); ++u) {
      const FlatLayout& layout = rank->sched->unit(u).layout();
      for (const CheckpointStateRecord& state : m->units[u].states) {
        const uint64_t size = DTypeSize(state.dtype);
        for (const ShardSlice& s : layout.ShardSlices(shard)) {
          for (const CheckpointPiece& p : state.pieces) {
            if (p.tensor != s.tensor) continue;
            const uint64_t lo = std::max<uint64_t>(s.tensor_offset, p.tensor_offset);
            const uint64_t hi =
                std::min<uint64_t>(s.tensor_offset + s.length, p.tensor_offset + p.elements);
            if (lo >= hi) continue;
            const uint64_t a = (lo - p.tensor_offset) * size / block * block;
            const uint64_t b =
                std::min(((hi - p.tensor_offset) * size + block - 1) / block * block, p.bytes);
            expected[r] += b - a;
          }
        }
      }
    }
    return absl::OkStatus();
  }));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(read[r], expected[r]) << "rank " << r;
    EXPECT_LT(read[r], total / 2) << "rank " << r << " of 3 read " << read[r] << " of " << total;
  }
}

TEST_F(CheckpointTest, FilesAreSyncedBeforeTheRenameAndTheParentAfter) {
  const std::string dir = Dir("ordered");
  RecordingFileSystem recorder;
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 4}, comm, &recorder));
    return rank->ckpt->Save(dir, Deadline());
  }));
  const std::vector<FileOperation> ops = recorder.operations();
  std::stringstream log;
  for (size_t i = 0; i < ops.size(); ++i) log << i << ": " << ops[i] << "\n";
  SCOPED_TRACE(log.str());

  using Kind = FileOperation::Kind;
  ASSERT_FALSE(ops.empty());
  ASSERT_EQ(ops[0].kind, Kind::kCreateDir);
  const std::string tmp = ops[0].path;
  EXPECT_TRUE(absl::StartsWith(tmp, dir + ".tmp-")) << tmp;
  size_t rename = ops.size();
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == Kind::kRename) {
      EXPECT_EQ(rename, ops.size()) << "two renames";
      rename = i;
      EXPECT_EQ(ops[i].path, tmp);
      EXPECT_EQ(ops[i].to, dir);
    }
  }
  ASSERT_LT(rename, ops.size());
  // Every file: created, written, fsynced, closed, all before the rename; the manifest's
  // creation follows the close of every data file.
  std::vector<std::string> files;
  size_t last_data_close = 0, manifest_created = ops.size(), last_close = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind != Kind::kCreateFile) continue;
    const std::string& path = ops[i].path;
    files.push_back(path);
    EXPECT_TRUE(absl::StartsWith(path, tmp + "/")) << path;
    size_t sync = ops.size(), close = ops.size();
    for (size_t j = i + 1; j < ops.size(); ++j) {
      if (ops[j].path != path) continue;
      if (ops[j].kind == Kind::kSync && sync == ops.size()) sync = j;
      if (ops[j].kind == Kind::kClose) close = j;
      if (ops[j].kind == Kind::kAppend) {
        EXPECT_EQ(sync, ops.size()) << "append after fsync";
      }
    }
    EXPECT_LT(sync, close) << path;
    EXPECT_LT(close, rename) << path;
    last_close = std::max(last_close, close);
    if (absl::EndsWith(path, "/manifest.json")) {
      manifest_created = i;
    } else {
      last_data_close = std::max(last_data_close, close);
    }
  }
  EXPECT_EQ(files.size(), 5u);  // four shards and the manifest
  EXPECT_LT(last_data_close, manifest_created);
  // The directory is fsynced after the last file, before the rename; the parent after it.
  size_t dir_sync = ops.size();
  for (size_t i = 0; i < rename; ++i) {
    if (ops[i].kind == Kind::kSyncDir && ops[i].path == tmp) dir_sync = i;
  }
  EXPECT_GT(dir_sync, last_close);
  EXPECT_LT(dir_sync, rename);
  ASSERT_EQ(rename + 2, ops.size());
  EXPECT_EQ(ops[rename + 1].kind, Kind::kSyncDir);
  EXPECT_EQ(ops[rename + 1].path, root_.string());
}

TEST_F(CheckpointTest, FailureAtEveryOperationKeepsThePreviousCheckpoint) {
  const std::string previous = Dir("previous");
  const Reference ref = SaveModel({.world = 4, .replicated = true}, previous);

  // How many file operations each rank performs in a save.
  std::vector<int64_t> counts(4, 0);
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) {
    RecordingFileSystem recorder;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 4, .replicated = true}, comm, &recorder));
    SL_RETURN_IF_ERROR(rank->ckpt->Save(Dir("count"), Deadline()));
    counts[r] = recorder.operation_count();
    return absl::OkStatus();
  }));
  for (int r = 0; r < 4; ++r) ASSERT_GT(counts[r], 3) << "rank " << r;

  struct Case {
    int rank;
    int64_t op;
    std::string dir;
  };
  std::vector<Case> cases;
  for (int r = 0; r < 4; ++r) {
    for (int64_t k = 0; k < counts[r]; ++k) {
      cases.push_back({r, k, Dir(absl::StrCat("failed_r", r, "_op", k))});
    }
  }
  // The failing rank's last logged operation, per case (what failed).
  std::vector<FileOperation> failed_op(cases.size());
  std::vector<std::vector<absl::Status>> outcomes(cases.size(), std::vector<absl::Status>(4));
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) {
    RecordingFileSystem recorder;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 4, .replicated = true}, comm, &recorder));
    for (size_t c = 0; c < cases.size(); ++c) {
      recorder.Reset();
      if (cases[c].rank == r) recorder.FailFrom(cases[c].op);
      outcomes[c][r] = rank->ckpt->Save(cases[c].dir, Deadline());
      if (cases[c].rank == r) {
        const std::vector<FileOperation> ops = recorder.operations();
        if (static_cast<int64_t>(ops.size()) > cases[c].op) failed_op[c] = ops[cases[c].op];
      }
    }
    // The earlier checkpoint loads bit-identically after all of that.
    for (int u = 0; u < rank->sched->num_units(); ++u) {
      for (int k = 0; k < rank->NumStates(u); ++k) {
        const FlatLayout& layout = rank->sched->unit(u).layout();
        std::memset(rank->StateData(u, k), 0xCD,
                    layout.shard_elements() * DTypeSize(rank->StateDType(u, k)));
      }
    }
    SL_RETURN_IF_ERROR(rank->ckpt->Load(previous, Deadline()));
    ExpectMatches(*rank, ref, absl::StrCat("previous, rank ", r));
    return absl::OkStatus();
  }));

  int renamed_cases = 0, manifest_cases = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& cs = cases[c];
    SCOPED_TRACE(absl::StrCat("failure at operation ", cs.op, " of rank ", cs.rank, " (",
                              FileOperationToString(failed_op[c]), ")"));
    for (int r = 0; r < 4; ++r) {
      EXPECT_FALSE(outcomes[c][r].ok()) << "rank " << r;
    }
    EXPECT_TRUE(absl::StrContains(outcomes[c][cs.rank].message(),
                                  absl::StrCat("injected failure at file operation ", cs.op)))
        << outcomes[c][cs.rank];
    for (int r = 0; r < 4; ++r) {
      if (r != cs.rank) {
        EXPECT_TRUE(IsPeerError(outcomes[c][r])) << outcomes[c][r];
        EXPECT_TRUE(absl::StrContains(outcomes[c][r].message(), "injected failure"))
            << outcomes[c][r];
      }
    }
    // What is on disk: the target only if the rename happened (then it is complete: only the
    // parent's fsync failed), otherwise at most one temporary directory, reported incomplete.
    std::vector<fs::path> temporaries;
    for (const auto& e : fs::directory_iterator(root_)) {
      if (absl::StartsWith(e.path().filename().string(),
                           fs::path(cs.dir).filename().string() + ".tmp-")) {
        temporaries.push_back(e.path());
      }
    }
    const bool renamed =
        failed_op[c].kind == FileOperation::Kind::kSyncDir && failed_op[c].path == root_.string();
    EXPECT_EQ(fs::exists(cs.dir), renamed);
    if (renamed) {
      ++renamed_cases;
      EXPECT_OK(ReadCheckpointManifest(PosixFileSystem(), cs.dir).status());
      EXPECT_TRUE(temporaries.empty());
      continue;
    }
    const bool created = !(cs.rank == 0 && cs.op == 0);  // op 0 of rank 0 creates the directory
    ASSERT_EQ(temporaries.size(), created ? 1u : 0u);
    if (created) {
      // A temporary directory that already holds its manifest is incomplete all the same.
      if (fs::exists(temporaries[0] / "manifest.json")) ++manifest_cases;
      absl::Status incomplete =
          ReadCheckpointManifest(PosixFileSystem(), temporaries[0].string()).status();
      EXPECT_TRUE(absl::IsFailedPrecondition(incomplete)) << incomplete;
      EXPECT_TRUE(absl::StrContains(incomplete.message(), "incomplete checkpoint")) << incomplete;
    }
  }

  EXPECT_EQ(renamed_cases, 1);   // the parent's fsync, rank 0's last operation
  EXPECT_GE(manifest_cases, 4);  // from the manifest's creation to the rename
  std::cout << cases.size() << " injected failures (operations per rank: " << counts[0] << ", "
            << counts[1] << ", " << counts[2] << ", " << counts[3] << ")\n";

  // A Load of a partial directory says so on every rank.
  std::string partial;
  for (const auto& e : fs::directory_iterator(root_)) {
    if (absl::StrContains(e.path().filename().string(), ".tmp-")) partial = e.path().string();
  }
  ASSERT_FALSE(partial.empty());
  for (const absl::Status& s : TryLoad({.world = 2}, partial)) {
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "incomplete checkpoint")) << s;
  }
}

// ---- Background saves ----------------------------------------------------------------------

// Forwards to the POSIX file system; CreateFile (which only a save's writers call, on the
// background thread in SaveAsync) waits until Open() (or its deadline: DeadlineExceeded).
class GatedFileSystem : public RecordingFileSystem {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreateFile(const std::string& path) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_until(lock, absl::ToChronoTime(Deadline()), [&] { return open_; })) {
        return absl::DeadlineExceededError("GatedFileSystem: the gate was not opened");
      }
    }
    return RecordingFileSystem::CreateFile(path);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// This rank's data file size in the manifest: what its snapshot holds.
uint64_t DataFileBytes(const Rank& rank) {
  const int shard = rank.sched->mesh().shard_rank();
  uint64_t bytes = 0;
  for (size_t u = 0; u < rank.model.units.size(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    for (int k = 0; k < rank.NumStates(u); ++k) {
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        bytes += s.length * DTypeSize(rank.StateDType(u, k));
      }
    }
  }
  return bytes;
}

// A training step on the asynchronous compute stream: new values of every state written by the
// stream's worker, then an all-reduce on the scheduler's world communicator (checked).
absl::Status TrainingStep(Rank& rank, int version) {
  SL_RETURN_IF_ERROR(rank.compute->Enqueue([&rank, version]() -> absl::Status {
    FillShards(rank, version);
    return absl::OkStatus();
  }));
  Communicator& world = *rank.sched->mesh().world();
  std::vector<float> x(37);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(world.rank() + i + version);
  SL_ASSIGN_OR_RETURN(
      Work work, world.AllReduce(x.data(), x.data(), x.size(), DType::kF32, *rank.compute, {}));
  SL_RETURN_IF_ERROR(work.Wait(Deadline()));
  const int n = world.size();
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = static_cast<float>(n * (n - 1) / 2 + n * (i + version));
    if (x[i] != want) return absl::InternalError(absl::StrCat("all-reduce element ", i));
  }
  return absl::OkStatus();
}

// Step 1's shards, written on the (host) compute stream, then a background save of them into
// `dir`: the snapshot is taken after the fill, in the compute stream's order.
absl::Status StartBackgroundSaveOfStep1(Rank& rank, const std::string& dir) {
  SL_RETURN_IF_ERROR(rank.compute->Enqueue([&rank]() -> absl::Status {
    FillShards(rank, 1);
    return absl::OkStatus();
  }));
  return rank.ckpt->SaveAsync(dir, Deadline());
}

// At world 3, with an asynchronous compute stream: the step before the save is still queued
// when SaveAsync is called (the snapshot must wait for it); three more steps change every state
// and run collectives on the scheduler's communicator while the background writer is held back
// (it cannot create its file until they are done); the checkpoint holds the snapshot bit for bit,
// the shards the latest step.
TEST_F(CheckpointTest, BackgroundSaveHoldsTheSnapshotWhileTrainingChangesTheShards) {
  const std::string dir = Dir("background");
  const RunConfig setup{.world = 3, .host_compute = true};
  std::vector<CheckpointSaveStats> stats(3);
  ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    GatedFileSystem gate;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, &gate));
    SL_RETURN_IF_ERROR(StartBackgroundSaveOfStep1(*rank, dir));
    EXPECT_TRUE(rank->ckpt->save_pending());
    const CheckpointSaveStats during = rank->ckpt->last_save_stats();
    EXPECT_TRUE(during.background);
    EXPECT_FALSE(during.finished);
    EXPECT_EQ(during.snapshot_bytes, DataFileBytes(*rank));
    for (int v = 2; v <= 4; ++v) SL_RETURN_IF_ERROR(TrainingStep(*rank, v));
    SL_RETURN_IF_ERROR(rank->compute->Synchronize(Deadline()));
    // Nothing of the save but rank 0's temporary directory exists yet.
    EXPECT_FALSE(fs::exists(dir));
    for (const FileOperation& op : gate.operations()) {
      EXPECT_EQ(op.kind, FileOperation::Kind::kCreateDir) << op;
    }
    gate.Open();
    SL_RETURN_IF_ERROR(rank->ckpt->WaitForSave(Deadline()));
    EXPECT_FALSE(rank->ckpt->save_pending());
    EXPECT_OK(rank->ckpt->WaitForSave(Deadline()));  // nothing pending: OK
    stats[r] = rank->ckpt->last_save_stats();
    ExpectMatches(*rank, MakeReference(*rank, 4), absl::StrCat("shards after step 4, rank ", r));
    return absl::OkStatus();
  }));
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(stats[r].finished);
    EXPECT_EQ(stats[r].dir, dir);
    EXPECT_GT(stats[r].snapshot_bytes, 0u);
    EXPECT_GE(stats[r].snapshot_capacity_bytes, stats[r].snapshot_bytes);
    EXPECT_GT(stats[r].write, absl::ZeroDuration());
    EXPECT_LE(stats[r].snapshot, stats[r].blocked);
  }
  // The reference is built independently from the hash, never read from the ranks.
  const Reference ref = ReferenceAt(1);
  LoadAndCheck({.world = 2}, dir, ref, "background save at 3, load at 2");
  LoadAndCheck({.world = 3}, dir, ref, "background save at 3, load at 3");
}

// Stable states (the framework's own copies for the save) stay out of the snapshot: SaveAsync
// copies the master shards only, and writes the states from the framework's memory. The master
// shards are overwritten while the writer is held back; the checkpoint still holds them as they
// were, and the states as registered.
TEST_F(CheckpointTest, BackgroundSaveWritesStableStatesWithoutCopyingThem) {
  const std::string dir = Dir("stable");
  const RunConfig setup{.world = 2, .host_compute = true, .stable_states = true};
  ExpectAllOk(RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    GatedFileSystem gate;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, &gate));
    SL_RETURN_IF_ERROR(StartBackgroundSaveOfStep1(*rank, dir));
    uint64_t master_bytes = 0;
    const int shard = rank->sched->mesh().shard_rank();
    for (size_t u = 0; u < rank->model.units.size(); ++u) {
      const FlatLayout& layout = rank->sched->unit(u).layout();
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        master_bytes += s.length * DTypeSize(rank->StateDType(u, 0));
      }
    }
    EXPECT_EQ(rank->ckpt->last_save_stats().snapshot_bytes, master_bytes) << "rank " << r;
    EXPECT_LT(master_bytes, DataFileBytes(*rank)) << "the model has states besides the master";
    for (size_t u = 0; u < rank->model.units.size(); ++u) {
      std::memset(
          rank->StateData(u, 0), 0x5A,
          rank->sched->unit(u).layout().shard_elements() * DTypeSize(rank->StateDType(u, 0)));
    }
    gate.Open();
    return rank->ckpt->WaitForSave(Deadline());
  }));
  const Reference ref = ReferenceAt(1);
  LoadAndCheck({.world = 2}, dir, ref, "stable states, background save at 2, load at 2");
}

// A second save waits for the first: while the first's writer is held back, a Save with a short
// deadline gives up without starting (no directory of its own), and once the first is done the
// second runs after it (every operation of the first, its rename included, precedes the
// second's).
TEST_F(CheckpointTest, SecondSaveWaitsForTheFirst) {
  const std::string first = Dir("first"), second = Dir("second"), third = Dir("third");
  std::vector<std::vector<FileOperation>> logs(2);
  ExpectAllOk(RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    GatedFileSystem gate;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 2, .host_compute = true}, comm, &gate));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(first, Deadline()));
    const absl::Status early = rank->ckpt->Save(second, absl::Now() + absl::Milliseconds(50));
    EXPECT_TRUE(absl::IsDeadlineExceeded(early)) << early;
    EXPECT_TRUE(absl::StrContains(early.message(), "still running")) << early;
    EXPECT_TRUE(rank->ckpt->save_pending());
    gate.Open();
    SL_RETURN_IF_ERROR(rank->ckpt->Save(second, Deadline()));
    EXPECT_FALSE(rank->ckpt->save_pending());
    // A SaveAsync after a SaveAsync waits too, then both outcomes are OK.
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(third, Deadline()));
    SL_RETURN_IF_ERROR(rank->ckpt->WaitForSave(Deadline()));
    logs[r] = gate.operations();
    return absl::OkStatus();
  }));
  for (int r = 0; r < 2; ++r) {
    const std::vector<FileOperation>& ops = logs[r];
    std::vector<int> save_of(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const std::string& p = ops[i].path;
      save_of[i] = absl::StartsWith(p, first)    ? 0
                   : absl::StartsWith(p, second) ? 1
                   : absl::StartsWith(p, third)  ? 2
                                                 : -1;
      if (ops[i].kind == FileOperation::Kind::kSyncDir && p == root_.string()) {
        save_of[i] = i > 0 ? save_of[i - 1] : -1;  // the parent's fsync follows its rename
      }
      if (i > 0) {
        EXPECT_GE(save_of[i], save_of[i - 1]) << "rank " << r << " op " << i;
      }
    }
  }
  const Reference ref = ReferenceAt(0);
  for (const std::string& dir : {first, second, third}) LoadAndCheck({.world = 3}, dir, ref, dir);
}

// A failure injected at every file operation of the background part of every rank: SaveAsync
// returns OK everywhere (the failure comes later), WaitForSave returns it on every rank (the
// failing rank its own, the others as peer errors); an outcome nobody collected is returned by
// the next save instead, after which saves work again.
TEST_F(CheckpointTest, BackgroundWriterFailureReachesEveryRank) {
  const RunConfig setup{.world = 3, .host_compute = true};
  std::vector<int64_t> counts(3, 0);
  ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    RecordingFileSystem recorder;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, &recorder));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(Dir("count"), Deadline()));
    SL_RETURN_IF_ERROR(rank->ckpt->WaitForSave(Deadline()));
    counts[r] = recorder.operation_count();
    return absl::OkStatus();
  }));
  struct Case {
    int rank;
    int64_t op;
  };
  std::vector<Case> cases;
  // Rank 0's operation 0 (creating the temporary directory) is SaveAsync's own, not the
  // background writer's.
  for (int r = 0; r < 3; ++r) {
    for (int64_t k = r == 0 ? 1 : 0; k < counts[r]; ++k) cases.push_back({r, k});
  }
  std::vector<std::vector<absl::Status>> outcomes(cases.size(), std::vector<absl::Status>(3));
  std::vector<absl::Status> uncollected(3), after(3);
  ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    RecordingFileSystem recorder;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, &recorder));
    for (size_t c = 0; c < cases.size(); ++c) {
      recorder.Reset();
      if (cases[c].rank == r) recorder.FailFrom(cases[c].op);
      SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(Dir(absl::StrCat("failed", c)), Deadline()));
      outcomes[c][r] = rank->ckpt->WaitForSave(Deadline());
    }
    // Not collected: the next save reports it, does nothing, and the one after that works.
    recorder.Reset();
    if (r == 1) recorder.FailFrom(0);
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(Dir("uncollected"), Deadline()));
    uncollected[r] = rank->ckpt->Save(Dir("next"), Deadline());
    recorder.FailFrom(-1);
    after[r] = rank->ckpt->Save(Dir("next"), Deadline());
    return absl::OkStatus();
  }));
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(absl::StrCat("failure at operation ", cases[c].op, " of rank ", cases[c].rank));
    for (int r = 0; r < 3; ++r) {
      const absl::Status& s = outcomes[c][r];
      ASSERT_FALSE(s.ok()) << "rank " << r;
      EXPECT_TRUE(absl::StrContains(
          s.message(), absl::StrCat("injected failure at file operation ", cases[c].op)))
          << s;
      EXPECT_EQ(IsPeerError(s), r != cases[c].rank) << s;
    }
    EXPECT_FALSE(fs::exists(Dir(absl::StrCat("failed", c))) &&
                 !(cases[c].rank == 0 && cases[c].op == counts[0] - 1))
        << "only a failure of the parent's fsync leaves the target";
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(absl::StrContains(uncollected[r].message(), "the previous background save '" +
                                                                Dir("uncollected") + "' failed"))
        << uncollected[r];
    EXPECT_TRUE(absl::StrContains(uncollected[r].message(), "injected failure")) << uncollected[r];
    EXPECT_OK(after[r]);
  }
  EXPECT_FALSE(fs::exists(Dir("uncollected")));
  EXPECT_TRUE(fs::exists(Dir("next")));
  std::cout << cases.size() << " injected failures in the background writer\n";
}

// The snapshot cap: a SaveAsync whose largest data file exceeds it fails on every rank with
// ResourceExhausted before anything is created; at exactly the largest file it saves.
TEST_F(CheckpointTest, SnapshotCapIsEnforcedOnEveryRank) {
  std::vector<uint64_t> sizes(4, 0);
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 4}, comm, nullptr));
    sizes[r] = DataFileBytes(*rank);
    return absl::OkStatus();
  }));
  const uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  const uint64_t smallest = *std::min_element(sizes.begin(), sizes.end());
  ASSERT_LT(smallest, largest);  // so a cap between them fails on the ranks under it too
  const std::vector<absl::Status> capped =
      RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
        SL_ASSIGN_OR_RETURN(
            auto rank, MakeRank({.world = 4, .max_snapshot_bytes = largest - 1}, comm, nullptr));
        return rank->ckpt->SaveAsync(Dir("capped"), Deadline());
      });
  for (const absl::Status& s : capped) {
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("would take ", largest, " bytes")))
        << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "max_snapshot_bytes")) << s;
  }
  for (const auto& e : fs::directory_iterator(root_)) ADD_FAILURE() << "left behind: " << e.path();
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank,
                        MakeRank({.world = 4, .max_snapshot_bytes = largest}, comm, nullptr));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(Dir("fits"), Deadline()));
    EXPECT_EQ(rank->ckpt->last_save_stats().snapshot_bytes, sizes[r]);
    return rank->ckpt->WaitForSave(Deadline());
  }));
  EXPECT_OK(ReadCheckpointManifest(PosixFileSystem(), Dir("fits")).status());
}

// Under hybrid sharding only the first replica group snapshots and writes; the others copy
// nothing and still return the common outcome.
TEST_F(CheckpointTest, HybridBackgroundSaveSnapshotsOnTheWritersOnly) {
  const std::string dir = Dir("hybrid_background");
  const RunConfig hybrid{.world = 4,
                         .strategy = ShardingStrategy::kHybridShard,
                         .shard_size = 2,
                         .host_compute = true,
                         .replicated = true};
  std::vector<uint64_t> snapshot(4), expected(4);
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(hybrid, comm, nullptr));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(dir, Deadline()));
    snapshot[r] = rank->ckpt->last_save_stats().snapshot_bytes;
    expected[r] = rank->sched->mesh().replicate_rank() == 0 ? DataFileBytes(*rank) : 0;
    SL_RETURN_IF_ERROR(TrainingStep(*rank, 5));
    return rank->ckpt->WaitForSave(Deadline());
  }));
  EXPECT_EQ(snapshot, expected);
  const Reference ref = ReferenceAt(0);
  LoadAndCheck({.world = 3}, dir, ref, "hybrid background save, load at 3");
}

// Destroying a Checkpointer with a save pending finishes the save first.
TEST_F(CheckpointTest, DestructionFinishesAPendingSave) {
  const std::string dir = Dir("destroyed");
  ExpectAllOk(RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 2}, comm, nullptr));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(dir, Deadline()));
    rank->ckpt.reset();
    return absl::OkStatus();
  }));
  const Reference ref = ReferenceAt(0);
  LoadAndCheck({.world = 1}, dir, ref, "saved by a destroyed checkpointer");
}

// SHARDLINE_CHECKPOINT_KILL_AT is declared once (in the knob registry) and a value that does not
// parse makes Create fail naming it. (Its effect, a SIGKILL, is tested across processes by
// tests/scripts/checkpoint_kill_test.py.)
TEST_F(CheckpointTest, InvalidKillVariableIsAnError) {
  const ParamBase* knob = nullptr;
  for (const ParamBase* p : AllParams()) {
    if (p->env_name() == "SHARDLINE_CHECKPOINT_KILL_AT") knob = p;
  }
  ASSERT_NE(knob, nullptr);
  for (const char* bad : {"x", "1:2:3", "-1", "0:-4"}) {
    ASSERT_EQ(setenv("SHARDLINE_CHECKPOINT_KILL_AT", bad, 1), 0);
    knob->ResetCacheForTesting();
    for (const absl::Status& s : RunRanks(1, [&](int, std::shared_ptr<Communicator> comm) {
           return MakeRank({.world = 1}, comm, nullptr).status();
         })) {
      EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad << ": " << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "SHARDLINE_CHECKPOINT_KILL_AT")) << s;
    }
  }
  // A kill point for another rank (and one past the save's operations) changes nothing here.
  ASSERT_EQ(setenv("SHARDLINE_CHECKPOINT_KILL_AT", "5:0", 1), 0);
  knob->ResetCacheForTesting();
  SaveModel({.world = 2}, Dir("other_rank"));
  ASSERT_EQ(setenv("SHARDLINE_CHECKPOINT_KILL_AT", "100000", 1), 0);
  knob->ResetCacheForTesting();
  SaveModel({.world = 2}, Dir("past_the_end"));
  unsetenv("SHARDLINE_CHECKPOINT_KILL_AT");
  knob->ResetCacheForTesting();
  EXPECT_OK(ReadCheckpointManifest(PosixFileSystem(), Dir("other_rank")).status());
  EXPECT_OK(ReadCheckpointManifest(PosixFileSystem(), Dir("past_the_end")).status());
}

// ---- Replicated states ---------------------------------------------------------------------

// Replicated states (a scalar step counter, a vector, odd bytes, an empty one) are written once,
// from rank 0 (the other ranks hold other bytes), into replicated.bin, and every rank of a job of
// another size loads rank 0's bytes; a background save writes the values of its call.
TEST_F(CheckpointTest, ReplicatedStatesAreSavedOnceAndLoadedByEveryRank) {
  const std::string dir = Dir("replicated"), later = Dir("later");
  const RunConfig setup{.world = 4, .replicated = true};
  const Reference ref = SaveModel(setup, dir);
  ExpectAllOk(RunRanks(4, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(setup, comm, nullptr));
    SL_RETURN_IF_ERROR(rank->ckpt->SaveAsync(later, Deadline()));
    // Changed while the background save runs: the checkpoint keeps the values of the call.
    for (std::string& bytes : rank->replicated) std::fill(bytes.begin(), bytes.end(), 'x');
    return rank->ckpt->WaitForSave(Deadline());
  }));
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), dir);
  ASSERT_OK(m.status());
  const std::vector<CheckpointReplicatedState> defs = ReplicatedDefs();
  ASSERT_EQ(m->replicated.size(), defs.size());
  uint64_t total = 0;
  std::string file_bytes;
  for (size_t i = 0; i < defs.size(); ++i) {
    EXPECT_EQ(m->replicated[i].name, defs[i].name);
    EXPECT_EQ(m->replicated[i].shape, defs[i].shape);
    EXPECT_EQ(m->replicated[i].dtype, defs[i].dtype);
    EXPECT_EQ(m->replicated[i].file_offset, total);
    const std::string want = ReplicatedBytes(i, defs[i], 0);
    EXPECT_EQ(m->replicated[i].bytes, want.size());
    EXPECT_EQ(m->replicated[i].crc32c,
              SlowCrc32c(reinterpret_cast<const unsigned char*>(want.data()), want.size()));
    total += want.size();
    file_bytes += want;
  }
  EXPECT_EQ(m->replicated_bytes, total);
  {
    std::ifstream in(fs::path(dir) / "replicated.bin", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_EQ(ss.str(), file_bytes);  // rank 0's bytes, back to back
  }
  // A round trip through the JSON form keeps them.
  absl::StatusOr<CheckpointManifest> again = ParseCheckpointManifest(CheckpointManifestToJson(*m));
  ASSERT_OK(again.status());
  EXPECT_EQ(again->replicated, m->replicated);

  for (const std::string& d : {dir, later}) {
    ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
      SL_ASSIGN_OR_RETURN(auto rank,
                          MakeRank({.world = 3, .fill = false, .replicated = true}, comm, nullptr));
      SL_RETURN_IF_ERROR(rank->ckpt->Load(d, Deadline()));
      ExpectMatches(*rank, ref, absl::StrCat("rank ", r));
      for (size_t i = 0; i < defs.size(); ++i) {
        EXPECT_EQ(rank->replicated[i], ReplicatedBytes(i, defs[i], 0))
            << d << " rank " << r << " state " << defs[i].name;
      }
      return absl::OkStatus();
    }));
  }
  // A job that registers none loads the rest; a checkpoint without them has no replicated.bin.
  LoadAndCheck({.world = 2}, dir, ref, "without replicated states");
  const std::string plain = Dir("plain");
  SaveModel({.world = 2}, plain);
  EXPECT_FALSE(fs::exists(fs::path(plain) / "replicated.bin"));
  std::ifstream in(fs::path(plain) / "manifest.json");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_FALSE(absl::StrContains(text.str(), "replicated")) << text.str();
}

TEST_F(CheckpointTest, ReplicatedStateRegistrationErrors) {
  ExpectAllOk(RunRanks(1, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 1, .replicated = true}, comm, nullptr));
    int64_t x = 0;
    const auto expect_invalid = [&](CheckpointReplicatedState s, absl::string_view fragment) {
      const absl::Status st = rank->ckpt->AddReplicatedState(std::move(s));
      EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
      EXPECT_TRUE(absl::StrContains(st.message(), fragment)) << st;
    };
    expect_invalid({.name = "step", .dtype = DType::kI64, .data = &x}, "exists");
    expect_invalid({.name = "bad name", .dtype = DType::kI64, .data = &x}, "[A-Za-z0-9._-]");
    expect_invalid({.name = "neg", .shape = {2, -1}, .dtype = DType::kI64, .data = &x},
                   "dimension -1");
    expect_invalid({.name = "null", .shape = {2}, .dtype = DType::kI64}, "data is null");
    EXPECT_OK(rank->ckpt->AddReplicatedState({.name = "empty", .shape = {0}}));
    return absl::OkStatus();
  }));
  // Ranks that register other replicated states fail together.
  for (const absl::Status& s : RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) {
         RunConfig config{.world = 2, .replicated = true};
         if (r == 1) config.edit_replicated = [](auto& defs) { defs[1].shape = {4}; };
         SL_ASSIGN_OR_RETURN(auto rank, MakeRank(config, comm, nullptr));
         return rank->ckpt->Save(Dir("mixed"), Deadline());
       })) {
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 has other units or checkpoint states")) << s;
  }
}

// The replicated states' errors name the state: a missing one, another shape or dtype, a flipped
// byte, a truncated or deleted replicated.bin, edited sizes in the manifest.
TEST_F(CheckpointTest, ReplicatedStateErrorsAreNamed) {
  const std::string good = Dir("good");
  SaveModel({.world = 2, .replicated = true}, good);
  const auto try_load = [&](const std::string& dir, RunConfig config) {
    config.fill = false;
    config.replicated = true;
    return RunRanks(config.world, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank(config, comm, nullptr));
      absl::Status s = rank->ckpt->Load(dir, Deadline());
      // Errors found before any byte is copied leave the replicated states untouched.
      for (const std::string& bytes : rank->replicated) {
        EXPECT_EQ(bytes, std::string(bytes.size(), static_cast<char>(0xAB)));
      }
      return s;
    });
  };
  const auto expect_named = [](const std::vector<absl::Status>& statuses, absl::StatusCode code,
                               const std::vector<std::string>& fragments) {
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), code) << s;
      for (const std::string& f : fragments) EXPECT_TRUE(absl::StrContains(s.message(), f)) << s;
    }
  };
  RunConfig extra{.world = 2};
  extra.edit_replicated = [](auto& defs) {
    defs.push_back({.name = "epoch", .shape = {}, .dtype = DType::kI32});
  };
  expect_named(try_load(good, extra), absl::StatusCode::kNotFound,
               {"no replicated state 'epoch'", "step, lr.schedule, rng, none"});
  RunConfig shape{.world = 2};
  shape.edit_replicated = [](auto& defs) { defs[1].shape = {4}; };
  expect_named(try_load(good, shape), absl::StatusCode::kInvalidArgument,
               {"replicated state 'lr.schedule'", "[3] f64", "[4] f64"});

  const auto copy = [&](absl::string_view name) {
    const std::string dir = Dir(name);
    fs::copy(good, dir, fs::copy_options::recursive);
    return dir;
  };
  const std::string flipped = copy("flipped");
  {
    std::fstream f(fs::path(flipped) / "replicated.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8 + 24 + 2);  // in "rng", after step (8 bytes) and lr.schedule (24)
    f.put('!');
  }
  expect_named(try_load(flipped, {.world = 3}), absl::StatusCode::kDataLoss,
               {"replicated.bin", "bytes [32, 37)", "replicated state 'rng' is corrupt"});
  const std::string truncated = copy("truncated");
  fs::resize_file(fs::path(truncated) / "replicated.bin", 30);
  expect_named(try_load(truncated, {.world = 1}), absl::StatusCode::kDataLoss,
               {"replicated.bin", "truncated"});
  const std::string deleted = copy("deleted");
  fs::remove(fs::path(deleted) / "replicated.bin");
  expect_named(try_load(deleted, {.world = 2}), absl::StatusCode::kNotFound,
               {"data file 'replicated.bin' is missing", "replicated state 'step'"});
  const std::string edited = copy("edited");
  {
    const fs::path path = fs::path(edited) / "manifest.json";
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    const std::string from = "\"shape\": [3], \"dtype\": \"f64\"";
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, from.size(), "\"shape\": [4], \"dtype\": \"f64\"");
    in.close();
    std::ofstream(path, std::ios::trunc) << text;
  }
  absl::Status alone = ReadCheckpointManifest(PosixFileSystem(), edited).status();
  EXPECT_TRUE(absl::IsInvalidArgument(alone)) << alone;
  EXPECT_TRUE(absl::StrContains(alone.message(), "replicated state 'lr.schedule'")) << alone;
}

// ---- Corruption and mismatches --------------------------------------------------------------

class CorruptionTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    good_ = Dir("good");
    ref_ = SaveModel({.world = 4}, good_);
    absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), good_);
    SL_CHECK(m.ok());
    manifest_ = *std::move(m);
  }

  // A copy of the good checkpoint to damage.
  std::string Copy(absl::string_view name) {
    const std::string dir = Dir(name);
    fs::copy(good_, dir, fs::copy_options::recursive);
    return dir;
  }

  // Every rank failed; at least one with `code` and every fragment in its message; the others
  // as peers, carrying the same message.
  static void ExpectNamedError(const std::vector<absl::Status>& statuses, absl::StatusCode code,
                               const std::vector<std::string>& fragments) {
    int named = 0;
    for (const absl::Status& s : statuses) {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), code) << s;
      bool all = true;
      for (const std::string& f : fragments) all = all && absl::StrContains(s.message(), f);
      EXPECT_TRUE(all) << s;
      if (!IsPeerError(s)) ++named;
    }
    EXPECT_GE(named, 1);
  }

  std::string good_;
  Reference ref_;
  CheckpointManifest manifest_;
};

TEST_F(CorruptionTest, FlippedByteIsAChecksumErrorNamingFileAndTensor) {
  const std::string dir = Copy("flipped");
  // Flip one byte in the middle of unit 'block' state 'adam.v' tensor 'w' on shard 1.
  const CheckpointUnitRecord& unit = manifest_.units[1];
  const CheckpointStateRecord& state = unit.states[2];
  ASSERT_EQ(state.name, "adam.v");
  const CheckpointPiece* piece = nullptr;
  for (const CheckpointPiece& p : state.pieces) {
    if (p.shard == 1 && unit.tensors[p.tensor].name == "w") piece = &p;
  }
  ASSERT_NE(piece, nullptr);
  const fs::path file = fs::path(dir) / "shard-00001-of-00004.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const std::streamoff at = static_cast<std::streamoff>(piece->file_offset + piece->bytes / 2);
    f.seekg(at);
    char c;
    f.get(c);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(at);
    f.put(c);
  }
  ExpectNamedError(
      TryLoad({.world = 2}, dir), absl::StatusCode::kDataLoss,
      {"shard-00001-of-00004.bin", "CRC-32C", "unit 'block'", "state 'adam.v'", "tensor 'w'"});
  // The good copy still loads.
  LoadAndCheck({.world = 2}, good_, ref_, "good after flip");
}

TEST_F(CorruptionTest, TruncatedFileIsNamed) {
  const std::string dir = Copy("truncated");
  const fs::path file = fs::path(dir) / "shard-00002-of-00004.bin";
  fs::resize_file(file, fs::file_size(file) - 10);
  // The last piece of shard 2 is tail's "step" over tensor "big".
  ExpectNamedError(
      TryLoad({.world = 3}, dir), absl::StatusCode::kDataLoss,
      {"shard-00002-of-00004.bin", "truncated", "unit 'tail'", "state 'step'", "tensor 'big'"});
}

TEST_F(CorruptionTest, DeletedFileIsNamed) {
  const std::string dir = Copy("deleted");
  fs::remove(fs::path(dir) / "shard-00003-of-00004.bin");
  ExpectNamedError(TryLoad({.world = 1}, dir), absl::StatusCode::kNotFound,
                   {"data file 'shard-00003-of-00004.bin' is missing", "tensor '"});
}

TEST_F(CorruptionTest, EditedShapeInTheManifestIsNamed) {
  const std::string dir = Copy("edited");
  const fs::path path = fs::path(dir) / "manifest.json";
  std::string text;
  {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  const std::string from = "\"name\": \"b\", \"shape\": [11]";
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, from.size(), "\"name\": \"b\", \"shape\": [12]");
  std::ofstream(path, std::ios::trunc) << text;
  ExpectNamedError(TryLoad({.world = 2}, dir), absl::StatusCode::kInvalidArgument,
                   {"unit 'block' tensor 'b'", "shape [12]", "[11]"});
  // Without the current units to compare with, the manifest is inconsistent in itself.
  absl::Status alone = ReadCheckpointManifest(PosixFileSystem(), dir).status();
  EXPECT_TRUE(absl::IsInvalidArgument(alone)) << alone;
  EXPECT_TRUE(absl::StrContains(alone.message(), "manifest.json")) << alone;
}

TEST_F(CorruptionTest, GarbledManifestIsNamed) {
  const std::string dir = Copy("garbled");
  std::ofstream(fs::path(dir) / "manifest.json", std::ios::trunc) << "{\"format\": 1.5";
  ExpectNamedError(TryLoad({.world = 1}, dir), absl::StatusCode::kInvalidArgument,
                   {"manifest.json", "line 1"});
}

TEST_F(CorruptionTest, UnitOfAnotherShapeIsNamed) {
  RunConfig other{.world = 2};
  other.edit = [](Model& m) { m.units[1].tensors[0].shape = {3, 5, 8}; };
  ExpectNamedError(TryLoad(other, good_), absl::StatusCode::kInvalidArgument,
                   {"unit 'block' tensor 'w'", "the checkpoint has shape [3, 5, 7]",
                    "the current unit [3, 5, 8]"});
  RunConfig renamed{.world = 2};
  renamed.edit = [](Model& m) { m.units[2].name = "tail2"; };
  ExpectNamedError(TryLoad(renamed, good_), absl::StatusCode::kInvalidArgument,
                   {"the checkpoint has no unit 'tail2'"});
}

TEST_F(CorruptionTest, MissingStateAndOtherDTypesAreNamed) {
  RunConfig extra{.world = 2};
  extra.edit = [](Model& m) { m.states[0].push_back({"adam.z", DType::kF32}); };
  ExpectNamedError(TryLoad(extra, good_), absl::StatusCode::kNotFound,
                   {"unit 'embed' has no state 'adam.z'"});
  RunConfig dtype{.world = 2};
  dtype.edit = [](Model& m) { m.states[1][1].dtype = DType::kF32; };
  ExpectNamedError(TryLoad(dtype, good_), absl::StatusCode::kInvalidArgument,
                   {"unit 'block' state 'adam.v'", "f64", "f32"});
  RunConfig master{.world = 2};
  master.edit = [](Model& m) { m.units[2].policy.precision.master_dtype = DType::kF32; };
  ExpectNamedError(TryLoad(master, good_), absl::StatusCode::kInvalidArgument,
                   {"unit 'tail'", "master dtype is f64"});
  // A state saved but not registered now is skipped: the rest loads.
  RunConfig fewer{.world = 3};
  fewer.edit = [](Model& m) { m.states[0].pop_back(); };
  ExpectAllOk(RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) {
    RunConfig s = fewer;
    s.fill = false;
    SL_ASSIGN_OR_RETURN(auto rank, MakeRank(s, comm, nullptr));
    SL_RETURN_IF_ERROR(rank->ckpt->Load(good_, Deadline()));
    ExpectMatches(*rank, ref_, "fewer states");
    return absl::OkStatus();
  }));
}

TEST_F(CorruptionTest, RanksWithOtherStatesFailTogether) {
  auto run = [&](bool save) {
    return RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) {
      RunConfig config{.world = 2, .fill = save};
      // Rank 1 does not register unit tail's "step" (which the checkpoint has).
      if (r == 1) config.edit = [](Model& m) { m.states[2].pop_back(); };
      SL_ASSIGN_OR_RETURN(auto rank, MakeRank(config, comm, nullptr));
      return save ? rank->ckpt->Save(Dir("mixed"), Deadline())
                  : rank->ckpt->Load(good_, Deadline());
    });
  };
  for (bool save : {true, false}) {
    for (const absl::Status& s : run(save)) {
      EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 has other units or checkpoint states"))
          << s;
    }
  }
  EXPECT_FALSE(fs::exists(Dir("mixed")));
}

TEST_F(CorruptionTest, ExistingTargetAndMissingDirectory) {
  ExpectNamedError(RunRanks(2,
                            [&](int r, std::shared_ptr<Communicator> comm) {
                              SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 2}, comm, nullptr));
                              return rank->ckpt->Save(good_, Deadline());
                            }),
                   absl::StatusCode::kAlreadyExists, {"exists"});
  ExpectNamedError(TryLoad({.world = 2}, Dir("nowhere")), absl::StatusCode::kNotFound,
                   {"does not exist"});
}

TEST_F(CorruptionTest, PathThatIsAFileIsNamed) {
  const std::string file = Dir("plain");
  std::ofstream(file) << "not a checkpoint";
  ExpectNamedError(TryLoad({.world = 2}, file), absl::StatusCode::kFailedPrecondition,
                   {file, "is a file, not a checkpoint directory"});
  const absl::Status alone = ReadCheckpointManifest(PosixFileSystem(), file).status();
  EXPECT_TRUE(absl::StrContains(alone.message(), "is a file, not a checkpoint directory")) << alone;
  EXPECT_FALSE(absl::StrContains(alone.message(), "did not finish")) << alone;
}

TEST_F(CorruptionTest, RanksPassingDifferentPathsAreNamed) {
  // Every rank fails with the same error, naming both paths, whatever the paths hold.
  auto expect_named = [&](const std::vector<absl::Status>& statuses, const std::string& a,
                          const std::string& b) {
    for (size_t r = 0; r < statuses.size(); ++r) {
      const absl::Status& s = statuses[r];
      EXPECT_TRUE(absl::IsFailedPrecondition(s)) << "rank " << r << ": " << s;
      for (const std::string& want :
           {std::string("the ranks passed different directories"), absl::StrCat("rank 0 '", a, "'"),
            absl::StrCat("rank 1 '", b, "'")}) {
        EXPECT_TRUE(absl::StrContains(s.message(), want)) << "rank " << r << ": " << s;
      }
    }
  };
  const std::string a = Dir("a");
  const std::string b = Dir("b");
  expect_named(RunRanks(2,
                        [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
                          SL_ASSIGN_OR_RETURN(auto rank, MakeRank({.world = 2}, comm, nullptr));
                          return rank->ckpt->Save(r == 0 ? a : b, Deadline());
                        }),
               a, b);
  // Nothing was created: the paths are compared before rank 0 makes its temporary directory.
  for (const auto& entry : fs::directory_iterator(root_)) {
    EXPECT_FALSE(absl::StartsWith(entry.path().filename().string(), "a")) << entry.path();
  }
  // Two good checkpoints, and a good one and a missing one: the paths are the problem.
  const std::string other = Copy("other");
  for (const std::string& second : {other, Dir("nowhere")}) {
    expect_named(RunRanks(2,
                          [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
                            SL_ASSIGN_OR_RETURN(
                                auto rank, MakeRank({.world = 2, .fill = false}, comm, nullptr));
                            return rank->ckpt->Load(r == 0 ? good_ : second, Deadline());
                          }),
                 good_, second);
  }
}

// A FIFO where a file should be: a load fails at once, naming it. Bounded: if the load does not
// return within 20 s (it blocks in open(2), which no deadline reaches), the test fails and
// opens the FIFOs for writing, which lets a blocked open return.
TEST_F(CorruptionTest, FifoInPlaceOfAFileFailsAtOnce) {
  for (const std::string name : {"manifest.json", "shard-00001-of-00004.bin"}) {
    const std::string dir = Copy(absl::StrCat("fifo-", name));
    const std::string fifo = absl::StrCat(dir, "/", name);
    ASSERT_TRUE(fs::remove(fifo));
    ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0) << std::strerror(errno);
    std::future<std::vector<absl::Status>> load =
        std::async(std::launch::async, [&] { return TryLoad({.world = 2}, dir); });
    const absl::Time start = absl::Now();
    bool returned = false;
    while (!returned) {
      returned = load.wait_for(std::chrono::milliseconds(100)) == std::future_status::ready;
      if (!returned && absl::Now() - start > absl::Seconds(20)) {
        ADD_FAILURE() << name << ": the load still blocks after 20 s";
        // A writer's open completes a blocked reader's (non-blocking: fails if none waits).
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
        if (fd >= 0) ::close(fd);
      }
    }
    ExpectNamedError(load.get(), absl::StatusCode::kFailedPrecondition,
                     {name, "not a regular file (it is a FIFO)"});
  }
}

}  // namespace
}  // namespace shardline
