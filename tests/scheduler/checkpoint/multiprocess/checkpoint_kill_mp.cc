// Multi-process test program of checkpoints killed mid-save, started by shardline-launch (the
// world from InitProcessGroup, ucx) and driven by tests/scripts/checkpoint_kill_test.py, which
// sets SHARDLINE_CHECKPOINT_KILL_AT=<rank>:<k> to kill one rank (SIGKILL) right before its k-th
// file operation of a save:
//
//   checkpoint_kill_mp save <dir> <version> sync|async [count]
//       fills every unit's master shard and states with the values of <version> and saves them
//       into <dir>: Save (sync), or SaveAsync, then a training step that overwrites every shard
//       (on an asynchronous compute stream) while the background writer runs, then WaitForSave.
//       Prints "SAVED rank <r> operations <n>" (n: the file operations this rank performed,
//       counted with a RecordingFileSystem when "count" is given, else -1).
//   checkpoint_kill_mp check <previous> <version> <partial version> [<dir>...]
//       loads <previous> and checks every element of every state against <version>; then for
//       each <dir>: an incomplete checkpoint (FailedPrecondition) prints "INCOMPLETE <dir>", a
//       complete one is loaded and checked against <partial version> and prints "COMPLETE
//       <dir>"; rank 0 prints, and "CHECKED <n>" at the end.
//
// Exits 0 when all of that holds, 1 otherwise (with "FAIL rank <r>: ..." on stderr).

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/bootstrap.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/manifest.h"
#include "scheduler/scheduler.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

int g_rank = 0;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void Check(const absl::Status& s, absl::string_view what) {
  if (!s.ok()) Fail(absl::StrCat(what, ": ", s.ToString()));
}

absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

using ::shardline::testing::HashMix;

// The bits of element i of tensor t of state k (0: master) of unit u at `version`: a float in
// [-1, 1) for the master shards, hashed bits for the other states.
void ElementBits(int version, int u, int k, int t, size_t i, DType dtype, char* out) {
  const uint64_t h = HashMix(HashMix(HashMix(HashMix(version) ^ u) ^ k) ^ t) ^ i;
  const uint64_t bits = HashMix(h);
  if (k == 0) {
    const double d = static_cast<double>(bits >> 11) / 4503599627370496.0 - 1.0;
    if (dtype == DType::kF64) {
      std::memcpy(out, &d, 8);
    } else {
      const float f = static_cast<float>(d);
      std::memcpy(out, &f, 4);
    }
    return;
  }
  std::memcpy(out, &bits, DTypeSize(dtype));
}

struct StateDef {
  int unit;
  std::string name;
  DType dtype;
};

// Two units of odd sizes (a tie, a scalar, an f64 master), two registered states and two
// replicated states.
struct Job {
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> sched;
  std::vector<StateDef> defs;
  std::vector<std::vector<char>> states;
  int64_t step = 0;  // a replicated state: the version
  char rng[7] = {};  // another: 7 hashed bytes of the version
  std::unique_ptr<Checkpointer> ckpt;

  DType StateDType(int u, int k) const {
    if (k == 0) return sched->unit(u).policy().master_dtype;
    int seen = 0;
    for (const StateDef& d : defs) {
      if (d.unit == u && ++seen == k) return d.dtype;
    }
    return DType::kF32;
  }
  char* StateData(int u, int k) {
    if (k == 0) return static_cast<char*>(sched->unit(u).master_shard().data);
    int seen = 0;
    for (size_t s = 0; s < defs.size(); ++s) {
      if (defs[s].unit == u && ++seen == k) return states[s].data();
    }
    return nullptr;
  }
  int NumStates(int u) const {
    int n = 1;
    for (const StateDef& d : defs) n += d.unit == u;
    return n;
  }

  // Writes `version` into every element of this rank's shards (padding: zeros) and into the
  // replicated states.
  void Fill(int version) {
    step = version;
    for (int i = 0; i < 7; ++i) rng[i] = static_cast<char>(HashMix(version * 7 + i));
    const int shard = sched->mesh().shard_rank();
    for (int u = 0; u < sched->num_units(); ++u) {
      const FlatLayout& layout = sched->unit(u).layout();
      for (int k = 0; k < NumStates(u); ++k) {
        const DType dtype = StateDType(u, k);
        const size_t size = DTypeSize(dtype);
        char* data = StateData(u, k);
        std::memset(data, 0, layout.shard_elements() * size);
        for (const ShardSlice& s : layout.ShardSlices(shard)) {
          for (size_t j = 0; j < s.length; ++j) {
            ElementBits(version, u, k, s.tensor, s.tensor_offset + j, dtype,
                        data + (s.shard_offset + j) * size);
          }
        }
      }
    }
  }

