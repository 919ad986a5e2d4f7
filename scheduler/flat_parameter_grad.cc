// File: scheduler/flat_parameter_grad.cc
// -----------------------------------------------------------------------------
// FlatParameter's gradient half (FSDP2 keeps it apart too, in _fsdp_collectives.py): the
// unsharded gradient (PrepareGrad, GradView), its reduction in three steps on the reduce streams
// (ReduceScatter, the hybrid AllReduce, Accumulate into the sharded gradient; ReduceGrad chains
// them), and the sharded gradient between steps (WaitReduced, ShardGrad, ZeroShardGrad,
// ReleaseShardGrad).

#include "scheduler/flat_parameter.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"
#include "scheduler/internal/flat_parameter_internal.h"

namespace shardline {

using flat_parameter_internal::CallContext;
using flat_parameter_internal::ElementAt;

absl::Status FlatParameter::PrepareGrad(Stream& compute) {
  constexpr absl::string_view kCall = "PrepareGrad()";
  if (state_ != FlatParameterState::kUnsharded && state_ != FlatParameterState::kGathering) {
    return WrongState(kCall, "gathering, unsharded");
  }
  if (unsharded_grad_live_) {
    if (std::find(grad_consumers_.begin(), grad_consumers_.end(), &compute) ==
        grad_consumers_.end()) {
      SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, compute));
      SL_RETURN_IF_ERROR(
          Annotate(WaitUnlessSameStream(compute, grad_zeroed_), CallContext(name_, kCall)));
      grad_consumers_.push_back(&compute);
    }
    return absl::OkStatus();
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, compute));
  const CallContext context(name_, kCall);
  const size_t bytes = layout_.total_elements() * DTypeSize(policy_.param_dtype);
  absl::StatusOr<Buffer> grad =
      stream_ordered_grad_ ? grad_pool_->Allocate(bytes, compute) : grad_pool_->Allocate(bytes);
  if (!grad.ok()) return Annotate(grad.status(), context);
  SL_RETURN_IF_ERROR(Annotate(EnqueueFill(compute, grad->data(), bytes), context));
  // If no event can be recorded the stream is poisoned: the zero-fill will not run. Shared: the
  // reduction's record on this stream (RecordOnConsumers) reuses it if nothing followed the fill.
  absl::StatusOr<std::shared_ptr<Event>> zeroed = RecordSharedEvent(compute);
  if (!zeroed.ok()) return Annotate(zeroed.status(), context);
  grad_zeroed_ = *std::move(zeroed);
  unsharded_grad_ = *std::move(grad);
  unsharded_grad_live_ = true;
  grad_consumers_ = {&compute};
  return absl::OkStatus();
}

absl::StatusOr<TensorView> FlatParameter::GradView(int tensor) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("GradView()", "unsharded");
  if (!unsharded_grad_live_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "flat parameter '", name_, "': GradView() before PrepareGrad(): no unsharded gradient"));
  }
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("GradView()", tensor));
  return MakeView(unsharded_grad_, t);
}

