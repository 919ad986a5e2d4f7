// checkpoint_bench: how fast a sharded checkpoint is saved and loaded, against the disk.
//
//   build/bench/checkpoint_bench --dir /var/tmp/shardline-ckpt --world 2 --param-bytes 1G
//
// `--world` ranks run as threads of this process over local communicators (the disk, not the
// interconnect, is what this measures), each with a Scheduler of `--units` equal units of f32
// parameters (`--param-bytes` in all) and `--states` shard-shaped f32 states per unit (an
// optimizer's moments), every element a hashed float. Per round:
//   save   Checkpointer::Save into a new directory: every rank writes and fsyncs its shard file,
//          rank 0 the manifest, the directory is renamed into place (docs/checkpoints.md);
//   drop   every file of the checkpoint is dropped from the page cache (posix_fadvise DONTNEED,
//          after the save's fsync the pages are clean), so the load reads the disk;
//   load   Checkpointer::Load into shards that were overwritten with garbage; then every element
//          is compared with the saved values (outside the timing);
//   memcpy one host memcpy of each rank's shards and states into pre-faulted memory, all ranks at
//          once (the floor for the snapshot of a background save), and one into fresh memory
//          (page faults included: what a first snapshot pays);
//   async  two background saves in a row (SaveAsync, then WaitForSave): the time each blocked the
//          caller (CheckpointSaveStats::blocked, the maximum over ranks) — the first allocates
//          the snapshot buffer, the second reuses it — the copy's part of the second, and the
//          background write of the second;
//   export ExportSafetensors of the full weights (rank 0 writes; each unit gathered while the
//          one before is written; fsynced, renamed into place), into a new file.
// Prints one JSON object per round on stdout (bytes, seconds); bench/checkpoint/run.py runs it
// interleaved with dd and reports ratios. Exit status 1 on any error or mismatch.
//
// Flags: --dir D (required; created; each round's checkpoint is removed after it)
//        --world N (2)  --units U (8)  --param-bytes B (1G; K/M/G suffixes)  --states S (0)
//        --rounds R (1)  --timeout S (600)

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/local/local_communicator.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/scheduler.h"

namespace shardline {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::string dir;
  int world = 2;
  int units = 8;
  uint64_t param_bytes = uint64_t{1} << 30;
  int states = 0;
  int rounds = 1;
  int timeout_s = 600;
};

absl::StatusOr<uint64_t> ParseBytes(const std::string& flag, std::string text) {
  uint64_t scale = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
        scale = uint64_t{1} << 10;
        break;
      case 'M':
        scale = uint64_t{1} << 20;
        break;
      case 'G':
        scale = uint64_t{1} << 30;
        break;
      default:
        break;
    }
    if (scale != 1) text.pop_back();
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value == 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", text, "' is not a size > 0"));
  }
  return value * scale;
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat(arg, ": missing value"));
    }
    auto int_flag = [&](int lo, int* out) -> absl::Status {
      if (!absl::SimpleAtoi(value, out) || *out < lo) {
        return absl::InvalidArgumentError(
            absl::StrCat(arg, ": '", value, "' is not an integer >= ", lo));
      }
      return absl::OkStatus();
    };
    if (arg == "--dir") {
      f.dir = value;
    } else if (arg == "--world") {
      SL_RETURN_IF_ERROR(int_flag(1, &f.world));
    } else if (arg == "--units") {
      SL_RETURN_IF_ERROR(int_flag(1, &f.units));
    } else if (arg == "--param-bytes") {
      SL_ASSIGN_OR_RETURN(f.param_bytes, ParseBytes(arg, value));
    } else if (arg == "--states") {
      SL_RETURN_IF_ERROR(int_flag(0, &f.states));
    } else if (arg == "--rounds") {
      SL_RETURN_IF_ERROR(int_flag(1, &f.rounds));
    } else if (arg == "--timeout") {
      SL_RETURN_IF_ERROR(int_flag(1, &f.timeout_s));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", arg, "'"));
    }
  }
  if (f.dir.empty()) return absl::InvalidArgumentError("--dir is required");
  return f;
}

