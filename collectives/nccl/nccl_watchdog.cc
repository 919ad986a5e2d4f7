// The nccl backend's watchdog: one thread per communicator that, while collectives are in
// flight, polls NCCL's asynchronous error state and each collective's deadline, and aborts the
// communicator on the first failure (ncclCommAbort then ends the kernels, so streams move on).

#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "collectives/nccl/internal/nccl_check.h"
#include "collectives/nccl/internal/nccl_communicator_impl.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline::nccl_internal {

absl::Status NcclCommunicator::TakeEvents(cudaEvent_t* start, cudaEvent_t* done) {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (free_events_.size() >= 2) {
      *done = free_events_.back();
      free_events_.pop_back();
      *start = free_events_.back();
      free_events_.pop_back();
      return absl::OkStatus();
    }
  }
  // The caller made the communicator's device current.
  *start = nullptr;
  *done = nullptr;
  SL_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(start, cudaEventDisableTiming));
  const absl::Status created =
      SL_CUDA_STATUS(cudaEventCreateWithFlags(done, cudaEventDisableTiming));
  if (!created.ok()) {
    (void)cudaEventDestroy(*start);
    *start = nullptr;
  }
  return created;
}

void NcclCommunicator::ReturnEvents(cudaEvent_t start, cudaEvent_t done) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  free_events_.push_back(start);
  free_events_.push_back(done);
}

void NcclCommunicator::Track(const Op& op, cudaEvent_t start, cudaEvent_t done) {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    in_flight_.push_back(InFlight{op, start, done, std::nullopt});
  }
  watch_cv_.notify_all();
}

void NcclCommunicator::StopWatchdog() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void NcclCommunicator::WatchdogLoop() {
  (void)cudaSetDevice(cuda_device_);
  const auto interval = absl::ToChronoMilliseconds(settings_.watchdog_interval);
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!stop_) {
    if (in_flight_.empty()) {
      watch_cv_.wait(lock, [&] { return stop_ || !in_flight_.empty(); });
      continue;
    }
    lock.unlock();
    bool ended_after_abort = false;
    const absl::Status failure = Sweep(&ended_after_abort);
    if (!failure.ok() && status().ok()) {
      SL_LOG(WARN, COLL) << "nccl watchdog aborts communicator " << name() << " (rank " << rank()
                         << " of " << size() << "): " << failure;
      Abort(failure);
    }
    // Abort() dumped the collectives then in flight as running; ncclCommAbort has ended some
    // since: the dump on disk shows them failed.
    if (ended_after_abort) DumpAfterAbort();
    lock.lock();
    watch_cv_.wait_for(lock, interval, [&] { return stop_; });
  }
}

absl::Status NcclCommunicator::Sweep(bool* ended_after_abort) {
  const bool healthy = status().ok();
  absl::Status failure;
  if (healthy) {
    // Launch holds the lock while it polls NCCL itself; skip this round then.
    std::unique_lock<std::mutex> lock(nccl_mu_, std::try_to_lock);
    if (lock.owns_lock() && comm_ != nullptr) {
      ncclResult_t state = ncclSuccess;
      failure = SL_NCCL_STATUS(ncclCommGetAsyncError(comm_, &state), comm_);
      if (failure.ok() && state != ncclSuccess && state != ncclInProgress) {
        failure = AsyncError(state, absl::StrCat("communicator ", name(), " (nccl)"));
      }
    }
  }
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(watch_mu_);
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    InFlight& f = *it;
    if (!f.deadline.has_value()) {
      const cudaError_t started = cudaEventQuery(f.start);
      if (started == cudaSuccess) {
        f.deadline = now + f.op.timeout;
        RecordStarted(f.op);  // as the watchdog sees it: up to one interval late
      } else if (started != cudaErrorNotReady && failure.ok()) {
        failure = Annotate(SL_CUDA_STATUS(started), Describe(f.op));
      }
    }
    const cudaError_t done = cudaEventQuery(f.done);
    if (done == cudaSuccess) {
      if (!f.deadline.has_value()) RecordStarted(f.op);
      // Once aborted, ncclCommAbort may have cut it short: it counts as failed then.
      RecordEnded(f.op, healthy ? absl::OkStatus() : status());
      if (!healthy) *ended_after_abort = true;
      free_events_.push_back(f.start);
      free_events_.push_back(f.done);
      it = in_flight_.erase(it);
      continue;
    }
    if (done != cudaErrorNotReady) {
      // The device context is broken: this collective will never report; stop watching it.
      if (failure.ok()) failure = Annotate(SL_CUDA_STATUS(done), Describe(f.op));
      RecordEnded(f.op, Annotate(SL_CUDA_STATUS(done), Describe(f.op)));
      if (!healthy) *ended_after_abort = true;
      (void)cudaEventDestroy(f.start);
      (void)cudaEventDestroy(f.done);
      it = in_flight_.erase(it);
      continue;
    }
    if (failure.ok() && f.deadline.has_value() && now >= *f.deadline) {
      failure = absl::DeadlineExceededError(absl::StrCat(
          DeadlineError(f.op, {}).message(), " (NCCL cannot tell which rank(s) did not arrive)"));
      // Before the abort that follows dumps it: it failed (ncclCommAbort ends its kernel).
      if (healthy) RecordEnded(f.op, failure);
    }
    ++it;
  }
  // Once aborted, the sweep only retires the collectives that ncclCommAbort ended.
  return healthy ? failure : absl::OkStatus();
}

}  // namespace shardline::nccl_internal