absl::StatusOr<TensorView> FlatParameter::GradView(absl::string_view tensor_name) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("GradView()", "unsharded");
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("GradView()", tensor_name));
  return GradView(t);
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::ReduceScatter(
    Communicator& shard_comm, Stream& stream, std::shared_ptr<Event> grad_ready,
    const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "ReduceScatter()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  const CallContext context(name_, kCall);
  if (!unsharded_grad_live_) {
    return absl::FailedPreconditionError(
        absl::StrCat(context.str(),
                     ": no unsharded gradient (call PrepareGrad() and write the gradient first)"));
  }
  if (options.op != ReduceOp::kSum && options.op != ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        absl::StrCat(context.str(), ": op ", ReduceOpName(options.op), " is not sum or avg"));
  }
  SL_RETURN_IF_ERROR(CheckShardComm(kCall, shard_comm));
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));

  const DType param = policy_.param_dtype;
  const DType reduce = policy_.reduce_dtype;
  const size_t count = layout_.shard_elements();
  const size_t total = layout_.total_elements();
  Buffer reduce_input;  // the gradient in reduce_dtype, when that is not param_dtype
  if (reduce != param) {
    absl::StatusOr<Buffer> buffer = grad_pool_->Allocate(total * DTypeSize(reduce), stream);
    if (!buffer.ok()) {
      return Annotate(buffer.status(), absl::StrCat(context.str(), ": gradient in reduce dtype"));
    }
    reduce_input = *std::move(buffer);
  }
  // The reduction reads the gradient after the backward, the zero-fill and every stream that
  // prepared it. Waits read no buffer: on failure the new buffer goes back unguarded.
  EventList grad_users = RecordOnConsumers(grad_consumers_);
  const size_t fresh = grad_users.size();
  for (const std::shared_ptr<Event>* event : {&grad_ready, &grad_zeroed_}) {
    // An event last recorded on a consumer stream is covered by the record just made there.
    const uint64_t on = *event != nullptr ? (*event)->recorded_stream_id() : 0;
    if (on != 0 && std::any_of(grad_users.begin(), grad_users.begin() + fresh,
                               [on](const auto& e) { return e->recorded_stream_id() == on; })) {
      continue;
    }
    grad_users.push_back(*event);
  }
  // Where the sharded gradient holds nothing to add to (zeroed since its last reduction), is in
  // the reduce dtype and on this device, the reduce-scatter writes the reduced shard straight
  // into it (out of place) after its last users, and Accumulate() has nothing left to copy.
  // Otherwise the reduced shard lands in its own slice of the input (in place).
  const bool into_shard_grad = !offload_ && shard_grad_live_ && !shard_grad_written_ &&
                               policy_.sharded_grad_dtype() == reduce;
  if (into_shard_grad) {
    grad_users.push_back(reduce_done_);
    grad_users.push_back(shard_grad_last_use_);
  }
  for (const std::shared_ptr<Event>& event : grad_users) {
    SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, event), context));
  }

  void* grad = unsharded_grad_.data();
  void* input = reduce != param ? reduce_input.data() : grad;
  void* slice = into_shard_grad
                    ? shard_grad_.data()
                    : ElementAt(input, layout_.ShardBegin(shard_rank_), DTypeSize(reduce));
  ReduceOptions collective;
  static_cast<CollectiveOptions&>(collective) = options.collective;
  collective.op = options.op;
  absl::Status status = EnqueueCast(stream, grad, param, input, reduce, total);
  const bool cast_enqueued = status.ok() && reduce != param;
  if (status.ok() && options.collective_start != nullptr) {
    absl::StatusOr<std::shared_ptr<Event>> start = RecordEvent(stream);
    *options.collective_start = start.ok() ? *std::move(start) : nullptr;
  }
  std::shared_ptr<Event> scattered;
  if (status.ok()) {
    absl::StatusOr<Work> work =
        shard_comm.ReduceScatter(input, slice, count, reduce, stream, collective);
    status = work.status();
    if (work.ok()) scattered = work->event();
  }
  if (!status.ok() && !cast_enqueued) return Annotate(status, context);

  // From here on, work that uses the buffers may be queued.
  reduce_input_ = std::move(reduce_input);
  reduced_slice_ = slice;
  reduce_options_ = options;
  grad_ready_ = grad_ready;
  // The backward that produced the gradient was the parameters' last reader.
  ReleaseUnsharded(grad_ready);
  grad_consumers_.clear();
  state_ = FlatParameterState::kReducing;
  reduce_phase_ = ReducePhase::kScattered;
  // The collective's own event marks this point of `stream` (nothing was enqueued on it since:
  // the records above are on other streams and enqueue no work); a new one only without it.
  absl::StatusOr<std::shared_ptr<Event>> done =
      scattered != nullptr ? absl::StatusOr<std::shared_ptr<Event>>(std::move(scattered))
                           : RecordEvent(stream);
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  return reduce_step_;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::AllReduce(Communicator* replicate_comm,
                                                                Stream& stream,
                                                                const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "AllReduce()";
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kScattered) {
    return absl::FailedPreconditionError(
        absl::StrCat("flat parameter '", name_, "': ", kCall,
                     " is allowed only after ReduceScatter() and before Accumulate()"));
  }
  if (replicate_comm == nullptr || replicate_comm->size() == 1) {
    reduce_phase_ = ReducePhase::kAllReduced;
    return reduce_step_;
  }
  const CallContext context(name_, kCall);
  if (replicate_comm->device() != pool_->device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context.str(), ": replicate communicator '", replicate_comm->name(),
                     "' moves memory on ", replicate_comm->device().ToString(),
                     " but the unit's buffers are on ", pool_->device().ToString()));
  }
  if (options.op != reduce_options_.op) {
    return absl::InvalidArgumentError(absl::StrCat(context.str(), ": op ", ReduceOpName(options.op),
                                                   " differs from the reduce-scatter's ",
                                                   ReduceOpName(reduce_options_.op)));
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, reduce_step_), context));
  ReduceOptions collective;
  static_cast<CollectiveOptions&>(collective) = options.collective;
  // kAvg again: the average of the replicas' shard averages is the global average, because
  // every shard group has the same size.
  collective.op = options.op;
  const size_t count = layout_.shard_elements();
  absl::Status status = replicate_comm
                            ->AllReduce(reduced_slice_, reduced_slice_, count, policy_.reduce_dtype,
                                        stream, collective)
                            .status();
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(stream);
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  reduce_phase_ = ReducePhase::kAllReduced;
  return reduce_step_;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::Accumulate(Stream& stream) {
  constexpr absl::string_view kCall = "Accumulate()";
  if (state_ != FlatParameterState::kReducing || reduce_phase_ == ReducePhase::kAccumulated) {
    return absl::FailedPreconditionError(absl::StrCat("flat parameter '", name_, "': ", kCall,
                                                      " is allowed only after ReduceScatter()"));
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  const CallContext context(name_, kCall);
  const DType reduce = policy_.reduce_dtype;
  const DType grad_dtype = policy_.sharded_grad_dtype();
  if (shard_grad_live_ && reduced_slice_ == shard_grad_.data()) {
    // The reduce-scatter (and the all-reduce, in place) already wrote the sharded gradient.
    shard_grad_written_ = true;
    reduce_done_ = reduce_step_;
    reduce_phase_ = ReducePhase::kAccumulated;
    ReleaseReductionInputs();
    return reduce_done_;
  }
  const size_t count = layout_.shard_elements();
  const bool fresh = !shard_grad_live_;
  const bool accumulate = !fresh && shard_grad_written_;

  // Everything is allocated before anything is enqueued, so that running out of memory leaves
  // the reduction where it was (it can be retried).
  Buffer new_shard_grad;   // the sharded gradient, on the first reduction
  Buffer shard_grad_temp;  // the reduced shard in the sharded gradient's dtype, to add
  if (fresh) {
    absl::StatusOr<Buffer> buffer = shard_allocator_->Allocate(count * DTypeSize(grad_dtype));
    if (!buffer.ok())
      return Annotate(buffer.status(), absl::StrCat(context.str(), ": sharded gradient"));
    new_shard_grad = *std::move(buffer);
  }
  // CPU offload: the reduced shard comes back to host memory, where the sharded gradient is.
  Buffer host_slice;
  if (offload_) {
    absl::StatusOr<Buffer> buffer = shard_allocator_->Allocate(count * DTypeSize(reduce));
    if (!buffer.ok()) {
      return Annotate(buffer.status(),
                      absl::StrCat(context.str(), ": reduced shard in host memory"));
    }
    host_slice = *std::move(buffer);
  }
  if (accumulate && grad_dtype != reduce) {
    absl::StatusOr<Buffer> buffer =
        offload_ ? shard_allocator_->Allocate(count * DTypeSize(grad_dtype))
                 : grad_pool_->Allocate(count * DTypeSize(grad_dtype), stream);
    if (!buffer.ok()) {
      return Annotate(
          buffer.status(),
          absl::StrCat(context.str(), ": reduced shard in the sharded gradient's dtype"));
    }
    shard_grad_temp = *std::move(buffer);
  }
  // The sharded gradient is written after the previous reduction and zero-fill.
  for (const std::shared_ptr<Event>* event :
       {&reduce_step_, &reduce_done_, &shard_grad_last_use_}) {
    SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, *event), context));
  }
  void* shard_grad = fresh ? new_shard_grad.data() : shard_grad_.data();
  const void* slice = reduced_slice_;
  absl::Status status = [&]() -> absl::Status {
    if (offload_) {
      SL_RETURN_IF_ERROR(EnqueueCopy(stream, host_slice.data(), slice, host_slice.size()));
      slice = host_slice.data();
    }
    if (!accumulate) return EnqueueCast(stream, slice, reduce, shard_grad, grad_dtype, count);
    if (grad_dtype == reduce) return EnqueueReduce(stream, shard_grad, slice, count, grad_dtype);
    SL_RETURN_IF_ERROR(
        EnqueueCast(stream, slice, reduce, shard_grad_temp.data(), grad_dtype, count));
    return EnqueueReduce(stream, shard_grad, shard_grad_temp.data(), count, grad_dtype);
  }();
  // Work that writes the new buffers may be queued even on error (a cast before a failed add).
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(stream);
  if (done.ok()) shard_grad_temp.ReleaseAfter(*done);
  if (done.ok()) host_slice.ReleaseAfter(*done);
  if (fresh) {
    if (done.ok()) new_shard_grad.ReleaseAfter(*done);
    shard_grad_ = std::move(new_shard_grad);
    shard_grad_live_ = true;
  }
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  shard_grad_written_ = true;
  reduce_done_ = reduce_step_;
  reduce_phase_ = ReducePhase::kAccumulated;
  // The gradient and the reduce-dtype copy were read by the steps before this one.
  ReleaseReductionInputs();
  return reduce_done_;
}

