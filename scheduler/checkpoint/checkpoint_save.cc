// Checkpointer's save (scheduler/checkpoint/checkpoint.h): Save, and SaveAsync with its
// background writer. Phase 1 (BeginSave, on the caller's thread) checks, computes the manifest
// and agrees; phases 2-4 (FinishSave) write the data files, exchange the checksums and publish.

#include "scheduler/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <random>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/crc32c.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/agree.h"
#include "scheduler/checkpoint/internal/checkpoint_internal.h"

#ifndef SHARDLINE_LIBRARY_VERSION
#define SHARDLINE_LIBRARY_VERSION "unknown"
#endif

namespace shardline {
namespace {

constexpr size_t kNonceBytes = 16;

std::string ParentDir(const std::string& dir) {
  const size_t slash = dir.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return dir.substr(0, slash);
}

std::string MakeNonce() {
  std::random_device device;
  uint64_t v = (static_cast<uint64_t>(device()) << 32) ^ device();
  v ^= static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return absl::StrFormat("%016x", v);
}

// Calls fn(unit index, state index, piece, dtype size) for every piece of shard `shard`, in file
// order.
template <typename Fn>
void ForEachPieceOfShard(const CheckpointManifest& manifest, int shard, Fn fn) {
  for (size_t u = 0; u < manifest.units.size(); ++u) {
    const CheckpointUnitRecord& unit = manifest.units[u];
    // The pieces of a shard are contiguous: they follow the layout's slices.
    const absl::Span<const ShardSlice> mine = unit.layout.ShardSlices(shard);
    const size_t first = static_cast<size_t>(mine.data() - unit.layout.slices().data());
    for (size_t k = 0; k < unit.states.size(); ++k) {
      const CheckpointStateRecord& state = unit.states[k];
      const size_t size = DTypeSize(state.dtype);
      for (size_t i = first; i < first + mine.size(); ++i) fn(u, k, state.pieces[i], size);
    }
  }
}

}  // namespace

using checkpoint_internal::NormalizeDir;

absl::Status Checkpointer::WriteShardFile(const std::string& tmp,
                                          const CheckpointManifest& manifest, const char* snapshot,
                                          std::vector<uint32_t>* crcs) {
  const int shard = scheduler_.mesh().shard_rank();
  const std::string path = absl::StrCat(tmp, "/", manifest.files[shard].name);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  const uint64_t block = manifest.checksum_block_bytes;
  absl::Status status;
  // One append per piece, from the shards or the snapshot alike: the same file operations.
  ForEachPieceOfShard(
      manifest, shard, [&](size_t u, size_t k, const CheckpointPiece& piece, size_t size) {
        if (!status.ok()) return;
        const char* data = snapshot != nullptr && !StateStable(static_cast<int>(u), k)
                               ? snapshot + piece.file_offset
                               : static_cast<const char*>(StateData(static_cast<int>(u), k)) +
                                     piece.shard_offset * size;
        for (uint64_t b = 0; b < piece.bytes; b += block) {
          crcs->push_back(Crc32c(data + b, std::min(block, piece.bytes - b)));
        }
        status = file->Append(data, piece.bytes);
      });
  SL_RETURN_IF_ERROR(status);
  SL_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status Checkpointer::WriteReplicatedFile(const std::string& tmp, const std::string& bytes,
                                               CheckpointManifest* manifest) {
  const std::string path = absl::StrCat(tmp, "/", kCheckpointReplicatedFileName);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  for (CheckpointReplicatedRecord& r : manifest->replicated) {
    r.crc32c = Crc32c(bytes.data() + r.file_offset, r.bytes);
  }
  SL_RETURN_IF_ERROR(file->Append(bytes.data(), bytes.size()));
  SL_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status Checkpointer::Publish(const std::string& dir, const std::string& tmp,
                                   const CheckpointManifest& manifest) {
  const std::string json = CheckpointManifestToJson(manifest);
  const std::string path = absl::StrCat(tmp, "/", kCheckpointManifestName);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  SL_RETURN_IF_ERROR(file->Append(json.data(), json.size()));
  SL_RETURN_IF_ERROR(file->Sync());
  SL_RETURN_IF_ERROR(file->Close());
  SL_RETURN_IF_ERROR(fs_->SyncDir(tmp));
  SL_RETURN_IF_ERROR(fs_->Rename(tmp, dir));
  return fs_->SyncDir(ParentDir(dir));
}

absl::Status Checkpointer::BeginSave(absl::string_view dir_arg, bool background,
                                     absl::Time deadline, SaveJob* job) {
  job->dir = NormalizeDir(dir_arg);
  job->what = absl::StrCat("checkpoint save '", job->dir, "'");
  job->deadline = deadline;
  const std::string& what = job->what;
  // Before anything else, and with the bad-directory check in it: a rank that returned here
  // alone would leave the others waiting in their first exchange until the deadline.
  SL_RETURN_IF_ERROR(AgreeOnDir(job->dir.empty()
                                    ? absl::InvalidArgumentError(absl::StrCat(
                                          "checkpoint save: bad directory '", dir_arg, "'"))
                                    : absl::OkStatus(),
                                what, job->dir, deadline));
  const ProcessMesh& mesh = scheduler_.mesh();
  const int rank = world_->rank();
  const int shard = mesh.shard_rank();
  job->writer = mesh.replicate_rank() == 0;

  // Every rank checks its units and computes the manifest (the same on every rank).
  absl::Status local = PrepareUnits(what, /*for_load=*/false, deadline);
  CheckpointManifest& manifest = job->manifest;
  if (local.ok()) {
    absl::StatusOr<CheckpointManifest> m =
        MakeCheckpointManifest(Contents(), mesh.replicate_size(), mesh.shard_size(),
                               options_.checksum_block_bytes, SHARDLINE_LIBRARY_VERSION);
    if (m.ok()) {
      manifest = *std::move(m);
    } else {
      local = Annotate(m.status(), what);
    }
  }
  if (local.ok()) {
    std::vector<CheckpointReplicatedRecord> records;
    for (const CheckpointReplicatedState& r : replicated_) {
      records.push_back({.name = r.name, .shape = r.shape, .dtype = r.dtype});
    }
    local = Annotate(SetCheckpointReplicatedStates(&manifest, std::move(records)), what);
  }
  if (local.ok() && rank == 0) {
    job->replicated.resize(manifest.replicated_bytes);
    for (size_t i = 0; i < replicated_.size(); ++i) {
      const CheckpointReplicatedRecord& r = manifest.replicated[i];
      if (r.bytes > 0) std::memcpy(&job->replicated[r.file_offset], replicated_[i].data, r.bytes);
    }
  }
  // A background save copies each writer's data file into host memory. Every rank checks every
  // shard's size against the cap, so that all fail alike before rank 0 creates anything.
  if (local.ok() && background && options_.max_snapshot_bytes > 0) {
    for (const CheckpointFileRecord& f : manifest.files) {
      if (f.bytes > options_.max_snapshot_bytes) {
        local = absl::ResourceExhaustedError(absl::StrCat(
            what, ": the snapshot of shard ", f.shard, " would take ", f.bytes,
            " bytes of host memory, more than max_snapshot_bytes (", options_.max_snapshot_bytes,
            "); raise the cap or use Save, which writes from the shards without a snapshot"));
        break;
      }
    }
  }
  if (local.ok() && background && job->writer) {
    const uint64_t bytes = manifest.files[shard].bytes;
    if (bytes > snapshot_capacity_) {
      snapshot_.reset();
      snapshot_capacity_ = 0;
      snapshot_.reset(new (std::nothrow) char[bytes]);
      if (snapshot_ == nullptr) {
        local = absl::ResourceExhaustedError(absl::StrCat(what, ": cannot allocate the snapshot's ",
                                                          bytes, " bytes of host memory"));
      } else {
        snapshot_capacity_ = bytes;
      }
    }
    if (local.ok()) {
      const absl::Time start = absl::Now();
      char* out = snapshot_.get();
      uint64_t copied = 0;
      // Stable states are written from the framework's memory: their part of the snapshot is
      // never touched (nor, untouched, given pages).
      ForEachPieceOfShard(
          manifest, shard, [&](size_t u, size_t k, const CheckpointPiece& piece, size_t size) {
            if (StateStable(static_cast<int>(u), k)) return;
            std::memcpy(out + piece.file_offset,
                        static_cast<const char*>(StateData(static_cast<int>(u), k)) +
                            piece.shard_offset * size,
                        piece.bytes);
            copied += piece.bytes;
          });
      job->snapshot = out;
      job->snapshot_bytes = copied;
      job->snapshot_time = absl::Now() - start;
    }
  }
  // Rank 0 creates the temporary directory and draws its name.
  std::string nonce;
  if (rank == 0 && local.ok()) {
    nonce = MakeNonce();
    absl::StatusOr<bool> exists = fs_->Exists(job->dir);
    if (!exists.ok()) {
      local = Annotate(exists.status(), what);
    } else if (*exists) {
      local = absl::AlreadyExistsError(
          absl::StrCat(what, ": '", job->dir,
                       "' exists (a save never replaces anything; choose a new directory)"));
    } else {
      local = Annotate(fs_->CreateDir(absl::StrCat(job->dir, ".tmp-", nonce)), what);
    }
  }
  std::vector<std::string> all;
  job->fingerprint = RegistrationFingerprint();
  // The fingerprint check comes first: the next exchange's size depends on the registrations.
  SL_RETURN_IF_ERROR(Agree(local, what, job->fingerprint, nonce, kNonceBytes, &all, deadline));
  job->tmp = absl::StrCat(job->dir, ".tmp-", all[0]);
  return absl::OkStatus();
}

absl::Status Checkpointer::FinishSave(SaveJob& job) {
  const std::string& what = job.what;
  CheckpointManifest& manifest = job.manifest;
  // Phase 2: the first replica group writes one file per shard.
  std::vector<uint32_t> crcs;
  absl::Status written;
  if (job.writer) {
    written = Annotate(WriteShardFile(job.tmp, manifest, job.snapshot, &crcs), what);
  }
  if (written.ok() && world_->rank() == 0 && !manifest.replicated.empty()) {
    written = Annotate(WriteReplicatedFile(job.tmp, job.replicated, &manifest), what);
  }
  std::vector<uint64_t> blocks(manifest.files.size(), 0);
  for (const CheckpointUnitRecord& unit : manifest.units) {
    for (const CheckpointStateRecord& state : unit.states) {
      for (const CheckpointPiece& piece : state.pieces) blocks[piece.shard] += piece.crc32c.size();
    }
  }
  const uint64_t max_blocks = *std::max_element(blocks.begin(), blocks.end());
  std::string extra(max_blocks * 4, '\0');
  for (size_t i = 0; i < crcs.size() && i < max_blocks; ++i)
    PutLittleEndian(&extra[4 * i], crcs[i], 4);
  std::vector<std::string> all;
  SL_RETURN_IF_ERROR(
      Agree(written, what, job.fingerprint, extra, extra.size(), &all, job.deadline));

  // Phase 3: rank 0 completes the manifest with every writer's checksums (shard s's writer is
  // world rank s: row 0, column s of the mesh) and publishes the checkpoint.
  absl::Status published;
  if (world_->rank() == 0) {
    // One pass in manifest order: each writer appended its checksums in that order.
    std::vector<size_t> next(manifest.files.size(), 0);
    for (CheckpointUnitRecord& unit : manifest.units) {
      for (CheckpointStateRecord& state : unit.states) {
        for (CheckpointPiece& piece : state.pieces) {
          const std::string& from = all[piece.shard];
          for (uint32_t& crc : piece.crc32c) {
            crc = static_cast<uint32_t>(GetLittleEndian(&from[4 * next[piece.shard]++], 4));
          }
        }
      }
    }
    published = Annotate(Publish(job.dir, job.tmp, manifest), what);
  }
  return Agree(published, what, 0, "", 0, nullptr, job.deadline);
}

absl::Status Checkpointer::SettlePending(absl::Time deadline) {
  if (!background_.joinable()) return absl::OkStatus();
  const std::string dir = pending_->dir;
  absl::Status outcome = WaitForSave(deadline);
  if (outcome.ok() || save_pending()) return outcome;  // still running: DeadlineExceeded
  return Annotate(outcome, absl::StrCat("the previous background save '", dir, "' failed"));
}

absl::Status Checkpointer::Save(absl::string_view dir, absl::Time deadline) {
  const absl::Time start = absl::Now();
  SL_RETURN_IF_ERROR(SettlePending(deadline));
  const absl::Duration waited = absl::Now() - start;
  SaveJob job;
  absl::Status status = BeginSave(dir, /*background=*/false, deadline, &job);
  if (status.ok()) status = FinishSave(job);
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CheckpointSaveStats{.dir = job.dir,
                               .background = false,
                               .finished = true,
                               .snapshot_capacity_bytes = snapshot_capacity_,
                               .blocked = absl::Now() - start,
                               .waited = waited};
  return status;
}

absl::Status Checkpointer::SaveAsync(absl::string_view dir, absl::Time deadline) {
  const absl::Time start = absl::Now();
  SL_RETURN_IF_ERROR(SettlePending(deadline));
  const absl::Duration waited = absl::Now() - start;
  auto job = std::make_unique<SaveJob>();
  const absl::Status status = BeginSave(dir, /*background=*/true, deadline, job.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = CheckpointSaveStats{.dir = job->dir,
                                 .background = true,
                                 .finished = !status.ok(),
                                 .snapshot_bytes = job->snapshot_bytes,
                                 .snapshot_capacity_bytes = snapshot_capacity_,
                                 .blocked = absl::Now() - start,
                                 .waited = waited,
                                 .snapshot = job->snapshot_time};
    done_ = false;
    outcome_ = absl::OkStatus();
  }
  SL_RETURN_IF_ERROR(status);
  pending_ = std::move(job);
  const auto finish = [this]() -> absl::Status {
    const absl::Time begin = absl::Now();
    absl::Status outcome = FinishSave(*pending_);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.write = absl::Now() - begin;
    stats_.finished = true;
    return outcome;
  };
  try {
    background_ = std::thread([this, finish] {
      absl::Status outcome = finish();
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = std::move(outcome);
      done_ = true;
      done_cv_.notify_all();
    });
  } catch (const std::system_error&) {
    // No thread to be had: the save still completes (the other ranks' writers expect this
    // rank's exchanges), on this thread, and its outcome is returned now.
    absl::Status outcome = finish();
    pending_.reset();
    return outcome;
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::WaitForSave(absl::Time deadline) {
  if (!background_.joinable()) return absl::OkStatus();
  {
    std::unique_lock<std::mutex> lock(mu_);
    // A finite horizon: the chrono conversion of an infinite deadline overflows.
    const absl::Time until = std::min(deadline, absl::Now() + absl::Hours(24 * 365));
    while (!done_) {
      if (done_cv_.wait_until(lock, absl::ToChronoTime(until)) == std::cv_status::timeout &&
          !done_ && absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(pending_->what, ": the background save is still running at the deadline"));
      }
    }
  }
  background_.join();
  pending_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(outcome_, absl::OkStatus());
}

bool Checkpointer::save_pending() const { return background_.joinable(); }

CheckpointSaveStats Checkpointer::last_save_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace shardline
