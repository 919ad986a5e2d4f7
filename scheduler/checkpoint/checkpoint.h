// File: scheduler/checkpoint/checkpoint.h
// -----------------------------------------------------------------------------
// Sharded checkpoints of a Scheduler's units: every rank writes its own shard of every unit's
// master shard and of any number of framework-registered shard-shaped states (an optimizer's
// moments, say), rank 0 writes the replicated states (AddReplicatedState: a step counter, any
// small tensor the same on every rank) once and one manifest (scheduler/checkpoint/manifest.h);
// a load at any world size or mesh shape has every rank read only the bytes its new shard needs,
// planned with PlanReshard (runtime/reshard_plan.h), and gives back the saved bits exactly.
//
//   SL_ASSIGN_OR_RETURN(auto ckpt, Checkpointer::Create(*sched, {}, deadline));
//   SL_RETURN_IF_ERROR(ckpt->AddState({.unit = u, .name = "adam.m", .data = m, .dtype = kF32}));
//   ... train; between steps (after the optimizer):
//   SL_RETURN_IF_ERROR(ckpt->Save("ckpt/step1000", deadline));
//   ... in another job, of another world size, with the same units and states registered:
//   SL_RETURN_IF_ERROR(ckpt->Load("ckpt/step1000", deadline));
//   ... or in the background: the call returns after copying the shards into host memory
//   SL_RETURN_IF_ERROR(ckpt->SaveAsync("ckpt/step2000", deadline));
//   ... train on; later (or before the next save, which waits for it anyway):
//   SL_RETURN_IF_ERROR(ckpt->WaitForSave(deadline));
//
// The calls are collective over the scheduler's world (every rank calls them, with the same
// path, between steps); they block the calling thread, every wait bounded by `deadline`, and
// return the same outcome on every rank: a rank whose own operation failed returns its error,
// the others the lowest failing rank's code and message, prefixed with its rank and marked as a
// peer error (IsPeerError). A file system shared by all ranks is assumed (NFS, Lustre, a local
// disk for one machine). A Checkpointer is used by one thread at a time (last_save_stats() may
// be called from any); SaveAsync's background thread is its own.
//
// Save(dir) and Load(dir) first check that every rank passed the same `dir` (as text, trailing
// slashes dropped): FailedPrecondition naming both paths otherwise, before anything is read or
// created.
//
// Save(dir):
//   1. rank 0 checks that `dir` does not exist and creates "<dir>.tmp-<nonce>" beside it;
//   2. under hybrid sharding only the first replica group (replicate rank 0) writes: shard s's
//      writer writes "shard-SSSSS-of-NNNNN.bin" (every unit's states, see manifest.h), one file
//      per shard, checksumming each block as it goes, fsyncs and closes it; rank 0 then writes
//      "replicated.bin" (the replicated states, if any) the same way;
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
//                        `dir` is a file, not a directory; the manifest or a data file is not a
//                        regular file (a FIFO: never opened blocking); the ranks passed
//                        different paths; a unit not sharded (mid-step)
//   InvalidArgument      a malformed or inconsistent manifest; units, tensors (shape, dtype),
//                        states or layouts that differ from the current ones
//   DataLoss             a data file of the wrong size (truncated, extended), a block whose
//                        CRC-32C differs from the manifest's (a flipped byte)
// Errors found before any byte is copied (everything but a checksum or read failure) leave the
// shards untouched; after a checksum failure the shards' contents are unspecified (the error says
// so; load again from a good checkpoint).
//
// Memory: shards and states in host memory are read and written in place; those on a device (a
// scheduler on a GPU, an optimizer's state there) go through a host copy each: a save copies
// them to host memory once (one copy per state on a stream of the device, before Save or
// SaveAsync return), a load reads into the host copy and copies it back once. A load stages at
// most max(read_chunk_bytes, one checksum block) at a time; a save writes from the shards
// (or their host copies) directly. A world of device memory (nccl, ucx staged) exchanges the
// phases' outcomes through its device's memory. File operations are plain blocking system
// calls: `deadline` bounds the waits for streams and peers, not a hung file system.
//
// SaveAsync(dir): phase 1 on the caller's thread, plus a copy of this rank's data file (its
// shards and states, no padding) into host memory, capped by max_snapshot_bytes; phases 2-4 on
// a background thread, from that copy, with the exchanges on the checkpointer's own communicator
// (a Dup of the world), so training and its collectives go on meanwhile. The outcome, the same
// on every rank as Save's, is WaitForSave's; a later Save, SaveAsync or Load (or the destructor)
// waits for it first. last_save_stats() reports the snapshot's size and the blocked and writing
// times.
//
// SHARDLINE_CHECKPOINT_KILL_AT=<k> or <rank>:<k> (a test hook) makes the process raise SIGKILL
// right before its checkpointer's k-th mutating file operation, in Save and in the background
// writer alike: crash tests kill a real process at every step of a save.
//
// Full weights as safetensors are in full_weights.h. The C API (bindings/c/shardline.h), Python
// (shardline.Checkpointer) and PyTorch (shardline.torch.save_checkpoint) wrap Save, SaveAsync,
// WaitForSave, Load and the replicated states.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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
// element as element i of the master shard), in memory (host, or the device of `device`) that
// outlives the Checkpointer. Its padding is written as zeros by a load.
struct CheckpointState {
  int unit = 0;          // a Scheduler unit id
  std::string name;      // 1-128 characters of [A-Za-z0-9._-]; not "master"; unique per unit
  void* data = nullptr;  // may be null only for a shard of no elements
  DType dtype = DType::kF32;
  // The framework keeps `data` unchanged until every save that includes it has finished (a copy
  // it made for the save, say): SaveAsync writes it from `data` and leaves it out of the
  // snapshot, so it is copied once, not twice.
  bool stable = false;
  // Where `data` lives: host memory, or a device's (an optimizer's state on a GPU), which a save
  // copies to host memory first (once, before Save/SaveAsync return) and a load fills through
  // a host copy, as it does device master shards.
  Device device = Device::Host();
};