void FlatParameter::ReleaseReductionInputs() {
  // Work that uses the buffers may be queued: each goes back after the events that cover it. If
  // no event could be recorded, the stream is poisoned and runs nothing more.
  for (Buffer* buffer : {&unsharded_grad_, &reduce_input_}) {
    buffer->ReleaseAfter(reduce_step_);
    buffer->ReleaseAfter(grad_ready_);
    buffer->ReleaseAfter(grad_zeroed_);
    buffer->Reset();
  }
  unsharded_grad_live_ = false;
  grad_zeroed_ = nullptr;
  grad_ready_ = nullptr;
  reduced_slice_ = nullptr;
}

absl::Status FlatParameter::AbortReduction(absl::Status error) {
  ReleaseReductionInputs();
  // The sharded gradient may have been half written: its contents are undefined now.
  reduce_done_ = reduce_step_;
  reduce_phase_ = ReducePhase::kAccumulated;
  state_ = FlatParameterState::kSharded;
  return error;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::ReduceGrad(Communicator& shard_comm,
                                                                 Communicator* replicate_comm,
                                                                 Stream& reduce_stream,
                                                                 std::shared_ptr<Event> grad_ready,
                                                                 const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "ReduceGrad()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  if (replicate_comm != nullptr && replicate_comm->device() != pool_->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat parameter '", name_, "': ", kCall, ": replicate communicator '",
        replicate_comm->name(), "' moves memory on ", replicate_comm->device().ToString(),
        " but the unit's buffers are on ", pool_->device().ToString()));
  }
  SL_RETURN_IF_ERROR(
      ReduceScatter(shard_comm, reduce_stream, std::move(grad_ready), options).status());
  if (absl::Status status = AllReduce(replicate_comm, reduce_stream, options).status();
      !status.ok()) {
    // Argument errors leave the reduction pending; end it, so the unit is usable again.
    if (state_ == FlatParameterState::kReducing) return AbortReduction(status);
    return status;
  }
  absl::StatusOr<std::shared_ptr<Event>> done = Accumulate(reduce_stream);
  if (!done.ok() && state_ == FlatParameterState::kReducing) return AbortReduction(done.status());
  return done;
}

