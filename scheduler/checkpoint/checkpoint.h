// File: scheduler/checkpoint/checkpoint.h
// -----------------------------------------------------------------------------
// Sharded checkpoints of a Scheduler's units: every rank writes its own shard of every unit's
// master shard and of any number of framework-registered shard-shaped states (an optimizer's
// moments, say), rank 0 writes one manifest (scheduler/checkpoint/manifest.h); a load at any
// world size or mesh shape has every rank read only the bytes its new shard needs, planned with
// PlanReshard (runtime/reshard_plan.h), and gives back the saved bits exactly.
//
//   SL_ASSIGN_OR_RETURN(auto ckpt, Checkpointer::Create(*sched, {}, deadline));
//   SL_RETURN_IF_ERROR(ckpt->AddState({.unit = u, .name = "adam.m", .data = m, .dtype = kF32}));
//   ... train; between steps (after the optimizer):
//   SL_RETURN_IF_ERROR(ckpt->Save("ckpt/step1000", deadline));
//   ... in another job, of another world size, with the same units and states registered:
//   SL_RETURN_IF_ERROR(ckpt->Load("ckpt/step1000", deadline));
//
// Both calls are collective over the scheduler's world (every rank calls them, with the same
// path, between steps); they block the calling thread, every wait bounded by `deadline`, and
// return the same outcome on every rank: a rank whose own operation failed returns its error,
// the others the lowest failing rank's code and message, prefixed with its rank and marked as a
// peer error (IsPeerError). A file system shared by all ranks is assumed (NFS, Lustre, a local
// disk for one machine).
//
// Save(dir):
//   1. rank 0 checks that `dir` does not exist and creates "<dir>.tmp-<nonce>" beside it;
//   2. under hybrid sharding only the first replica group (replicate rank 0) writes: shard s's
//      writer writes "shard-SSSSS-of-NNNNN.bin" (every unit's states, see manifest.h), one file
//      per shard, checksumming each block as it goes, fsyncs and closes it;
//   3. the ranks exchange their outcomes and checksums (an all-gather on the world, which is the
//      barrier);
//   4. rank 0 writes manifest.json last, fsyncs it, fsyncs the directory, renames it to `dir`
//      (never replacing an existing one) and fsyncs the parent directory.
// A save that stops anywhere (an error, a killed process) leaves earlier checkpoints as they
// were, and either no `dir` or (if only the final parent fsync was missing) a complete `dir`.
// What else it leaves is "<dir>.tmp-<nonce>" (16 hex digits), with or without a manifest, which
// every load and ReadCheckpointManifest report as an incomplete checkpoint (FailedPrecondition);
// it can be deleted. A failed save never deletes anything itself (a killed one could not).
//
// Load(dir): every rank reads and validates the manifest, checks it against the scheduler's units
// (the same unit names; per unit the same tensors — names, shapes, dtypes, ties — and master
// dtype; every registered state present with the same dtype; checkpoint states not registered
// are skipped), plans the reshard from the saved layouts to the current ones, and opens the data
// files it needs, checking their sizes; the ranks agree; then each rank zeroes its shards'
// padding and reads, for every state, only the checksum blocks that cover the elements its
// shard owns, verifying each block before copying from it. Errors name the checkpoint, the file
// and the unit, state and tensor:
//   NotFound             the directory or a data file is missing
//   FailedPrecondition   incomplete checkpoint (a save's temporary directory, or no manifest);
//                        a unit not sharded (mid-step)
//   InvalidArgument      a malformed or inconsistent manifest; units, tensors (shape, dtype),
//                        states or layouts that differ from the current ones
//   DataLoss             a data file of the wrong size (truncated, extended), a block whose
//                        CRC-32C differs from the manifest's (a flipped byte)
// Errors found before any byte is copied (everything but a checksum or read failure) leave the
// shards untouched; after a checksum failure the shards' contents are unspecified (the error says
// so; load again from a good checkpoint).
//
// Memory: shards and states must be host memory (Unimplemented for a device master shard; CPU
// offload's host shards work). A load stages at most max(read_chunk_bytes, one checksum block)
// at a time; a save writes from the shards directly. File operations are plain blocking system
// calls: `deadline` bounds the waits for streams and peers, not a hung file system.
//
// Not in this slice: background (asynchronous) saves, full-weight safetensors export/import,
// the C API and Python surfaces.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/manifest.h"
#include "scheduler/scheduler.h"

