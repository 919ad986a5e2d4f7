// The crash tests' kill point (scheduler/checkpoint/internal/kill_points.h).

#include "scheduler/checkpoint/internal/kill_points.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace shardline::checkpoint_internal {

absl::StatusOr<KillPoint> ParseKillPoint(absl::string_view text) {
  KillPoint point;
  if (text.empty()) return point;
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is neither <operation index> nor <rank>:<operation index> (integers >= 0)"));
  };
  if (parts.size() > 2) return bad();
  if (parts.size() == 2 && (!absl::SimpleAtoi(parts[0], &point.rank) || point.rank < 0)) {
    return bad();
  }
  if (!absl::SimpleAtoi(parts.back(), &point.op) || point.op < 0) return bad();
  return point;
}

SL_PARAM(std::string, CheckpointKillAt, "CHECKPOINT_KILL_AT", "",
         "Test hook for crash tests: \"<k>\" or \"<rank>:<k>\" makes every Checkpointer of this "
         "process (of world rank <rank> only, if given) raise SIGKILL right before its k-th "
         "(0-based) mutating file operation (create_dir, create_file, append, sync, close, "
         "rename, sync_dir, counted as RecordingFileSystem counts them from the Checkpointer's "
         "creation), in Save and in SaveAsync's background writer alike.",
         [](const std::string& v) { return ParseKillPoint(v).status(); });

}  // namespace shardline::checkpoint_internal