// A state that is not shard-shaped and is the same on every rank (a step counter, a learning-rate
// schedule's position, a data loader's offset), owned by the framework: numel(shape) elements
// of `dtype`, row-major, in host memory that outlives the Checkpointer. A save stores rank 0's
// copy once (in replicated.bin, checksummed); a load gives every rank that copy.
struct CheckpointReplicatedState {
  std::string name;            // 1-128 characters of [A-Za-z0-9._-]; unique among them
  std::vector<int64_t> shape;  // {} is a scalar; dimensions >= 0
  DType dtype = DType::kF32;
  void* data = nullptr;  // may be null only for a state of no elements
};

struct CheckpointOptions {
  // Every file operation goes through it. Null: PosixFileSystem(). Must outlive the Checkpointer.
  FileSystem* file_system = nullptr;
  // A save checksums each piece in blocks of this many bytes (>= 1; stored in the manifest; a
  // load uses the manifest's): the granularity at which a load reads beyond what it needs.
  uint64_t checksum_block_bytes = uint64_t{1} << 20;
  // The most bytes a load reads at once: whole checksum blocks, at least one. >= 1.
  size_t read_chunk_bytes = size_t{8} << 20;
  // The most host memory (bytes) a background save (SaveAsync) may copy this rank's shards into;
  // 0: no cap. A rank's snapshot is exactly its data file: every unit's master shard and
  // registered states, without padding (the manifest's files[shard].bytes), and nothing on
  // ranks that write nothing (replicas other than the first under hybrid sharding). A SaveAsync
  // whose largest snapshot exceeds the cap fails on every rank with ResourceExhausted before
  // anything is written (Save, which writes from the shards directly, needs no snapshot).
  uint64_t max_snapshot_bytes = 0;
};

// What the latest save (Save or SaveAsync) cost this rank: Checkpointer::last_save_stats().
struct CheckpointSaveStats {
  std::string dir;          // the save's target directory ("" before any save)
  bool background = false;  // SaveAsync (true) or Save (false)
  bool finished = false;    // false while a background save is pending
  // The host copy of this rank's shards that SaveAsync made (0 for Save and for a rank that
  // writes nothing; stable states are not copied), and the memory held for it (kept for the
  // next background save).
  uint64_t snapshot_bytes = 0;
  uint64_t snapshot_capacity_bytes = 0;
  // How long the call kept the caller: all of Save; for SaveAsync the wait for an earlier
  // save, the agreement and the snapshot. `waited` and `snapshot` are parts of it: the wait for
  // an earlier pending save, and the copy into the snapshot.
  absl::Duration blocked = absl::ZeroDuration();
  absl::Duration waited = absl::ZeroDuration();
  absl::Duration snapshot = absl::ZeroDuration();
  // SaveAsync: the background thread's time (files, the exchange, publishing); 0 for Save.
  absl::Duration write = absl::ZeroDuration();
};

