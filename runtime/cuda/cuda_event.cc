// CUDA events (see runtime/cuda/cuda_stream.h for the semantics beyond stream.h): cudaEvent_t
// handles, what one Record() captures, and WrapCudaEvent.

#ifdef SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_stream.h"
#include "runtime/cuda/cuda_util.h"
#include "runtime/cuda/internal/cuda_stream_internal.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/status.h"

namespace shardline {
namespace cuda_internal {

absl::Status SourceFailure(const CudaCapture& capture) {
  if (capture.source == nullptr) return absl::OkStatus();
  return capture.source->FailureUpTo(capture.source_seq);
}

namespace {

std::string DescribeCapture(const CudaCapture& capture) {
  if (capture.source == nullptr) return "a wrapped CUDA event";
  return absl::StrCat("a CUDA event recorded on stream '", capture.source->name(), "'");
}

// "Done" only once the device has reached the event: a host function that failed earlier on the
// stream poisons it, but kernels enqueued before the record keep running until then, and memory
// guarded by this event must not be reused under them. So a failure is reported only once
// cudaEventQuery says the device got there.
absl::StatusOr<bool> QueryCapture(const CudaCapture& capture) {
  if (capture.handle == nullptr) return true;
  const cudaError_t error = cudaEventQuery(capture.handle->event);
  if (error == cudaErrorNotReady) return false;
  if (error != cudaSuccess) return Annotate(SL_CUDA_STATUS(error), DescribeCapture(capture));
  // The event completed, so every step before it has run and published its failure.
  SL_RETURN_IF_ERROR(SourceFailure(capture));
  return true;
}

absl::Status PollCapture(const CudaCapture& capture, absl::Time deadline,
                         absl::string_view waiter) {
  PollBackoff backoff;
  while (true) {
    SL_ASSIGN_OR_RETURN(bool done, QueryCapture(capture));
    if (done) return absl::OkStatus();
    if (WallClock().Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(waiter, ": timed out waiting for ", DescribeCapture(capture)));
    }
    backoff.Pause();
  }
}

absl::StatusOr<std::shared_ptr<CudaEventHandle>> CreateEventHandle(int device) {
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(guard.Set(device));
  auto handle = std::make_shared<CudaEventHandle>();
  SL_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&handle->event, cudaEventDisableTiming));
  return handle;
}

// OnComplete of a CUDA event: a host function on a per-device side stream that waits for the
// event, so the callback runs when the device reaches it (CUDA calls are not allowed in a host
// function; the event is known complete there, so only the source's host failures remain).
struct CompletionTask {
  CudaCapture capture;
  EventCallback callback;
};

void CUDART_CB RunCompletionTask(void* arg) {
  std::unique_ptr<CompletionTask> task(static_cast<CompletionTask*>(arg));
  std::move(task->callback)(SourceFailure(task->capture));
}

// The side stream of `device` for completion callbacks, created on first use and kept for the
// process's lifetime.
absl::StatusOr<cudaStream_t> CallbackStream(int device) {
  static std::mutex mu;
  static std::vector<cudaStream_t>* streams = new std::vector<cudaStream_t>();
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= streams->size()) streams->resize(device + 1, nullptr);
  cudaStream_t& stream = (*streams)[device];
  if (stream == nullptr) {
    CudaDeviceGuard guard;
    SL_RETURN_IF_ERROR(guard.Set(device));
    SL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  return stream;
}

class CudaEvent final : public Event, public stream_internal::HostWaitable {
 public:
  explicit CudaEvent(int device) : device_(device) {}
  // A framework's event (WrapCudaEvent): queried as the framework last recorded it until a
  // Record() here, which records that same cudaEvent_t.
  CudaEvent(int device, cudaEvent_t wrapped) : device_(device) {
    capture_.handle = std::make_shared<CudaEventHandle>(wrapped, /*own=*/false);
  }

