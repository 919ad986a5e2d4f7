// File: scheduler/order_check.cc
// -----------------------------------------------------------------------------
// The checks that ranks run the same units in the same order. Every collective carries its unit
// in its fingerprint (scheduler_internal::UnitKey): ranks whose forwards differ fail the first
// collective that differs, and WithOrderNote adds to that peer error whether this rank kept to
// the known order. At the end of the first step one all-gather on the world communicator
// compares the recorded orders and the units' layouts across ranks (StartOrderCheck); the next
// hook reads the result (CheckOrderResult).

#include "scheduler/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"

namespace shardline {
namespace {

constexpr int kOrderHeader = 3;  // length, hash of the order, hash of the units' layouts

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

}  // namespace

absl::Status Scheduler::WithOrderNote(absl::Status status) const {
  // Ranks that issue the same collective for different units (the unit is in every collective's
  // fingerprint) ran different forwards: say whether this rank kept to the known order.
  // On an asynchronous compute stream the error may surface only in the next step's hooks.
  if (!order_known_ || !IsPeerError(status)) return status;
  if (deviation_step_ >= 0 && deviation_step_ + 1 >= step_) {
    return Annotate(status, absl::StrCat("this rank deviated from the known forward order in step ",
                                         deviation_step_, ": ", deviation_));
  }
  return Annotate(status, step_ == 0 ? std::string("this rank's forward follows the known order")
                                     : absl::StrCat("this rank's forward followed the known "
                                                    "order in steps ",
                                                    step_ - 1, " and ", step_));
}

absl::Status Scheduler::StartOrderCheck() {
  // A fixed-size record per rank, so one all-gather suffices and it never blocks the host here:
  // [length, hash of the order, hash of the layouts, the first `capacity` entries (-1 padded)].
  // A device world's all-gather takes device memory: the records go through order_device_ and
  // come back to pinned memory on the control stream.
  const Communicator& world = *mesh_.world();
  const bool staged = !world.device().is_host();
  const std::string what =
      absl::StrCat("scheduler '", options_.name, "': the cross-rank order check");
  order_capacity_ = 2 * static_cast<size_t>(num_units()) + 8;
  const size_t record = kOrderHeader + order_capacity_;
  const size_t total = record * (world.size() + 1);
  int64_t* mine = nullptr;
  if (staged) {
    SL_RETURN_IF_ERROR(EnsureStaging(what));
    const size_t bytes = total * sizeof(int64_t);
    if (order_pinned_.size() < bytes) {
      order_pinned_ = Buffer();
      order_device_ = Buffer();
      SL_ASSIGN_OR_RETURN(order_pinned_, staging_pinned_->Allocate(bytes));
      SL_ASSIGN_OR_RETURN(order_device_, staging_device_->Allocate(bytes));
    }
    mine = static_cast<int64_t*>(order_pinned_.data());
    std::fill(mine, mine + total, int64_t{-1});
  } else {
    order_check_.assign(total, -1);
    mine = order_check_.data();
  }
  uint64_t order_hash = 0;
  for (int u : order_) order_hash = Mix(order_hash, static_cast<uint64_t>(u));
  uint64_t layout_hash = 0;
  for (const Unit& unit : units_)
    layout_hash = Mix(layout_hash, unit.param->layout().Fingerprint());
  mine[0] = static_cast<int64_t>(order_.size());
  mine[1] = static_cast<int64_t>(order_hash);
  mine[2] = static_cast<int64_t>(layout_hash);
  for (size_t i = 0; i < std::min(order_.size(), order_capacity_); ++i)
    mine[kOrderHeader + i] = order_[i];
  int64_t* gathered = mine;
  if (staged) {
    gathered = static_cast<int64_t*>(order_device_.data());
    SL_RETURN_IF_ERROR(
        Annotate(EnqueueCopy(*control_stream_, gathered, mine, record * sizeof(int64_t)), what));
  }
  absl::StatusOr<Work> work =
      mesh_.world()->AllGather(gathered, gathered + record, record, DType::kI64, *control_stream_);
  if (!work.ok()) return work.status();
  order_check_work_ = *std::move(work);
  order_check_copied_ = nullptr;
  order_check_pending_ = true;
  if (staged) {
    SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(*control_stream_, mine + record, gathered + record,
                                            world.size() * record * sizeof(int64_t)),
                                what));
    SL_ASSIGN_OR_RETURN(order_check_copied_, RecordEvent(*control_stream_));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::CheckOrderResult() {
  if (!order_check_pending_) return absl::OkStatus();
  order_check_pending_ = false;
  const std::string what = absl::StrCat("scheduler '", options_.name,
                                        "': the forward orders recorded in the first step");
  const absl::Time deadline = control_stream_->clock().Now() + mesh_.world()->timeout();
  absl::Status status = order_check_work_.Wait(deadline);
  if (status.ok() && order_check_copied_ != nullptr) {
    status = order_check_copied_->Synchronize(deadline);
  }
  if (!status.ok()) {
    failed_ = Annotate(status, absl::StrCat(what, ": comparing across ranks"));
    return failed_;
  }
  const size_t record = kOrderHeader + order_capacity_;
  const int n = mesh_.world()->size();
  const int64_t* all =
      (order_check_copied_ != nullptr ? static_cast<const int64_t*>(order_pinned_.data())
                                      : order_check_.data()) +
      record;
  auto name = [&](int64_t u) -> std::string {
    if (u < 0) return "(the end of the forward)";
    if (u >= num_units()) return absl::StrCat("unit #", u);
    return absl::StrCat("'", units_[u].name, "'");
  };
  for (int r = 1; r < n; ++r) {
    const int64_t* a = all;
    const int64_t* b = all + r * record;
    if (a[2] != b[2]) {
      failed_ = absl::FailedPreconditionError(
          absl::StrCat(what, ": rank 0 and rank ", r,
                       " registered different units (names, shapes or dtypes "
                       "differ); every rank must register the same units in the same order"));
      return failed_;
    }
    if (a[0] == b[0] && a[1] == b[1]) continue;
    const size_t shown = std::min<size_t>(std::max(a[0], b[0]), order_capacity_);
    size_t pos = 0;
    while (pos < shown && a[kOrderHeader + pos] == b[kOrderHeader + pos]) ++pos;
    const std::string where =
        pos < shown ? absl::StrCat("at position ", pos, " rank 0 ran ", name(a[kOrderHeader + pos]),
                                   " but rank ", r, " ran ", name(b[kOrderHeader + pos]))
                    : absl::StrCat("beyond position ", shown, " (rank 0 ran ", a[0],
                                   " forward uses, rank ", r, " ran ", b[0], ")");
    failed_ = absl::FailedPreconditionError(
        absl::StrCat(what, " differ across ranks: ", where,
                     "; every rank must run the same units in the same order"));
    return failed_;
  }
  return absl::OkStatus();
}

}  // namespace shardline