absl::Status FlatParameter::WaitReduced(Stream& stream) {
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kAccumulated) {
    return WrongState("WaitReduced()", "reducing, after Accumulate()");
  }
  absl::Status status =
      reduce_done_ != nullptr ? stream.WaitEvent(*reduce_done_) : absl::OkStatus();
  state_ = FlatParameterState::kSharded;
  return Annotate(status, CallContext(name_, "WaitReduced()"));
}

absl::Status FlatParameter::WaitReduced(absl::Time deadline) {
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kAccumulated) {
    return WrongState("WaitReduced()", "reducing, after Accumulate()");
  }
  absl::Status status =
      reduce_done_ != nullptr ? reduce_done_->Synchronize(deadline) : absl::OkStatus();
  if (!status.ok()) {
    // Still running (as opposed to failed, possibly with a deadline of its own): stay reducing.
    absl::StatusOr<bool> done = reduce_done_->Query();
    if (done.ok() && !*done) {
      return Annotate(status, CallContext(name_, "WaitReduced()"));
    }
  }
  state_ = FlatParameterState::kSharded;
  return Annotate(status, CallContext(name_, "WaitReduced()"));
}

absl::StatusOr<FlatShardView> FlatParameter::ShardGrad() const {
  if (state_ == FlatParameterState::kReducing) {
    return WrongState("ShardGrad()", "sharded, gathering, unsharded");
  }
  if (!shard_grad_live_) {
    return absl::FailedPreconditionError(
        absl::StrCat("flat parameter '", name_,
                     "': ShardGrad(): no sharded gradient (no reduction since creation or "
                     "ReleaseShardGrad())"));
  }
  return FlatShardView{shard_grad_.data(), layout_.shard_elements(), policy_.sharded_grad_dtype(),
                       shard_rank_};
}

