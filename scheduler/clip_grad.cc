// File: scheduler/clip_grad.cc
// -----------------------------------------------------------------------------
// ClipGradNorm: the global L2 norm of the sharded gradients, from each rank's partial sum of
// squares (padding skipped) all-reduced over the shard group, then the scale. On host streams
// and with CPU offload the squares are summed on the host; on a CUDA compute stream by kernels
// on it, with only the norm copied back.

#include "scheduler/scheduler.h"

#include <cmath>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/host_kernels.h"
#include "runtime/shard_norms.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"

namespace shardline {

absl::StatusOr<double> Scheduler::ClipGradNorm(double max_norm, absl::Time deadline) {
  const std::string what = absl::StrCat("scheduler '", options_.name, "': ClipGradNorm()");
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": during a step"));
  }
  if (!(max_norm > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": max_norm ", max_norm, " is not > 0"));
  }
  if (!compute_.device().is_host()) return ClipGradNormOnDevice(max_norm, deadline, what);
  // Each shard group holds every parameter once; its replicas hold copies: sum over the shard
  // group only.
  SL_ASSIGN_OR_RETURN(clip_scratch_, HostShardSquares(deadline, what));
  ReduceOptions sum{};
  sum.op = ReduceOp::kSum;
  SL_ASSIGN_OR_RETURN(Work work, reduce_comm_->AllReduce(&clip_scratch_, &clip_scratch_, 1,
                                                         DType::kF64, *reduce_stream_, sum));
  SL_RETURN_IF_ERROR(Annotate(work.Wait(deadline), what));
  const double norm = std::sqrt(clip_scratch_);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      SL_RETURN_IF_ERROR(Annotate(Scale(grad.data, grad.elements, grad.dtype, coef), what));
    }
  }
  return norm;
}

absl::StatusOr<double> Scheduler::HostShardSquares(absl::Time deadline, const std::string& what) {
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> reduced, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(Annotate(reduced->Synchronize(deadline), what));
  double partial = 0;
  for (const Unit& unit : units_) {
    if (!unit.param->has_shard_grad()) continue;
    SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
    SL_ASSIGN_OR_RETURN(double squares,
                        ShardSquaredNorm(unit.param->layout(), grad.shard, grad.data, grad.dtype));
    partial += squares;
  }
  return partial;
}

absl::StatusOr<double> Scheduler::ClipGradNormOnDevice(double max_norm, absl::Time deadline,
                                                       const std::string& what) {
  SL_RETURN_IF_ERROR(EnsureStaging(what));
  if (clip_device_.data() == nullptr) {
    SL_ASSIGN_OR_RETURN(clip_device_,
                        staging_device_->Allocate(kSumSquaresDoubles * sizeof(double)));
    SL_ASSIGN_OR_RETURN(clip_pinned_, staging_pinned_->Allocate(sizeof(double)));
  }
  auto* sums = static_cast<double*>(clip_device_.data());
  auto* result = static_cast<double*>(clip_pinned_.data());
  const bool offloaded = offload_allocator_ != nullptr;
  if (!offloaded) {
    // The squares, summed by kernels on the compute stream after the backward's last write
    // (FinishBackward made the compute stream wait for the reductions). Padding is skipped.
    SL_RETURN_IF_ERROR(Annotate(EnqueueFill(compute_, sums, sizeof(double)), what));
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      const size_t esize = DTypeSize(grad.dtype);
      for (const ShardSlice& slice : unit.param->layout().ShardSlices(grad.shard)) {
        SL_RETURN_IF_ERROR(Annotate(
            EnqueueSumSquares(compute_,
                              static_cast<const char*>(grad.data) + slice.shard_offset * esize,
                              slice.length, grad.dtype, sums),
            absl::StrCat(what, ": unit '", unit.name, "'")));
      }
    }
  } else {
    // CPU offload: the sharded gradients are in host memory, summed here once the compute stream
    // is done; the partial sum crosses to the device for the all-reduce.
    SL_ASSIGN_OR_RETURN(*result, HostShardSquares(deadline, what));
    SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(compute_, sums, result, sizeof(double)), what));
  }
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> summed, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(Annotate(reduce_stream_->WaitEvent(*summed), what));
  ReduceOptions sum{};
  sum.op = ReduceOp::kSum;
  SL_ASSIGN_OR_RETURN(Work work,
                      reduce_comm_->AllReduce(sums, sums, 1, DType::kF64, *reduce_stream_, sum));
  SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(*reduce_stream_, result, sums, sizeof(double)), what));
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> copied, RecordEvent(*reduce_stream_));
  SL_RETURN_IF_ERROR(Annotate(work.Wait(deadline), what));
  SL_RETURN_IF_ERROR(Annotate(copied->Synchronize(deadline), what));
  const double norm = std::sqrt(*result);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      SL_RETURN_IF_ERROR(
          Annotate(offloaded ? Scale(grad.data, grad.elements, grad.dtype, coef)
                             : EnqueueScale(compute_, grad.data, grad.elements, grad.dtype, coef),
                   what));
    }
  }
  return norm;
}

}  // namespace shardline