// A hashed float of (unit, state, shard element): every bit pattern differs, no exact sums.
float Value(uint64_t unit, uint64_t state, uint64_t shard, uint64_t i) {
  uint64_t h = (unit * 0x9E3779B97F4A7C15ull) ^ (state << 48) ^ (shard << 40) ^ i;
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) / 65536.0f;
}

// One rank's scheduler, states and checkpointer.
struct Rank {
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> sched;
  std::vector<std::vector<std::vector<float>>> states;  // [unit][state]
  std::unique_ptr<Checkpointer> ckpt;

  // The data of state k of unit u (k = 0: the master shard).
  float* Data(int u, int k) {
    return k == 0 ? static_cast<float*>(sched->unit(u).master_shard().data)
                  : states[u][k - 1].data();
  }
  size_t Elements(int u) const { return sched->unit(u).layout().shard_elements(); }
  uint64_t Bytes(int num_states) const {
    uint64_t bytes = 0;
    for (int u = 0; u < sched->num_units(); ++u) bytes += Elements(u) * 4 * (1 + num_states);
    return bytes;
  }
};

absl::StatusOr<std::unique_ptr<Rank>> MakeRank(const Flags& f, std::shared_ptr<Communicator> comm,
                                               absl::Time deadline) {
  auto rank = std::make_unique<Rank>();
  SL_ASSIGN_OR_RETURN(rank->compute,
                      CreateCallerStream({.name = absl::StrCat("rank", comm->rank(), ".compute")}));
  SL_ASSIGN_OR_RETURN(rank->sched, Scheduler::Create(comm, *rank->compute, {}, deadline));
  // Unit u: one odd-shaped matrix holding its part of the parameters and a small bias.
  const int64_t unit_elements = static_cast<int64_t>(f.param_bytes / 4 / f.units);
  const int64_t cols = 1021;
  for (int u = 0; u < f.units; ++u) {
    const int64_t rows = std::max<int64_t>(1, (unit_elements - 17) / cols);
    // Tensor names unique across units, as a full-weight file (the export) needs them.
    SL_RETURN_IF_ERROR(
        rank->sched
            ->RegisterUnit(
                {.name = absl::StrCat("block", u),
                 .tensors = {{.name = absl::StrCat("block", u, ".weight"), .shape = {rows, cols}},
                             {.name = absl::StrCat("block", u, ".bias"), .shape = {17}}}})
            .status());
  }
  SL_ASSIGN_OR_RETURN(rank->ckpt, Checkpointer::Create(*rank->sched, {}, deadline));
  rank->states.resize(f.units);
  for (int u = 0; u < f.units; ++u) {
    for (int s = 0; s < f.states; ++s) {
      rank->states[u].emplace_back(rank->Elements(u));
      SL_RETURN_IF_ERROR(rank->ckpt->AddState({.unit = u,
                                               .name = absl::StrCat("state", s),
                                               .data = rank->states[u].back().data(),
                                               .dtype = DType::kF32}));
    }
  }
  return rank;
}

// Writes the values (or garbage) into every shard and state.
void Fill(Rank& rank, int num_states, bool garbage) {
  const int shard = rank.sched->mesh().shard_rank();
  for (int u = 0; u < rank.sched->num_units(); ++u) {
    for (int k = 0; k <= num_states; ++k) {
      float* data = rank.Data(u, k);
      for (size_t i = 0; i < rank.Elements(u); ++i) {
        data[i] = garbage ? -1.5f : Value(u, k, shard, i);
      }
    }
  }
}

