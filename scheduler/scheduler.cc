// File: scheduler/scheduler.cc
// -----------------------------------------------------------------------------
// The hooks drive three cursors: the forward cursor (prefetch along the recorded order), the
// backward gather cursor (over the reverse of this step's forward sequence) and the reduction
// cursor (over the order of each unit's last backward use). Every decision reads only the hook
// sequence and the host-side budget accounting (budget.h), so ranks that see the same hooks
// issue the same collectives at the same points.
//
// Elsewhere: creation, registration and the minimum budget in scheduler_setup.cc, the cross-rank
// order check in order_check.cc, ClipGradNorm in clip_grad.cc, StepMetrics in step_metrics.cc.

#include "scheduler/scheduler.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "scheduler/internal/scheduler_internal.h"

namespace shardline {

using scheduler_internal::UnitKey;

// --- Errors ---------------------------------------------------------------------------------

absl::StatusOr<Scheduler::Unit*> Scheduler::Lookup(int unit, absl::string_view hook) {
  if (unit < 0 || unit >= num_units()) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler '", options_.name, "': ", hook, "(",
                                                   unit, "): no such unit (", num_units(),
                                                   " registered)"));
  }
  if (!failed_.ok()) return failed_;
  return &units_[unit];
}

absl::Status Scheduler::HookError(absl::string_view hook, int unit, absl::Status status) {
  if (status.ok()) return status;
  status = Annotate(status, absl::StrCat("scheduler '", options_.name, "': ", hook, "('",
                                         units_[unit].name, "') in step ", step_));
  // A failed stream or collective leaves the step inconsistent across ranks: stop here. A peer's
  // disagreement is InvalidArgument too, but with the peer payload; a misuse of the hooks on
  // this rank (an unknown unit, a call out of order) issued nothing and poisons nothing.
  if (IsPeerError(status)) return Fail(WithOrderNote(std::move(status)));
  if (!absl::IsInvalidArgument(status) && !absl::IsFailedPrecondition(status)) {
    return Fail(std::move(status));
  }
  // Unless the step already failed where no hook saw it (the framework found a failed
  // collective on its compute stream, or in a unit's view) and this misuse follows from it:
  // then that failure, sticky, as if a hook had seen it.
  if (absl::Status failed = FailFromStreams(); !failed.ok()) return failed;
  return status;
}

absl::Status Scheduler::FailFromStreams() {
  for (Stream* stream :
       {&compute_, gather_stream_.get(), reduce_stream_.get(), all_reduce_stream_.get()}) {
    if (stream == nullptr) continue;
    if (absl::Status failed = stream->status(); !failed.ok()) {
      return Fail(IsPeerError(failed) ? WithOrderNote(std::move(failed)) : std::move(failed));
    }
  }
  return absl::OkStatus();
}

absl::Status Scheduler::Fail(absl::Status status) {
  failed_ = std::move(status);
  // The ranks' collectives no longer match: abort the scheduler's communicators, so that a peer
  // blocked in one (a reduction this rank will never issue) fails now, not at its deadline.
  for (Communicator* comm : {gather_comm_.get(), reduce_comm_.get(), replicate_comm_.get()}) {
    if (comm != nullptr) comm->Abort(failed_);
  }
  // A peer may wait in the order check, which this rank will now never join: abort the world
  // too, or the peer's next hook would wait out the deadline.
  if (OrderCheckUnread()) mesh_.world()->Abort(failed_);
  return failed_;
}

absl::Status Scheduler::StreamError(absl::string_view hook, int unit, absl::Status status) {
  if (status.ok()) return status;
  return Fail(WithOrderNote(Annotate(
      status, absl::StrCat("scheduler '", options_.name, "': ", hook, "('", units_[unit].name,
                           "') in step ", step_, ": stream '", compute_.name(), "' failed"))));
}

// --- Gathers --------------------------------------------------------------------------------

