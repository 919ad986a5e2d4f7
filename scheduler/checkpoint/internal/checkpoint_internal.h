// File: scheduler/checkpoint/internal/checkpoint_internal.h
// -----------------------------------------------------------------------------
// Private to the Checkpointer's sources (not installed): checkpoint.cc (creation, registration,
// the agreements), checkpoint_save.cc and checkpoint_load.cc share these (full_weights.cc the
// hash). The Checkpointer owns
// its pending background save (a SaveJob), so its constructor and destructor need the type.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_CHECKPOINT_INTERNAL_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_CHECKPOINT_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/manifest.h"

namespace shardline {

// One save between its agreement (BeginSave) and its end (FinishSave): everything FinishSave
// needs, so that a background thread reads nothing the caller's thread may change.
struct Checkpointer::SaveJob {
  std::string dir;
  std::string what;  // "checkpoint save '<dir>'"
  std::string tmp;
  CheckpointManifest manifest;
  uint64_t fingerprint = 0;
  bool writer = false;             // this rank writes a data file (replicate rank 0)
  const char* snapshot = nullptr;  // background: the data file's bytes; null: the shards
  uint64_t snapshot_bytes = 0;
  absl::Duration snapshot_time = absl::ZeroDuration();
  // Rank 0: the replicated states' bytes, back to back (copied at the call, so a background
  // save writes the values of that moment).
  std::string replicated;
  absl::Time deadline;
};

namespace checkpoint_internal {

// `dir` without trailing slashes ("ckpt/" -> "ckpt"); "" for "" or "/".
std::string NormalizeDir(absl::string_view dir);

// FNV-1a of `bytes`, continuing from `h` (start: 0xcbf29ce484222325): the fingerprints that
// every rank compares (the units', a save's options).
uint64_t Fnv1a(uint64_t h, absl::string_view bytes);

}  // namespace checkpoint_internal
}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_CHECKPOINT_INTERNAL_H_