// Counts the elements that differ from the values; padding (zeroed by a load) is skipped.
uint64_t Mismatches(Rank& rank, int num_states) {
  const int shard = rank.sched->mesh().shard_rank();
  uint64_t wrong = 0;
  for (int u = 0; u < rank.sched->num_units(); ++u) {
    const FlatLayout& layout = rank.sched->unit(u).layout();
    for (int k = 0; k <= num_states; ++k) {
      const float* data = rank.Data(u, k);
      for (const ShardSlice& s : layout.ShardSlices(shard)) {
        for (size_t j = 0; j < s.length; ++j) {
          const float want = Value(u, k, shard, s.shard_offset + j);
          if (std::memcmp(&data[s.shard_offset + j], &want, 4) != 0) ++wrong;
        }
      }
    }
  }
  return wrong;
}

// Drops every file under `dir` from the page cache (the save fsynced them: the pages are clean).
absl::Status DropCache(const fs::path& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("open ", entry.path().string()));
    ::fdatasync(fd);
    const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (rc != 0) {
      return absl::InternalError(
          absl::StrCat("posix_fadvise ", entry.path().string(), ": ", std::strerror(rc)));
    }
  }
  return absl::OkStatus();
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Runs fn(rank) on every rank's thread; the first error, if any.
absl::Status OnRanks(std::vector<std::unique_ptr<Rank>>& ranks,
                     const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> statuses(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] { statuses[r] = fn(static_cast<int>(r)); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) return Annotate(statuses[r], absl::StrCat("rank ", r));
  }
  return absl::OkStatus();
}