class Checkpointer {
 public:
  // Collective over scheduler.mesh().world() (a Dup of it carries the checkpoint's exchanges).
  // `scheduler` must outlive the Checkpointer. InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(Scheduler& scheduler,
                                                              CheckpointOptions options,
                                                              absl::Time deadline);

  // Waits for a pending background save (bounded by that save's own deadline; its outcome, if
  // not collected by WaitForSave, is logged at WARN when it failed).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Registers a state, saved after the unit's master shard and the unit's earlier states. Every
  // rank registers the same states in the same order (a save checks it). InvalidArgument for an
  // unknown unit, a bad, reserved or duplicate name, or null data for a non-empty shard.
  absl::Status AddState(CheckpointState state);
  const std::vector<CheckpointState>& states() const { return states_; }
  // Registers a replicated state, saved in registration order. Every rank registers the same
  // ones in the same order (a save checks names, shapes and dtypes; only rank 0's values are
  // written). InvalidArgument for a bad or duplicate name, a negative dimension, an invalid
  // dtype, or null data for a non-empty state.
  absl::Status AddReplicatedState(CheckpointReplicatedState state);
  const std::vector<CheckpointReplicatedState>& replicated_states() const { return replicated_; }

  // Saves every unit of the scheduler and every registered state into the new directory `dir`
  // (see the header comment). AlreadyExists if `dir` exists. Save, SaveAsync and Load first wait
  // (until `deadline`) for a pending background save; if that one failed and WaitForSave has not
  // returned its outcome, they return its error (prefixed "the previous background save '<dir>'
  // failed: ") and do nothing else.
  absl::Status Save(absl::string_view dir, absl::Time deadline);
  // Saves as Save does, in the background: the call (collective, between steps, as Save) has the
  // ranks agree (rank 0 creates the temporary directory), copies this rank's shards and states
  // into host memory (the snapshot, see CheckpointOptions::max_snapshot_bytes) and returns; a
  // background thread then writes the data file from the snapshot, exchanges the outcomes on the
  // checkpointer's own communicator (a Dup of the world: the scheduler's collectives go on
  // meanwhile) and rank 0 publishes, with the same files, operations and atomicity as Save. The
  // shards may change as soon as it returns. Every wait of the background part is bounded by
  // `deadline`. An error returned here (the same on every rank) means nothing runs in the
  // background; the outcome of what does is WaitForSave's. (Should the thread fail to start,
  // the save completes on the calling thread and its outcome is returned here.)
  absl::Status SaveAsync(absl::string_view dir, absl::Time deadline);
  // Waits for the pending background save and returns its outcome, the same on every rank as
  // Save's (OK if none is pending; each outcome is returned once). DeadlineExceeded if it is
  // still running at `deadline` (it stays pending: wait again). Not collective.
  absl::Status WaitForSave(absl::Time deadline);
  // Whether a background save was started and its outcome not yet returned by WaitForSave.
  bool save_pending() const;
  // The latest save's figures (of the pending one while it runs).
  CheckpointSaveStats last_save_stats() const;

  // Loads the checkpoint in `dir` into every unit's master shard and every registered state.
  absl::Status Load(absl::string_view dir, absl::Time deadline);

 private:
  struct LoadPlan;
  struct SaveJob;

  Checkpointer(Scheduler& scheduler, CheckpointOptions options, std::shared_ptr<Communicator> world,
               std::unique_ptr<Stream> stream);

  // The units and their states as a save writes them (master first, then registered states).
  std::vector<CheckpointUnitContents> Contents() const;
  // The data of state `k` of unit `u` in Contents() order, in host memory: the state's own, or
  // for a state on a device its host copy (StageDeviceStates).
  void* StateData(int unit, size_t k) const;
  // The state's own memory and its device.
  void* StateMemory(int unit, size_t k) const;
  Device StateDevice(int unit, size_t k) const;
  // Host copies of the states on devices (master shards of a GPU scheduler, optimizer states on
  // a GPU): made for every such state, and for a save filled with one device-to-host copy each
  // on a stream of the device (after the compute stream's work, which PrepareUnits waited for).
  absl::Status StageDeviceStates(bool copy_out, absl::Time deadline);
  // After a load: the host copies back into the device states.
  absl::Status UnstageDeviceStates(absl::Time deadline);
  // Whether that state is stable (CheckpointState::stable; the master shard never is).
  bool StateStable(int unit, size_t k) const;
  // Checks the units are sharded, waits for the compute (and, for a load, gather) stream, and
  // stages the states on devices (StageDeviceStates; for a save, copied out).
  absl::Status PrepareUnits(absl::string_view what, bool for_load, absl::Time deadline);
  // The all-gather every phase ends with (see Agree in checkpoint.cc).
  absl::Status Agree(absl::Status mine, absl::string_view what, uint64_t fingerprint,
                     const std::string& extra, size_t extra_bytes, std::vector<std::string>* all,
                     absl::Time deadline);
  // The first exchange of a save or a load: `mine` (the directory's own check), and whether
  // every rank passed the same directory (compared as text, trailing slashes dropped).
  // FailedPrecondition naming the first rank whose `dir` differs from rank 0's and both paths.
  absl::Status AgreeOnDir(absl::Status mine, absl::string_view what, const std::string& dir,
                          absl::Time deadline);
  // Save phase 1 (on the caller's thread): checks, the manifest, rank 0's temporary directory,
  // the agreement; for a background save also the snapshot limit and the snapshot itself.
  absl::Status BeginSave(absl::string_view dir_arg, bool background, absl::Time deadline,
                         SaveJob* job);
  // Save phases 2-4: writes, exchanges the checksums, publishes (rank 0), agrees.
  absl::Status FinishSave(SaveJob& job);
  // Save phase 2: writes this rank's shard file (from the snapshot if `snapshot` is not null,
  // else from the shards); appends the block checksums in file order.
  absl::Status WriteShardFile(const std::string& tmp, const CheckpointManifest& manifest,
                              const char* snapshot, std::vector<uint32_t>* crcs);
  // Save phase 2 on rank 0: writes replicated.bin from `bytes` (the states back to back) and
  // sets the manifest's checksums.
  absl::Status WriteReplicatedFile(const std::string& tmp, const std::string& bytes,
                                   CheckpointManifest* manifest);
  // Before Save, SaveAsync, Load: waits for a pending background save; its error if it failed
  // and was not collected.
  absl::Status SettlePending(absl::Time deadline);
  // Save phase 4 (rank 0): the manifest, the fsyncs and the rename.
  absl::Status Publish(const std::string& dir, const std::string& tmp,
                       const CheckpointManifest& manifest);
  // Load phase 1: reads and checks the manifest against the units, plans the reads and opens
  // the files. Load phase 2: zeroes the padding, reads, verifies and copies.
  absl::Status PlanLoad(const std::string& dir, LoadPlan* plan);
  absl::Status RunLoad(LoadPlan& plan);
  // Load phase 1 for the replicated states: reads and verifies each registered one.
  absl::Status PlanReplicatedLoad(const std::string& dir, LoadPlan* plan);
  // FNV-1a of the units (names, layouts) and states (names, dtypes), compared across ranks.
  uint64_t RegistrationFingerprint() const;

  Scheduler& scheduler_;
  CheckpointOptions options_;
  FileSystem* fs_;
  std::shared_ptr<Communicator> world_;
  std::unique_ptr<Stream> stream_;  // a caller stream for the exchanges
  std::vector<CheckpointState> states_;
  std::vector<CheckpointReplicatedState> replicated_;
  // (unit, state index in Contents() order) -> the host copy of a state on a device.
  std::map<std::pair<int, size_t>, std::vector<uint8_t>> host_copies_;
  // Set when SHARDLINE_CHECKPOINT_KILL_AT names this rank: wraps the file system, fs_ points here.
  std::unique_ptr<RecordingFileSystem> killer_;

  // The background save. `background_` runs FinishSave on `pending_`; `mu_` guards `done_`,
  // `outcome_` and `stats_`, `done_cv_` signals done_. `snapshot_` (capacity
  // `snapshot_capacity_`) belongs to the background thread while one runs.
  std::thread background_;
  std::unique_ptr<SaveJob> pending_;
  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
  absl::Status outcome_;
  CheckpointSaveStats stats_;
  std::unique_ptr<char[]> snapshot_;
  uint64_t snapshot_capacity_ = 0;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_CHECKPOINT_H_
