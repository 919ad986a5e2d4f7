// Communicator::Shrink: a communicator over the survivors of a failure, as ncclCommShrink.

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/communicator.h"
#include "runtime/logging.h"

namespace shardline {

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::Shrink(absl::Span<const int> excluded,
                                                                   absl::Time deadline) {
  const std::string where = absl::StrCat("shrinking ", name_, " (rank ", rank_, " of ", size_, ")");
  if (backend() == "nccl") {
    return absl::UnimplementedError(
        absl::StrCat(where, ": the nccl backend cannot shrink yet (ncclCommShrink is not wired)"));
  }
  std::vector<bool> out(size_, false);
  for (int r : excluded) {
    if (r < 0 || r >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": excluded rank ", r, " is not in [0, ", size_, ")"));
    }
    if (out[r]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": excluded rank ", r, " is listed twice"));
    }
    if (r == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": rank ", r, " cannot exclude itself (only survivors shrink)"));
    }
    out[r] = true;
  }
  std::vector<int> members;
  std::vector<int> sorted_excluded;
  for (int r = 0; r < size_; ++r) (out[r] ? sorted_excluded : members).push_back(r);
  const int index =
      static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  // The excluded set is part of the name: survivors that disagree on it never join one group
  // (they time out naming the ranks they waited for) instead of building an inconsistent one.
  const std::string name =
      absl::StrCat(name_, "/shrink", next_shrink_.fetch_add(1), ".without",
                   sorted_excluded.empty() ? "_none" : "_", absl::StrJoin(sorted_excluded, "_"));
  SL_LOG(INFO, COLL) << where << ": new communicator " << name << " of " << members.size()
                     << " ranks, this one rank " << index;
  return CreateSubgroup(members, index, name, deadline);
}

}  // namespace shardline