absl::Status Scheduler::IssueGather(int u, bool backward, bool demanded) {
  Unit& unit = units_[u];
  // A backward gather also brings the unsharded gradient, unless one is kept from earlier
  // micro-batches (outside the budget) or from an earlier backward use (charged already).
  const uint64_t grad =
      backward && !unit.param->has_unsharded_grad() ? unit.backward_bytes - unit.param_bytes : 0;
  if (!budget_.Fits(unit.param_bytes + grad, unit.charge.total() == 0)) {
    if (!demanded) return absl::OkStatus();
    budget_.CountOvershoot();
  }
  const bool timed = options_.time_communication;
  std::shared_ptr<Event> start;
  SL_ASSIGN_OR_RETURN(Work work,
                      unit.param->Gather(*gather_comm_, *gather_stream_,
                                         {.collective = {.tag = unit.name, .key = UnitKey(u)},
                                          .collective_start = timed ? &start : nullptr}));
  if (timed) unit.comm.emplace_back(std::move(start), work.event());
  unit.gathered = true;
  unit.backward_gather = backward;
  budget_.Charge(unit.charge, unit.param_bytes, grad);
  ++unit.metrics.gathers;
  if (!demanded) ++unit.metrics.prefetched;
  unit.metrics.bytes_gathered += unit.param_bytes;
  current_.bytes_gathered += unit.param_bytes;
  issue_log_.push_back({Issued::kGather, u});
  return absl::OkStatus();
}

