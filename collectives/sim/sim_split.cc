// A sim group's splits: how its ranks agree on a Split (a rendezvous of their threads, a Dup
// taken without one, or, in representative mode, SimOptions.split_call), and the groups that
// the members of a split then share.

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "collectives/sim/internal/sim_group.h"

namespace shardline::sim_internal {

absl::StatusOr<SimGroup::SplitResult> SimGroup::Split(uint64_t split, int rank, int color, int key,
                                                      absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  SplitEntry& entry = splits_[split];
  if (entry.calls.empty()) entry.calls.resize(size_);
  const std::string where = absl::StrCat("split #", split, " of ", options_.name, " (sim, rank ",
                                         rank, " of ", size_, ")");
  SplitResult result;
  const bool dup = color == 0 && key == rank;
  // Representative mode: a group with split_call takes every split from it; one without (a
  // split's group) only Dups.
  const bool take_as_dup =
      representative_ >= 0 ? options_.split_call == nullptr : options_.dup_without_rendezvous;
  if (dup && take_as_dup && entry.mode != SplitEntry::kGeneral) {
    // Dup: every rank joins group 0 in rank order, assuming the others make the same call.
    entry.mode = SplitEntry::kDup;
    entry.calls[rank] = std::make_pair(color, key);
    for (int r = 0; r < size_; ++r) result.members.push_back(r);
    result.index = rank;
  } else if (entry.mode == SplitEntry::kDup) {
    std::vector<int> dups;
    for (int r = 0; r < size_; ++r) {
      if (entry.calls[r].has_value()) dups.push_back(r);
    }
    absl::Status status = MarkPeerError(
        absl::InvalidArgumentError(absl::StrCat(
            where, ": this rank called Split(color=", color, ", key=", key, ") but rank(s) ",
            absl::StrJoin(dups, ", "),
            " called Split(0, own rank), which the sim backend took for Dup() and completed "
            "without waiting (SimOptions.dup_without_rendezvous): every rank must make the same "
            "call; for general splits from threads, set dup_without_rendezvous = false")),
        absl::StrJoin(dups, ", "));
    // The communicator those ranks got is wrong: make its collectives fail too.
    std::shared_ptr<SimGroup> wrong;
    if (auto it = children_.find(absl::StrCat(options_.name, "/split", split, ".color0"));
        it != children_.end()) {
      wrong = it->second.group;
    }
    lock.unlock();
    if (wrong != nullptr) wrong->Fail(status);
    return status;
  } else if (representative_ >= 0) {
    // Representative mode: the other ranks' calls come from split_call, no rendezvous.
    if (options_.split_call == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          where,
          ": a representative-rank simulation cannot split this group (no "
          "SimOptions.split_call: only the group CreateRepresentativeSimCommunicator made "
          "has one; splits of its splits other than Dup are not modelled)"));
    }
    entry.mode = SplitEntry::kGeneral;
    for (int r = 0; r < size_; ++r) entry.calls[r] = options_.split_call(split, r);
    if (*entry.calls[rank] != std::make_pair(color, key)) {
      const std::pair<int, int> expected = *entry.calls[rank];
      splits_.erase(split);
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the representative called Split(color=", color, ", key=", key,
                       ") but SimOptions.split_call says its call is (", expected.first, ", ",
                       expected.second, ")"));
    }
    if (color >= 0) {
      for (int r = 0; r < size_; ++r) {
        if (entry.calls[r]->first == color) result.members.push_back(r);
      }
      std::stable_sort(result.members.begin(), result.members.end(), [&](int a, int b) {
        return entry.calls[a]->second < entry.calls[b]->second;
      });
      result.index = static_cast<int>(
          std::find(result.members.begin(), result.members.end(), rank) - result.members.begin());
    }
  } else {
    entry.mode = SplitEntry::kGeneral;
    entry.calls[rank] = std::make_pair(color, key);
    ++entry.arrived;
    split_cv_.notify_all();
    const bool all = split_cv_.wait_until(lock, absl::ToChronoTime(deadline),
                                          [&] { return splits_[split].arrived == size_; });
    SplitEntry& ready = splits_[split];
    if (!all) {
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (!ready.calls[r].has_value()) missing.push_back(r);
      }
      return MarkPeerError(
          absl::DeadlineExceededError(
              absl::StrCat(where, ": timed out waiting for rank(s) ", absl::StrJoin(missing, ", "),
                           " (a sim split other than Dup is a rendezvous of the ranks' threads)")),
          absl::StrJoin(missing, ", "));
    }
    if (color >= 0) {
      for (int r = 0; r < size_; ++r) {
        if (ready.calls[r]->first == color) result.members.push_back(r);
      }
      std::stable_sort(result.members.begin(), result.members.end(), [&](int a, int b) {
        return ready.calls[a]->second < ready.calls[b]->second;
      });
      result.index = static_cast<int>(
          std::find(result.members.begin(), result.members.end(), rank) - result.members.begin());
    }
  }
  if (++splits_[split].left == present()) splits_.erase(split);
  return result;
}

std::shared_ptr<SimGroup> SimGroup::Child(const std::string& name,
                                          const std::vector<int>& members) {
  const int size = static_cast<int>(members.size());
  std::lock_guard<std::mutex> lock(mu_);
  ChildEntry& entry = children_[name];
  if (entry.group == nullptr) {
    SimOptions options = options_;
    options.name = name;
    options.split_call = nullptr;  // representative mode: a split of a split is not modelled
    if (options.topology != nullptr) {
      options.devices.clear();
      for (const int member : members) options.devices.push_back(options_.devices[member]);
    }
    int representative = -1;
    if (representative_ >= 0) {
      representative = static_cast<int>(std::find(members.begin(), members.end(), representative_) -
                                        members.begin());
    }
    entry.group = std::make_shared<SimGroup>(timeline_, size, options, arbiter_, representative);
  }
  std::shared_ptr<SimGroup> group = entry.group;
  if (++entry.joined == group->present()) children_.erase(name);
  return group;
}

}  // namespace shardline::sim_internal