  // Every element of this rank's shards and the replicated states hold `version`; every padding
  // byte is 0.
  void Expect(int version, absl::string_view what) {
    if (step != version) Fail(absl::StrCat(what, ": replicated state 'step' is ", step));
    for (int i = 0; i < 7; ++i) {
      if (rng[i] != static_cast<char>(HashMix(version * 7 + i))) {
        Fail(absl::StrCat(what, ": replicated state 'rng' byte ", i, " differs"));
      }
    }
    const int shard = sched->mesh().shard_rank();
    char want[8];
    for (int u = 0; u < sched->num_units(); ++u) {
      const FlatLayout& layout = sched->unit(u).layout();
      for (int k = 0; k < NumStates(u); ++k) {
        const DType dtype = StateDType(u, k);
        const size_t size = DTypeSize(dtype);
        const char* data = StateData(u, k);
        for (const ShardSlice& s : layout.ShardSlices(shard)) {
          for (size_t j = 0; j < s.length; ++j) {
            ElementBits(version, u, k, s.tensor, s.tensor_offset + j, dtype, want);
            if (std::memcmp(want, data + (s.shard_offset + j) * size, size) != 0) {
              Fail(absl::StrCat(what, ": unit ", u, " state ", k, " tensor ", s.tensor, " element ",
                                s.tensor_offset + j, " differs from version ", version));
            }
          }
        }
        const size_t begin = layout.ShardBegin(shard);
        for (const PaddingRange& p : layout.ShardPadding(shard)) {
          for (size_t b = (p.begin - begin) * size; b < (p.end - begin) * size; ++b) {
            if (data[b] != 0) Fail(absl::StrCat(what, ": padding not zero, unit ", u));
          }
        }
      }
    }
  }
};

std::unique_ptr<Job> MakeJob(std::shared_ptr<Communicator> world, FileSystem* fs) {
  auto job = std::make_unique<Job>();
  absl::StatusOr<std::unique_ptr<Stream>> compute = CreateHostStream({.name = "compute"});
  Check(compute.status(), "compute stream");
  job->compute = *std::move(compute);
  absl::StatusOr<std::unique_ptr<Scheduler>> sched =
      Scheduler::Create(world, *job->compute, {}, Deadline());
  Check(sched.status(), "Scheduler::Create");
  job->sched = *std::move(sched);
  UnitPolicy f64;
  f64.precision.master_dtype = DType::kF64;
  Check(job->sched
            ->RegisterUnit({.name = "embed",
                            .tensors = {{.name = "emb", .shape = {37, 3}},
                                        {.name = "bias", .shape = {5}},
                                        {.name = "head", .shape = {37, 3}, .tied_to = "emb"}}})
            .status(),
        "RegisterUnit");
  Check(job->sched
            ->RegisterUnit(
                {.name = "tail",
                 .tensors = {{.name = "big", .shape = {1031}}, {.name = "scale", .shape = {}}},
                 .policy = f64})
            .status(),
        "RegisterUnit");
  absl::StatusOr<std::unique_ptr<Checkpointer>> ckpt = Checkpointer::Create(
      *job->sched, {.file_system = fs, .checksum_block_bytes = 256}, Deadline());
  Check(ckpt.status(), "Checkpointer::Create");
  job->ckpt = *std::move(ckpt);
  job->defs = {{0, "adam.m", DType::kF32}, {1, "step", DType::kI64}};
  job->states.resize(job->defs.size());
  for (size_t s = 0; s < job->defs.size(); ++s) {
    const StateDef& d = job->defs[s];
    job->states[s].assign(job->sched->unit(d.unit).layout().shard_elements() * DTypeSize(d.dtype),
                          0);
    Check(job->ckpt->AddState(
              {.unit = d.unit, .name = d.name, .data = job->states[s].data(), .dtype = d.dtype}),
          "AddState");
  }
  Check(job->ckpt->AddReplicatedState(
            {.name = "step", .shape = {}, .dtype = DType::kI64, .data = &job->step}),
        "AddReplicatedState");
  Check(job->ckpt->AddReplicatedState(
            {.name = "rng", .shape = {7}, .dtype = DType::kU8, .data = job->rng}),
        "AddReplicatedState");
  return job;
}