absl::Status Scheduler::PrefetchForward() {
  if (!order_known_ || deviated_ || options_.forward_prefetch == 0) return absl::OkStatus();
  const size_t limit = step_sequence_.size() + options_.forward_prefetch;  // positions < limit
  while (forward_cursor_ < order_.size() && forward_cursor_ < limit) {
    Unit& unit = units_[order_[forward_cursor_]];
    if (!unit.gathered) {
      if (!budget_.Fits(unit.param_bytes, unit.charge.total() == 0)) {
        budget_.Defer(InflightBudget::Cursor::kForward, forward_cursor_);
        return absl::OkStatus();  // retried at the next hook, in order
      }
      SL_RETURN_IF_ERROR(IssueGather(order_[forward_cursor_], /*backward=*/false,
                                     /*demanded=*/false));
    }
    ++forward_cursor_;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::HandleBackwardPosition(size_t pos, bool demanded, bool* issued) {
  *issued = true;
  const int u = backward_sequence_[pos];
  Unit& unit = units_[u];
  if (!unit.gathered) {
    const uint64_t bytes =
        unit.param->has_unsharded_grad() ? unit.param_bytes : unit.backward_bytes;
    if (!demanded && !budget_.Fits(bytes, unit.charge.total() == 0)) {
      *issued = false;
      return absl::OkStatus();
    }
    SL_RETURN_IF_ERROR(IssueGather(u, /*backward=*/true, demanded));
    return PrepareGradAhead(unit);
  }
  if (!unit.backward_gather) {
    // Kept unsharded since forward: room for its gradient now.
    const uint64_t extra =
        unit.param->has_unsharded_grad() ? 0 : unit.backward_bytes - unit.param_bytes;
    if (!budget_.Fits(extra, false)) {
      if (!demanded) {
        *issued = false;
        return absl::OkStatus();
      }
      budget_.CountOvershoot();
    }
    budget_.Charge(unit.charge, 0, extra);
    unit.backward_gather = true;
    return PrepareGradAhead(unit);
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PrepareGradAhead(Unit& unit) {
  // The unsharded gradient is zero-filled on the grad stream while the gather is in flight, off
  // the compute stream; PreBackward makes the compute stream wait for the fill. With gradient
  // sync off the gradient of the earlier micro-batches is kept (PrepareGrad does nothing then).
  return unit.param->PrepareGrad(*grad_stream_);
}

absl::Status Scheduler::AdvanceBackwardCursor(size_t target, int prefetch_depth) {
  while (backward_cursor_ <= target && backward_cursor_ < backward_sequence_.size()) {
    bool issued = false;
    SL_RETURN_IF_ERROR(HandleBackwardPosition(backward_cursor_, /*demanded=*/true, &issued));
    ++backward_cursor_;
  }
  if (deviated_) return absl::OkStatus();
  const size_t limit = target + 1 + prefetch_depth;
  while (backward_cursor_ < backward_sequence_.size() && backward_cursor_ < limit) {
    bool issued = false;
    SL_RETURN_IF_ERROR(HandleBackwardPosition(backward_cursor_, /*demanded=*/false, &issued));
    if (!issued) {
      budget_.Defer(InflightBudget::Cursor::kBackward, backward_cursor_);
      return absl::OkStatus();
    }
    ++backward_cursor_;
  }
  return absl::OkStatus();
}

bool Scheduler::PrefetchedAgain(int u) const {
  // A later use of `u` that the cursor already passed (it found the unit gathered and issued
  // nothing for it): resharding now would leave that use without a gather.
  if (phase_ == Phase::kForward) {
    for (size_t q = step_sequence_.size(); q < forward_cursor_ && q < order_.size(); ++q) {
      if (order_[q] == u) return true;
    }
    return false;
  }
  for (size_t q = backward_pos_; q < backward_cursor_ && q < backward_sequence_.size(); ++q) {
    if (backward_sequence_[q] == u) return true;
  }
  return false;
}

absl::Status Scheduler::AcquireForCompute(int u) {
  Unit& unit = units_[u];
  // A gather that already completed holds the compute stream up for nothing: no wait to time
  // (two events fewer; the unit's exposed wait gains zero).
  if (!options_.time_communication || unit.param->GatherCompleted()) {
    return unit.param->Acquire(compute_);
  }
  // Fresh events (RecordEvent), not shared ones: the pair times the wait by completion times, and
  // a shared event recorded earlier on a drained stream reports that earlier time.
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> before, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(unit.param->Acquire(compute_));
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> after, RecordEvent(compute_));
  unit.waits.emplace_back(std::move(before), std::move(after));
  return absl::OkStatus();
}

absl::Status Scheduler::ReshardUnit(int u, std::shared_ptr<Event> last_use) {
  Unit& unit = units_[u];
  SL_RETURN_IF_ERROR(unit.param->Reshard(std::move(last_use)));
  unit.gathered = false;
  unit.backward_gather = false;
  // A gradient charged by this step's backward stays charged until its reduction; with gradient
  // sync off it is accumulated outside the budget from here on. A gradient kept from earlier
  // micro-batches was never charged.
  budget_.Discharge(unit.charge, /*params=*/true, /*grad=*/!sync_grads_);
  return absl::OkStatus();
}

void Scheduler::KeepAfterBackward(Unit& unit) {
  unit.backward_gather = false;
  budget_.Discharge(unit.charge, /*params=*/false, /*grad=*/true);
}

// --- Steps ----------------------------------------------------------------------------------

absl::Status Scheduler::BeginStep() {
  SL_RETURN_IF_ERROR(CheckOrderResult());
  if (step_ == 0 && order_known_) {
    for (int u : order_) {
      if (u < 0 || u >= num_units()) {
        return absl::InvalidArgumentError(absl::StrCat("scheduler '", options_.name,
                                                       "': forward_order names unit ", u, " but ",
                                                       num_units(), " units are registered"));
      }
    }
  }
  phase_ = Phase::kForward;
  current_ = StepMetrics{};
  current_.step = step_;
  current_.budget_bytes = options_.budget_bytes;
  current_.budget_units = options_.budget_units;
  for (Unit& unit : units_) {
    unit.forward_uses = 0;
    unit.backward_left = 0;
    unit.grad_ready = false;
    unit.reduced = false;
    unit.grad_ready_event = nullptr;
    unit.final_event = nullptr;
    // Without the name: LastStepMetrics fills it in, so steps copy no strings.
    unit.metrics = UnitStepMetrics{};
    unit.waits.clear();
    unit.comm.clear();
  }
  step_sequence_.clear();
  deviated_ = false;
  forward_cursor_ = 0;
  budget_.BeginStep();
  backward_sequence_.clear();
  backward_cursor_ = 0;
  backward_pos_ = 0;
  reduction_order_.clear();
  reduction_cursor_ = 0;
  gather_pool_->ResetPeak();
  if (reduce_pool_ != gather_pool_) reduce_pool_->ResetPeak();

  SL_ASSIGN_OR_RETURN(step_start_, RecordEvent(compute_));
  // The optimizer wrote the master shards and read the sharded gradients: the gathers and the
  // reductions of this step come after it.
  std::shared_ptr<Event> optimizer_done =
      post_optimizer_ != nullptr ? std::move(post_optimizer_) : step_start_;
  post_optimizer_ = nullptr;
  for (Stream* s : {gather_stream_.get(), reduce_stream_.get(), all_reduce_stream_.get()}) {
    SL_RETURN_IF_ERROR(WaitUnlessSameStream(*s, optimizer_done));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::BeginBackward() {
  phase_ = Phase::kBackward;
  const bool recording = !order_known_;
  if (recording) {
    order_ = step_sequence_;
    order_known_ = true;
    record_pending_check_ = true;
  } else if (!deviated_ && step_sequence_.size() != order_.size()) {
    SL_RETURN_IF_ERROR(FailFromStreams());
    deviated_ = true;
    deviation_step_ = step_;
    deviation_ = absl::StrCat("it ran ", step_sequence_.size(),
                              " forward uses where the order has ", order_.size());
    ++current_.order_deviations;
    SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': step " << step_ << " ran "
                        << step_sequence_.size() << " forward uses but the recorded "
                        << "order has " << order_.size() << "; backward prefetch is off for "
                        << "this step";
  }
  backward_sequence_.assign(step_sequence_.rbegin(), step_sequence_.rend());
  // Reductions follow each unit's last backward use: the reverse of its first forward use.
  std::vector<bool> seen(units_.size(), false);
  for (auto it = step_sequence_.begin(); it != step_sequence_.end(); ++it) {
    if (!seen[*it]) {
      seen[*it] = true;
      reduction_order_.push_back(*it);
    }
  }
  std::reverse(reduction_order_.begin(), reduction_order_.end());
  // A prefetched unit that the forward never used (the forward deviated) is not needed.
  for (int u = 0; u < num_units(); ++u) {
    if (units_[u].gathered && units_[u].forward_uses == 0 && units_[u].active == 0) {
      SL_RETURN_IF_ERROR(ReshardUnit(u, nullptr));
    }
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PreForward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PreForward"));
  if (phase_ == Phase::kBackward) {
    // Activation recomputation: the unit's forward re-runs inside the backward, served by the
    // gather of its coming backward use.
    size_t pos = backward_pos_;
    while (pos < backward_sequence_.size() && backward_sequence_[pos] != u) ++pos;
    if (pos == backward_sequence_.size()) {
      return HookError("PreForward", u,
                       absl::FailedPreconditionError(
                           "a recomputation in backward of a unit with no backward use left"));
    }
    SL_RETURN_IF_ERROR(HookError("PreForward", u, AdvanceBackwardCursor(pos, 0)));
    SL_RETURN_IF_ERROR(HookError("PreForward", u, AcquireForCompute(u)));
    ++unit->active;
    ++unit->recomputing;
    return absl::OkStatus();
  }
  if (phase_ == Phase::kForward && order_known_ && !deviated_ &&
      step_sequence_.size() == order_.size() && !order_.empty()) {
    // The known forward is complete: this is a recomputation inside the backward.
    SL_RETURN_IF_ERROR(HookError("PreForward", u, BeginBackward()));
    return PreForward(u);
  }
  if (phase_ == Phase::kIdle) SL_RETURN_IF_ERROR(HookError("PreForward", u, BeginStep()));
  const size_t pos = step_sequence_.size();
  if (order_known_ && !deviated_ && (pos >= order_.size() || order_[pos] != u)) {
    // A hook called after a failure no hook saw (the framework's next call once its compute
    // stream failed) is not this rank's deviation: the step failed before it.
    SL_RETURN_IF_ERROR(FailFromStreams());
    deviated_ = true;
    deviation_step_ = step_;
    deviation_ = absl::StrCat(
        "at position ", pos, " it ran '", unit->name, "' where the order has ",
        pos < order_.size() ? absl::StrCat("'", units_[order_[pos]].name, "'") : "its end");
    ++current_.order_deviations;
    SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': step " << step_
                        << " deviates from the recorded forward order at position " << pos
                        << ": expected "
                        << (pos < order_.size() ? "'" + units_[order_[pos]].name + "'"
                                                : std::string("the end of the forward"))
                        << ", got '" << unit->name
                        << "'; gathering on demand for the rest of this step";
  }
  step_sequence_.push_back(u);
  ++unit->forward_uses;
  ++unit->backward_left;
  if (!unit->gathered) {
    SL_RETURN_IF_ERROR(HookError("PreForward", u, IssueGather(u, false, /*demanded=*/true)));
  }
  if (order_known_ && !deviated_) forward_cursor_ = std::max(forward_cursor_, pos + 1);
  // Prefetch before the compute waits: on a caller stream the wait blocks this thread.
  SL_RETURN_IF_ERROR(HookError("PreForward", u, PrefetchForward()));
  SL_RETURN_IF_ERROR(HookError("PreForward", u, AcquireForCompute(u)));
  ++unit->active;
  return absl::OkStatus();
}

absl::Status Scheduler::PostForward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PostForward"));
  if (unit->active == 0) {
    return HookError("PostForward", u,
                     absl::FailedPreconditionError("PostForward without a matching PreForward"));
  }
  if (phase_ == Phase::kBackward) {
    // The end of a recomputation: the backward use comes next and keeps the parameters.
    --unit->active;
    --unit->recomputing;
    return absl::OkStatus();
  }
  // The compute stream acquired the unit in PreForward: the reshard records its last use there
  // (FlatParameter records on every acquiring stream), so no event of its own is needed here.
  SL_RETURN_IF_ERROR(StreamError("PostForward", u, compute_.status()));
  --unit->active;
  if (unit->active == 0 && unit->reshard_after_forward && !PrefetchedAgain(u)) {
    SL_RETURN_IF_ERROR(HookError("PostForward", u, ReshardUnit(u, nullptr)));
  }
  return HookError("PostForward", u, PrefetchForward());
}

absl::Status Scheduler::EndForward() {
  HookTimer timer(this);
  if (!failed_.ok()) return failed_;
  if (phase_ != Phase::kForward) {
    return absl::FailedPreconditionError(absl::StrCat(
        "scheduler '", options_.name, "': EndForward() outside a forward (step ", step_, ")"));
  }
  return BeginBackward();
}

absl::Status Scheduler::PreBackward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PreBackward"));
  if (phase_ == Phase::kIdle) {
    return HookError(
        "PreBackward", u,
        absl::FailedPreconditionError("PreBackward before any PreForward in the step"));
  }
  if (phase_ == Phase::kForward) SL_RETURN_IF_ERROR(HookError("PreBackward", u, BeginBackward()));
  size_t pos = backward_pos_;
  while (pos < backward_sequence_.size() && backward_sequence_[pos] != u) ++pos;
  if (pos == backward_sequence_.size()) {
    return HookError("PreBackward", u,
                     absl::FailedPreconditionError(
                         absl::StrCat("the unit has no backward use left in this step (",
                                      unit->forward_uses, " forward uses, all matched)")));
  }
  backward_pos_ = pos + 1;
  const int depth = options_.backward_prefetch == BackwardPrefetch::kBeforeGrad
                        ? options_.backward_prefetch_depth
                        : 0;
  SL_RETURN_IF_ERROR(HookError("PreBackward", u, AdvanceBackwardCursor(pos, depth)));
  if (!unit->gathered) {
    // Resharded after an earlier backward use although the cursor had passed this one.
    SL_RETURN_IF_ERROR(HookError("PreBackward", u, IssueGather(u, true, /*demanded=*/true)));
  }
  if (unit->recomputing == 0 || unit->active == 0) {
    SL_RETURN_IF_ERROR(HookError("PreBackward", u, AcquireForCompute(u)));
  }
  SL_RETURN_IF_ERROR(HookError("PreBackward", u, unit->param->PrepareGrad(compute_)));
  ++unit->active;
  return absl::OkStatus();
}

absl::Status Scheduler::PostBackward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PostBackward"));
  if (phase_ != Phase::kBackward || unit->active == 0 || unit->backward_left == 0) {
    return HookError("PostBackward", u,
                     absl::FailedPreconditionError("PostBackward without a matching PreBackward"));
  }
  // Shared with the reduction's and the reshard's records of the same compute stream point.
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> ready, RecordSharedEvent(compute_));
  --unit->active;
  --unit->backward_left;
  if (options_.backward_prefetch == BackwardPrefetch::kAfterGrad && backward_pos_ > 0) {
    SL_RETURN_IF_ERROR(
        HookError("PostBackward", u,
                  AdvanceBackwardCursor(backward_pos_ - 1, options_.backward_prefetch_depth)));
  }
  if (unit->backward_left > 0 || unit->active > 0) {
    // More backward uses to come (a unit used twice in forward): the gradient stays; the
    // parameters follow the reshard policy.
    if (unit->active == 0 && unit->reshard_after_forward && !PrefetchedAgain(u)) {
      SL_RETURN_IF_ERROR(HookError("PostBackward", u, ReshardUnit(u, std::move(ready))));
    }
    return absl::OkStatus();
  }
  if (!sync_grads_) {
    // No reduction this micro-batch: the unsharded gradient accumulates.
    if (!unit->reshard_after_backward) {
      KeepAfterBackward(*unit);
      return absl::OkStatus();
    }
    return HookError("PostBackward", u, ReshardUnit(u, std::move(ready)));
  }
  unit->grad_ready = true;
  unit->grad_ready_event = std::move(ready);
  return HookError("PostBackward", u, IssueReadyReductions());
}

absl::Status Scheduler::IssueReadyReductions() {
  while (reduction_cursor_ < reduction_order_.size()) {
    const int w = reduction_order_[reduction_cursor_];
    if (!units_[w].grad_ready) break;
    SL_RETURN_IF_ERROR(IssueReduction(w));
    ++reduction_cursor_;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::IssueReduction(int u) {
  Unit& unit = units_[u];
  const MixedPrecisionPolicy& mp = unit.param->policy();
  // The flight recorder tags every collective of the unit with its name.
  const ReduceGradOptions ro{.op = unit.reduce_op,
                             .collective = {.tag = unit.name, .key = UnitKey(u)}};
  const bool timed = options_.time_communication;
  std::shared_ptr<Event> start;
  ReduceGradOptions rs = ro;
  rs.collective_start = timed ? &start : nullptr;
  SL_ASSIGN_OR_RETURN(
      std::shared_ptr<Event> scattered,
      unit.param->ReduceScatter(*reduce_comm_, *reduce_stream_, unit.grad_ready_event, rs));
  issue_log_.push_back({Issued::kReduceScatter, u});
  if (timed) unit.comm.emplace_back(std::move(start), scattered);
  const uint64_t reduced_bytes = unit.param->layout().total_elements() * DTypeSize(mp.reduce_dtype);
  unit.metrics.bytes_reduced += reduced_bytes;
  current_.bytes_reduced += reduced_bytes;
  ++unit.metrics.reductions;
  unit.gathered = false;
  unit.backward_gather = false;
  unit.grad_ready = false;
  unit.reduced = true;

  Stream* accumulate = reduce_stream_.get();
  const bool hybrid = replicate_comm_ != nullptr;
  bool all_reduce_accumulated = false;
  if (hybrid && !all_reduce_) {
    unit.all_reduce_deferred = true;
  } else if (hybrid && unit.all_reduce_deferred) {
    all_reduce_accumulated = true;  // after the accumulation, over the whole sharded gradient
  } else if (hybrid) {
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> reduced,
                        unit.param->AllReduce(replicate_comm_.get(), *all_reduce_stream_, ro));
    issue_log_.push_back({Issued::kAllReduce, u});
    if (timed) unit.comm.emplace_back(scattered, reduced);
    accumulate = all_reduce_stream_.get();
  }
  SL_ASSIGN_OR_RETURN(unit.final_event, unit.param->Accumulate(*accumulate));
  if (all_reduce_accumulated) {
    SL_RETURN_IF_ERROR(unit.param->WaitReduced(*all_reduce_stream_));
    SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
    ReduceOptions ar{};
    ar.op = unit.reduce_op;
    ar.tag = unit.name;
    ar.key = UnitKey(u);
    std::shared_ptr<Event> before;
    if (timed) {
      SL_ASSIGN_OR_RETURN(before, RecordEvent(*all_reduce_stream_));
    }
    SL_ASSIGN_OR_RETURN(Work work, replicate_comm_->AllReduce(grad.data, grad.data, grad.elements,
                                                              grad.dtype, *all_reduce_stream_, ar));
    issue_log_.push_back({Issued::kAllReduceAccumulated, u});
    if (timed) unit.comm.emplace_back(std::move(before), work.event());
    unit.final_event = work.event();
    unit.all_reduce_deferred = false;
  }
  // The buffers went back to their pools, stream-ordered after the reduction's events.
  budget_.Discharge(unit.charge, /*params=*/true, /*grad=*/true);
  return absl::OkStatus();
}

absl::Status Scheduler::FinishBackward() {
  HookTimer timer(this);
  // Formatted only for an error.
  auto hook = [this] {
    return absl::StrCat("scheduler '", options_.name, "': FinishBackward() in step ", step_);
  };
  if (!failed_.ok()) return failed_;
  if (phase_ == Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(hook(), ": no forward in this step"));
  }
  if (phase_ == Phase::kForward) {
    if (absl::Status status = BeginBackward(); !status.ok()) return Annotate(status, hook());
  }
  for (const Unit& unit : units_) {
    if (unit.active > 0) {
      return absl::FailedPreconditionError(absl::StrCat(hook(), ": unit '", unit.name,
                                                        "' is still in use (", unit.active,
                                                        " Pre hooks without their Post)"));
    }
  }
  auto fail = [&](absl::Status status) { return Fail(WithOrderNote(Annotate(status, hook()))); };
  // Every remaining backward gather, in order: a unit whose backward did not run here may have
  // run on another rank, which gathered it at this position.
  if (!backward_sequence_.empty()) {
    absl::Status status = AdvanceBackwardCursor(backward_sequence_.size() - 1, 0);
    if (!status.ok()) return fail(status);
  }
  if (sync_grads_) {
    for (size_t i = reduction_cursor_; i < reduction_order_.size(); ++i) {
      const int w = reduction_order_[i];
      Unit& unit = units_[w];
      if (unit.grad_ready || unit.reduced) continue;
      // Its backward did not (fully) run: it takes part with the gradient it has (zero if none).
      SL_LOG(INFO, SCHED) << "scheduler '" << options_.name << "': unit '" << unit.name << "' had "
                          << unit.backward_left << " backward use(s) left in step " << step_
                          << "; reducing the gradient it has (zero-filled if none)";
      absl::Status status = AcquireForCompute(w);
      if (status.ok()) status = unit.param->PrepareGrad(compute_);
      if (!status.ok()) return fail(status);
      absl::StatusOr<std::shared_ptr<Event>> ready = RecordSharedEvent(compute_);
      if (!ready.ok()) return fail(ready.status());
      unit.backward_left = 0;
      unit.grad_ready = true;
      unit.grad_ready_event = *std::move(ready);
    }
    if (absl::Status status = IssueReadyReductions(); !status.ok()) return fail(status);
  }
  // Whatever is still unsharded (kept units without a reduction, skipped units without sync),
  // except the units kept after their backward (SetReshardAfterBackward).
  for (int w = 0; w < num_units(); ++w) {
    Unit& unit = units_[w];
    if (unit.gathered && !sync_grads_ && !unit.reshard_after_backward && unit.forward_uses > 0 &&
        unit.backward_left == 0) {
      if (unit.backward_gather) KeepAfterBackward(unit);
      continue;
    }
    if (unit.gathered) {
      if (absl::Status status = ReshardUnit(w, nullptr); !status.ok()) return fail(status);
    }
  }
  // The optimizer (on the compute stream) reads the sharded gradients after this.
  for (Unit& unit : units_) {
    if (unit.param->state() == FlatParameterState::kReducing) {
      if (absl::Status status = unit.param->WaitReduced(compute_); !status.ok())
        return fail(status);
    }
    if (unit.final_event != nullptr && unit.final_event->recorded_stream_id() != compute_.id()) {
      if (absl::Status status = WaitUnlessSameStream(compute_, unit.final_event); !status.ok()) {
        return fail(status);
      }
    }
  }
  // Fresh: its completion time is the step's end (a shared event may report an earlier one).
  absl::StatusOr<std::shared_ptr<Event>> end = RecordEvent(compute_);
  if (!end.ok()) return fail(end.status());
  // The step's raw metrics: read once their events completed (LastStepMetrics).
  RecordFinishedStep(*std::move(end));
  if (record_pending_check_) {
    // The recorded order may show units used twice, whose gradients live through the backward.
    if ((options_.budget_bytes > 0 && MinimumBudgetBytes() > options_.budget_bytes) ||
        (options_.budget_units > 0 && MinimumBudgetUnits() > options_.budget_units)) {
      SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': with the recorded order the "
                          << "units need a budget of " << MinimumBudgetBytes() << " bytes and "
                          << MinimumBudgetUnits() << " units (set: " << options_.budget_bytes
                          << " bytes, " << options_.budget_units
                          << " units); gathers the compute needs will overshoot it";
    }
    record_pending_check_ = false;
    if (absl::Status status = StartOrderCheck(); !status.ok()) return fail(status);
  }
  phase_ = Phase::kIdle;
  ++step_;
  EndStepHookTime(timer);
  return absl::OkStatus();
}

// --- Between steps --------------------------------------------------------------------------

void Scheduler::SetPostOptimizerEvent(std::shared_ptr<Event> event) {
  post_optimizer_ = std::move(event);
}

void Scheduler::SetRequiresGradientSync(bool sync) { sync_grads_ = sync; }

void Scheduler::SetRequiresAllReduce(bool all_reduce) { all_reduce_ = all_reduce; }

absl::Status Scheduler::ZeroGrad() {
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat("scheduler '", options_.name, "': ZeroGrad() during a step"));
  }
  for (Unit& unit : units_) SL_RETURN_IF_ERROR(unit.param->ZeroShardGrad(compute_));
  return absl::OkStatus();
}

}  // namespace shardline