absl::Status FlatParameter::ZeroShardGrad(Stream& stream) {
  constexpr absl::string_view kCall = "ZeroShardGrad()";
  if (state_ == FlatParameterState::kReducing) {
    return WrongState(kCall, "sharded, gathering, unsharded");
  }
  if (!shard_grad_live_) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  const CallContext context(name_, kCall);
  for (const std::shared_ptr<Event>* event : {&reduce_done_, &shard_grad_last_use_}) {
    if (*event != nullptr) SL_RETURN_IF_ERROR(Annotate(stream.WaitEvent(**event), context));
  }
  SL_RETURN_IF_ERROR(
      Annotate(EnqueueFill(stream, shard_grad_.data(), shard_grad_.size()), context));
  // If no event can be recorded the stream is poisoned: the zero-fill will not run.
  absl::StatusOr<std::shared_ptr<Event>> zeroed = RecordEvent(stream);
  if (!zeroed.ok()) return Annotate(zeroed.status(), context);
  shard_grad_last_use_ = *std::move(zeroed);
  // Zero plus the next reduction is the next reduction: it may write instead of add.
  shard_grad_written_ = false;
  return absl::OkStatus();
}

absl::Status FlatParameter::ReleaseShardGrad(std::shared_ptr<Event> last_use) {
  if (state_ == FlatParameterState::kReducing) {
    return WrongState("ReleaseShardGrad()", "sharded, gathering, unsharded");
  }
  shard_grad_.ReleaseAfter(std::move(last_use));
  shard_grad_.ReleaseAfter(reduce_done_);
  shard_grad_.ReleaseAfter(shard_grad_last_use_);
  shard_grad_.Reset();
  shard_grad_live_ = false;
  shard_grad_written_ = false;
  shard_grad_last_use_ = nullptr;
  return absl::OkStatus();
}

}  // namespace shardline