int Save(std::shared_ptr<Communicator> world, const std::string& dir, int version, bool async,
         bool count) {
  RecordingFileSystem recorder;
  std::unique_ptr<Job> job = MakeJob(world, count ? &recorder : nullptr);
  job->Fill(version);
  if (async) {
    Check(job->ckpt->SaveAsync(dir, Deadline()), "SaveAsync");
    // A training step overwrites every shard while the background writer runs.
    Check(job->compute->Enqueue([&job, version]() -> absl::Status {
      job->Fill(version + 1000);
      return absl::OkStatus();
    }),
          "enqueue");
    Check(job->compute->Synchronize(Deadline()), "compute");
    Check(job->ckpt->WaitForSave(Deadline()), "WaitForSave");
  } else {
    Check(job->ckpt->Save(dir, Deadline()), "Save");
  }
  std::printf("SAVED rank %d operations %lld\n", world->rank(),
              count ? static_cast<long long>(recorder.operation_count()) : -1LL);
  std::fflush(stdout);
  return 0;
}

int CheckDirs(std::shared_ptr<Communicator> world, const std::string& previous, int version,
              int partial_version, const std::vector<std::string>& dirs) {
  std::unique_ptr<Job> job = MakeJob(world, nullptr);
  job->Fill(-1);  // neither version: a load must overwrite everything
  Check(job->ckpt->Load(previous, Deadline()), absl::StrCat("load '", previous, "'"));
  job->Expect(version, absl::StrCat("previous '", previous, "'"));
  for (const std::string& dir : dirs) {
    absl::Status read = ReadCheckpointManifest(PosixFileSystem(), dir).status();
    if (absl::IsFailedPrecondition(read) &&
        read.message().find("incomplete checkpoint") != absl::string_view::npos) {
      // A load says so too, on every rank.
      job->Fill(-1);
      absl::Status load = job->ckpt->Load(dir, Deadline());
      if (!absl::IsFailedPrecondition(load)) {
        Fail(absl::StrCat("load of incomplete '", dir, "': ", load.ToString()));
      }
      if (world->rank() == 0) std::printf("INCOMPLETE %s\n", dir.c_str());
      continue;
    }
    Check(read, absl::StrCat("manifest of '", dir, "'"));
    job->Fill(-1);
    Check(job->ckpt->Load(dir, Deadline()), absl::StrCat("load '", dir, "'"));
    job->Expect(partial_version, absl::StrCat("complete '", dir, "'"));
    if (world->rank() == 0) std::printf("COMPLETE %s\n", dir.c_str());
  }
  if (world->rank() == 0) std::printf("CHECKED %zu\n", dirs.size());
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  const auto usage = [] {
    std::fprintf(stderr,
                 "usage: checkpoint_kill_mp save <dir> <version> sync|async [count]\n"
                 "       checkpoint_kill_mp check <previous> <version> <partial version> "
                 "[<dir>...]\n");
    return 2;
  };
  if (argc < 5) return usage();
  const std::string mode = argv[1];
  int version = 0;
  if (!absl::SimpleAtoi(argv[3], &version)) return usage();
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) Fail(absl::StrCat("InitProcessGroup: ", group.status().ToString()));
  g_rank = group->launch.rank;
  if (mode == "save") {
    const std::string how = argv[4];
    if (how != "sync" && how != "async") return usage();
    const bool count = argc > 5 && std::string(argv[5]) == "count";
    return Save(group->world, argv[2], version, how == "async", count);
  }
  if (mode == "check") {
    int partial = 0;
    if (!absl::SimpleAtoi(argv[4], &partial)) return usage();
    return CheckDirs(group->world, argv[2], version, partial,
                     std::vector<std::string>(argv + 5, argv + argc));
  }
  return usage();
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) { return shardline::Main(argc, argv); }