absl::Status Run(const Flags& f) {
  const absl::Time deadline = absl::Now() + absl::Seconds(f.timeout_s);
  SL_ASSIGN_OR_RETURN(auto comms,
                      CreateLocalCommunicators(f.world, {.timeout = absl::Seconds(f.timeout_s)}));
  std::vector<std::unique_ptr<Rank>> ranks(f.world);
  SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) -> absl::Status {
    SL_ASSIGN_OR_RETURN(ranks[r], MakeRank(f, comms[r], deadline));
    return absl::OkStatus();
  }));
  uint64_t bytes = 0;
  for (const auto& rank : ranks) bytes += rank->Bytes(f.states);
  std::error_code ec;
  fs::create_directories(f.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", f.dir, ": ", ec.message()));

  // The memcpy floor: each rank's shards into pre-faulted memory of its own, all at once.
  std::vector<std::vector<char>> copies(f.world);
  for (int r = 0; r < f.world; ++r) copies[r].assign(ranks[r]->Bytes(f.states), 1);

  for (int round = 0; round < f.rounds; ++round) {
    const fs::path dir = fs::path(f.dir) / absl::StrCat("round", round);
    fs::remove_all(dir, ec);
    SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) {
      Fill(*ranks[r], f.states, false);
      return absl::OkStatus();
    }));

    Clock::time_point t0 = Clock::now();
    SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) {
      Rank& rank = *ranks[r];
      char* out = copies[r].data();
      for (int u = 0; u < rank.sched->num_units(); ++u) {
        for (int k = 0; k <= f.states; ++k) {
          std::memcpy(out, rank.Data(u, k), rank.Elements(u) * 4);
          out += rank.Elements(u) * 4;
        }
      }
      return absl::OkStatus();
    }));
    const double memcpy_s = Seconds(t0, Clock::now());
    t0 = Clock::now();
    SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) {
      Rank& rank = *ranks[r];
      std::unique_ptr<char[]> fresh(new char[rank.Bytes(f.states)]);
      char* out = fresh.get();
      for (int u = 0; u < rank.sched->num_units(); ++u) {
        for (int k = 0; k <= f.states; ++k) {
          std::memcpy(out, rank.Data(u, k), rank.Elements(u) * 4);
          out += rank.Elements(u) * 4;
        }
      }
      return absl::OkStatus();
    }));
    const double memcpy_fresh_s = Seconds(t0, Clock::now());

    // Background saves: a new Checkpointer per round, so the first save allocates its snapshot.
    double blocked_s[2] = {0, 0};
    double background_s = 0;
    double snapshot_s = 0;  // of blocked_s[1]: the copy into the snapshot
    {
      std::vector<std::unique_ptr<Checkpointer>> async(f.world);
      SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) -> absl::Status {
        SL_ASSIGN_OR_RETURN(async[r], Checkpointer::Create(*ranks[r]->sched, {}, deadline));
        for (int u = 0; u < f.units; ++u) {
          for (int s = 0; s < f.states; ++s) {
            SL_RETURN_IF_ERROR(async[r]->AddState({.unit = u,
                                                   .name = absl::StrCat("state", s),
                                                   .data = ranks[r]->states[u][s].data(),
                                                   .dtype = DType::kF32}));
          }
        }
        return absl::OkStatus();
      }));
      for (int k = 0; k < 2; ++k) {
        const fs::path target = fs::path(f.dir) / absl::StrCat("async", round, "-", k);
        SL_RETURN_IF_ERROR(
            OnRanks(ranks, [&](int r) { return async[r]->SaveAsync(target.string(), deadline); }));
        SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) { return async[r]->WaitForSave(deadline); }));
        for (int r = 0; r < f.world; ++r) {
          const CheckpointSaveStats stats = async[r]->last_save_stats();
          blocked_s[k] = std::max(blocked_s[k], absl::ToDoubleSeconds(stats.blocked));
          if (k == 1) {
            background_s = std::max(background_s, absl::ToDoubleSeconds(stats.write));
            snapshot_s = std::max(snapshot_s, absl::ToDoubleSeconds(stats.snapshot));
          }
        }
        fs::remove_all(target, ec);
      }
    }

    const fs::path exported = fs::path(f.dir) / absl::StrCat("export", round, ".safetensors");
    t0 = Clock::now();
    SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) {
      return ExportSafetensors(*ranks[r]->sched, exported.string(), {}, deadline);
    }));
    const double export_s = Seconds(t0, Clock::now());
    const uint64_t export_bytes = fs::file_size(exported);
    fs::remove(exported, ec);

    t0 = Clock::now();
    SL_RETURN_IF_ERROR(
        OnRanks(ranks, [&](int r) { return ranks[r]->ckpt->Save(dir.string(), deadline); }));
    const double save_s = Seconds(t0, Clock::now());

    uint64_t file_bytes = 0;
    for (const auto& entry : fs::directory_iterator(dir)) file_bytes += entry.file_size();
    SL_RETURN_IF_ERROR(DropCache(dir));
    SL_RETURN_IF_ERROR(OnRanks(ranks, [&](int r) {
      Fill(*ranks[r], f.states, true);
      return absl::OkStatus();
    }));

    t0 = Clock::now();
    SL_RETURN_IF_ERROR(
        OnRanks(ranks, [&](int r) { return ranks[r]->ckpt->Load(dir.string(), deadline); }));
    const double load_s = Seconds(t0, Clock::now());

    uint64_t wrong = 0;
    for (auto& rank : ranks) wrong += Mismatches(*rank, f.states);
    if (wrong != 0) {
      return absl::DataLossError(
          absl::StrCat("round ", round, ": ", wrong, " elements differ from the saved values"));
    }
    fs::remove_all(dir, ec);
    std::printf(
        "{\"round\": %d, \"world\": %d, \"bytes\": %llu, \"file_bytes\": %llu, "
        "\"memcpy_s\": %.6f, \"memcpy_fresh_s\": %.6f, \"save_s\": %.6f, \"load_s\": %.6f, "
        "\"blocked_first_s\": %.6f, \"blocked_s\": %.6f, \"snapshot_s\": %.6f, \"background_s\": "
        "%.6f, \"export_bytes\": %llu, \"export_s\": %.6f}\n",
        round, f.world, static_cast<unsigned long long>(bytes),
        static_cast<unsigned long long>(file_bytes), memcpy_s, memcpy_fresh_s, save_s, load_s,
        blocked_s[0], blocked_s[1], snapshot_s, background_s,
        static_cast<unsigned long long>(export_bytes), export_s);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  absl::StatusOr<shardline::Flags> flags = shardline::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  const absl::Status status = shardline::Run(*flags);
  if (!status.ok()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