namespace shardline {

// A shard-shaped state of a unit, owned by the framework: unit(u).layout().shard_elements()
// elements of `dtype`, laid out as the unit's shard (element i belongs to the same tensor
// element as element i of the master shard), in host memory that outlives the Checkpointer.
// Its padding is written as zeros by a load.
struct CheckpointState {
  int unit = 0;          // a Scheduler unit id
  std::string name;      // 1-128 characters of [A-Za-z0-9._-]; not "master"; unique per unit
  void* data = nullptr;  // may be null only for a shard of no elements
  DType dtype = DType::kF32;
};

struct CheckpointOptions {
  // Every file operation goes through it. Null: PosixFileSystem(). Must outlive the Checkpointer.
  FileSystem* file_system = nullptr;
  // A save checksums each piece in blocks of this many bytes (>= 1; stored in the manifest; a
  // load uses the manifest's): the granularity at which a load reads beyond what it needs.
  uint64_t checksum_block_bytes = uint64_t{1} << 20;
  // The most bytes a load reads at once: whole checksum blocks, at least one. >= 1.
  size_t read_chunk_bytes = size_t{8} << 20;
};

class Checkpointer {
 public:
  // Collective over scheduler.mesh().world() (a Dup of it carries the checkpoint's exchanges).
  // `scheduler` must outlive the Checkpointer. InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(Scheduler& scheduler,
                                                              CheckpointOptions options,
                                                              absl::Time deadline);

  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Registers a state, saved after the unit's master shard and the unit's earlier states. Every
  // rank registers the same states in the same order (a save checks it). InvalidArgument for an
  // unknown unit, a bad, reserved or duplicate name, or null data for a non-empty shard.
  absl::Status AddState(CheckpointState state);
  const std::vector<CheckpointState>& states() const { return states_; }

  // Saves every unit of the scheduler and every registered state into the new directory `dir`
  // (see the header comment). AlreadyExists if `dir` exists.
  absl::Status Save(absl::string_view dir, absl::Time deadline);
  // Loads the checkpoint in `dir` into every unit's master shard and every registered state.
  absl::Status Load(absl::string_view dir, absl::Time deadline);

 private:
  struct LoadPlan;

  Checkpointer(Scheduler& scheduler, CheckpointOptions options, std::shared_ptr<Communicator> world,
               std::unique_ptr<Stream> stream);

  // The units and their states as a save writes them (master first, then registered states).
  std::vector<CheckpointUnitContents> Contents() const;
  // The data of state `k` of unit `u` in Contents() order.
  void* StateData(int unit, size_t k) const;
  // Checks the units are sharded and host-resident, and waits for the compute (and, for a load,
  // gather) stream.
  absl::Status PrepareUnits(absl::string_view what, bool for_load, absl::Time deadline);
  // The all-gather every phase ends with (see Agree in checkpoint.cc).
  absl::Status Agree(absl::Status mine, absl::string_view what, uint64_t fingerprint,
                     const std::string& extra, size_t extra_bytes, std::vector<std::string>* all,
                     absl::Time deadline);
  // Save phase 2: writes this rank's shard file; appends the block checksums in file order.
  absl::Status WriteShardFile(const std::string& tmp, const CheckpointManifest& manifest,
                              std::vector<uint32_t>* crcs);
  // Save phase 4 (rank 0): the manifest, the fsyncs and the rename.
  absl::Status Publish(const std::string& dir, const std::string& tmp,
                       const CheckpointManifest& manifest);
  // Load phase 1: reads and checks the manifest against the units, plans the reads and opens
  // the files. Load phase 2: zeroes the padding, reads, verifies and copies.
  absl::Status PlanLoad(const std::string& dir, LoadPlan* plan);
  absl::Status RunLoad(LoadPlan& plan);
  // FNV-1a of the units (names, layouts) and states (names, dtypes), compared across ranks.
  uint64_t RegistrationFingerprint() const;

  Scheduler& scheduler_;
  CheckpointOptions options_;
  FileSystem* fs_;
  std::shared_ptr<Communicator> world_;
  std::unique_ptr<Stream> stream_;  // a caller stream for the exchanges
  std::vector<CheckpointState> states_;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_
