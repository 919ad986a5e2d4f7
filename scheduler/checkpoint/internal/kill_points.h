// File: scheduler/checkpoint/internal/kill_points.h
// -----------------------------------------------------------------------------
// Private to scheduler/checkpoint/ (not installed): the crash tests' kill point. When
// SHARDLINE_CHECKPOINT_KILL_AT names this process's rank, Checkpointer::Create wraps the file
// system in a RecordingFileSystem that raises SIGKILL right before the named file operation
// (tests/scripts/checkpoint_kill_test.py kills a save at every one of them).

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_KILL_POINTS_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_KILL_POINTS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/config.h"

namespace shardline::checkpoint_internal {

// SHARDLINE_CHECKPOINT_KILL_AT: "" (none), "<k>" (every rank) or "<rank>:<k>".
struct KillPoint {
  int rank = -1;  // -1: every rank
  int64_t op = -1;
};

// InvalidArgument unless `text` is "", "<k>" or "<rank>:<k>" (integers >= 0).
absl::StatusOr<KillPoint> ParseKillPoint(absl::string_view text);

// The knob SHARDLINE_CHECKPOINT_KILL_AT (its help text says what the operations are).
const Param<std::string>& ParamCheckpointKillAt();

}  // namespace shardline::checkpoint_internal

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_KILL_POINTS_H_