  Device device() const override { return Device::Cuda(device_); }
  absl::Status Record(Stream& stream) override;
  absl::StatusOr<bool> Query() override { return QueryCapture(Snapshot()); }
  absl::Status Synchronize(absl::Time deadline) override {
    return PollCapture(Snapshot(), deadline, "Event::Synchronize");
  }

  void OnComplete(EventCallback callback) override {
    CudaCapture capture = Snapshot();
    absl::StatusOr<bool> done = QueryCapture(capture);
    if (!done.ok() || *done) return std::move(callback)(done.status());
    auto task = std::make_unique<CompletionTask>(CompletionTask{capture, std::move(callback)});
    absl::Status launched = [&]() -> absl::Status {
      SL_ASSIGN_OR_RETURN(cudaStream_t side, CallbackStream(device_));
      SL_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, capture.handle->event, 0));
      SL_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(side, &RunCompletionTask, task.get()));
      task.release();
      return absl::OkStatus();
    }();
    // Without a side stream the callback can only be told that it will never be called back.
    if (!launched.ok()) {
      std::move(task->callback)(Annotate(launched, "Event::OnComplete of a CUDA event"));
    }
  }

  uint64_t recorded_stream_id() const override { return Snapshot().stream_id; }

  std::string recorded_stream_name() const override {
    CudaCapture capture = Snapshot();
    return capture.source == nullptr ? std::string() : capture.source->name();
  }

  absl::StatusOr<Waiter> SnapshotForHostWait() override {
    return Waiter([capture = Snapshot()](absl::Time deadline) {
      return PollCapture(capture, deadline, "host wait");
    });
  }

  CudaCapture Snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return capture_;
  }

 private:
  const int device_;
  mutable std::mutex mu_;
  CudaCapture capture_ ABSL_GUARDED_BY(mu_);
};

absl::Status CudaEvent::Record(Stream& stream) {
  CudaStream* cuda = AsCudaStreamOf(stream, device_);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA event of ", device().ToString(), " cannot be recorded on stream '", stream.name(),
        "' (", stream.device().ToString(), "); create the event with that stream's CreateEvent()"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<CudaEventHandle> handle = capture_.handle;
  // A pending host wait holds the old handle: give this record a new one, so that the wait keeps
  // waiting for what it captured. A wrapped event always records its own cudaEvent_t (the
  // framework waits on that one), with CUDA's rule: host waits see the latest record.
  if (handle == nullptr || (handle->owned && handle.use_count() > 2)) {
    SL_ASSIGN_OR_RETURN(handle, CreateEventHandle(device_));
  }
  SL_ASSIGN_OR_RETURN(capture_, RecordCudaEvent(*cuda, std::move(handle)));
  return stream.status();
}

}  // namespace

std::shared_ptr<Event> CreateCudaEvent(int device) { return std::make_shared<CudaEvent>(device); }

std::optional<CudaCapture> SnapshotCudaEvent(Event& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
  if (cuda_event == nullptr) return std::nullopt;
  return cuda_event->Snapshot();
}

}  // namespace cuda_internal

absl::StatusOr<std::shared_ptr<Event>> WrapCudaEvent(cudaEvent_t event, int device) {
  if (event == nullptr) {
    return absl::InvalidArgumentError("WrapCudaEvent: the cudaEvent_t is null");
  }
  SL_RETURN_IF_ERROR(cuda_internal::CheckDeviceExists(device, "cannot wrap a CUDA event"));
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(guard.Set(device));
  const cudaError_t error = cudaEventQuery(event);
  if (error != cudaSuccess && error != cudaErrorNotReady) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("WrapCudaEvent: not a usable event of cuda:",
                                                   device, ": ", SL_CUDA_STATUS(error).message()));
  }
  return std::make_shared<cuda_internal::CudaEvent>(device, event);
}

}  // namespace shardline

#endif  // SHARDLINE_WITH_CUDA
