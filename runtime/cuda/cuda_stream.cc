// CUDA streams and events (see runtime/cuda/cuda_stream.h for the semantics beyond stream.h).

#ifdef SHARDLINE_WITH_CUDA

#include "runtime/cuda/cuda_stream.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/config.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_util.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {
namespace {

using stream_internal::HostCapture;
using stream_internal::StreamTracer;

// The failure state of one CUDA stream, shared with its host functions in flight and with the
// events recorded on it. Host functions are numbered 1, 2, ... in stream order; only they can
// fail, so an event recorded after host function n failed iff the stream failed at some m <= n.
// It also carries the stream's tracer, which the host functions use.
class CudaStreamState {
 public:
  CudaStreamState(std::string name, StreamTracer tracer)
      : name_(std::move(name)), tracer_(tracer) {}

  const std::string& name() const { return name_; }
  const StreamTracer& tracer() const { return tracer_; }

  absl::Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

  void Poison(absl::Status status, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    status_ = std::move(status);
    failed_at_ = seq;
  }

  // The stream's failure if it happened at or before host function `seq`, else OK.
  absl::Status FailureUpTo(uint64_t seq) const {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_at_ <= seq ? status_ : absl::OkStatus();
  }

 private:
  const std::string name_;
  const StreamTracer tracer_;
  mutable std::mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  uint64_t failed_at_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<uint64_t>::max();
};

struct CudaEventHandle {
  CudaEventHandle() = default;
  CudaEventHandle(const CudaEventHandle&) = delete;
  CudaEventHandle& operator=(const CudaEventHandle&) = delete;
  ~CudaEventHandle() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  cudaEvent_t event = nullptr;
};

// One Record() of a CUDA event: what to query, and where a failure would come from.
struct CudaCapture {
  std::shared_ptr<CudaEventHandle> handle;  // nullptr: never recorded
  std::shared_ptr<CudaStreamState> source;
  uint64_t source_seq = 0;  // host functions enqueued on the source stream before the record
  uint64_t stream_id = 0;   // Stream::id() of the source stream
};

// "Done" only once the device has reached the event: a host function that failed earlier on the
// stream poisons it, but kernels enqueued before the record keep running until then, and memory
// guarded by this event must not be reused under them. So a failure is reported only once
// cudaEventQuery says the device got there.
absl::StatusOr<bool> QueryCapture(const CudaCapture& capture) {
  if (capture.handle == nullptr) return true;
  const cudaError_t error = cudaEventQuery(capture.handle->event);
  if (error == cudaErrorNotReady) return false;
  if (error != cudaSuccess) {
    return Annotate(SL_CUDA_STATUS(error),
                    absl::StrCat("event recorded on stream '", capture.source->name(), "'"));
  }
  // The event completed, so every host function before it has run and published its failure.
  SL_RETURN_IF_ERROR(capture.source->FailureUpTo(capture.source_seq));
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
          absl::StrCat(waiter, ": timed out waiting for a CUDA event recorded on stream '",
                       capture.source->name(), "'"));
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

// A host function in flight on a stream (cudaLaunchHostFunc's user data). Owned by the host
// function once launched.
struct HostTask {
  enum Kind : uint8_t { kWork, kRecordHost, kWaitHost, kCheckEvent };
  Kind kind = kWork;
  std::shared_ptr<CudaStreamState> state;
  uint64_t seq = 0;
  StreamOp op;                              // kWork
  std::shared_ptr<HostCapture> capture;     // kRecordHost, kWaitHost
  absl::Duration wait_timeout;              // kWaitHost
  std::shared_ptr<CudaStreamState> source;  // kCheckEvent: the waited-for event's stream
  uint64_t source_seq = 0;
};

void CUDART_CB RunHostTask(void* arg) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(arg));
  CudaStreamState& state = *task->state;
  const absl::Status poison = state.status();
  absl::Status result;
  switch (task->kind) {
    case HostTask::kWork:
      if (poison.ok()) {
        result = state.tracer().RunOp(task->op, WallClock());
        if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", state.name(), "'"));
      } else if (task->op.cancel != nullptr) {
        std::move(task->op.cancel)(poison);
      }
      break;
    case HostTask::kRecordHost:
      task->capture->Complete(poison);
      break;
    case HostTask::kWaitHost:
      if (poison.ok()) {
        result = state.tracer().RunWait(task->capture->stream_name(), WallClock(), [&] {
          return task->capture->Wait(task->capture->clock().Now() + task->wait_timeout,
                                     absl::StrCat("stream '", state.name(), "' (wait_timeout ",
                                                  absl::FormatDuration(task->wait_timeout), ")"));
        });
      }
      break;
    case HostTask::kCheckEvent:
      if (poison.ok()) result = task->source->FailureUpTo(task->source_seq);
      break;
  }
  if (!result.ok()) state.Poison(std::move(result), task->seq);
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
  std::move(task->callback)(task->capture.source->FailureUpTo(task->capture.source_seq));
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

class CudaStream;

class CudaEvent final : public Event, public stream_internal::HostWaitable {
 public:
  explicit CudaEvent(int device) : device_(device) {}

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

class CudaStream final : public Stream, public stream_internal::HostCaptureRecorder {
 public:
  CudaStream(int device, std::string name, absl::Duration wait_timeout, cudaStream_t stream,
             StreamTracer tracer)
      : device_(device),
        name_(name),
        wait_timeout_(wait_timeout),
        stream_(stream),
        state_(std::make_shared<CudaStreamState>(std::move(name), tracer)) {}

  ~CudaStream() override {
    absl::Status drained = Drain(DefaultDeadline());
    if (!drained.ok()) {
      SL_LOG(WARN, STREAM) << "destroying CUDA stream '" << name_
                           << "' with work pending: " << drained;
    }
    (void)cudaStreamDestroy(stream_);
  }

  Device device() const override { return Device::Cuda(device_); }
  const std::string& name() const override { return name_; }
  int device_index() const { return device_; }

  absl::Status Submit(StreamOp op) override {
    auto task = std::make_unique<HostTask>();
    task->kind = HostTask::kWork;
    task->op = std::move(op);
    std::lock_guard<std::mutex> lock(enqueue_mu_);
    return LaunchLocked(std::move(task));
  }

  absl::Status WaitEvent(Event& event) override {
    if (auto* cuda_event = dynamic_cast<CudaEvent*>(&event)) {
      CudaCapture capture = cuda_event->Snapshot();
      if (capture.handle == nullptr) return status();
      std::lock_guard<std::mutex> lock(enqueue_mu_);
      SL_RETURN_IF_ERROR(state_->status());
      SL_RETURN_IF_ERROR(
          Annotate(SL_CUDA_STATUS(cudaStreamWaitEvent(stream_, capture.handle->event, 0)),
                   absl::StrCat("stream '", name_, "'")));
      // A failure of this stream itself already poisons it; one of another stream that ran host
      // work before the record has to be carried over.
      if (capture.source_seq == 0 || capture.source == state_) return absl::OkStatus();
      auto task = std::make_unique<HostTask>();
      task->kind = HostTask::kCheckEvent;
      task->source = std::move(capture.source);
      task->source_seq = capture.source_seq;
      return LaunchLocked(std::move(task));
    }
    if (auto* host_event = dynamic_cast<stream_internal::HostEvent*>(&event)) {
      std::shared_ptr<HostCapture> capture = host_event->current();
      absl::Status captured;
      if (capture == nullptr || (capture->done(&captured) && captured.ok())) return status();
      auto task = std::make_unique<HostTask>();
      task->kind = HostTask::kWaitHost;
      task->capture = std::move(capture);
      task->wait_timeout = wait_timeout_;
      std::lock_guard<std::mutex> lock(enqueue_mu_);
      return LaunchLocked(std::move(task));
    }
    return absl::InvalidArgumentError(absl::StrCat("CUDA stream '", name_,
                                                   "' cannot wait for an event of device ",
                                                   event.device().ToString()));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    SL_RETURN_IF_ERROR(Drain(deadline));
    return status();
  }

  absl::Status status() const override { return state_->status(); }

  std::shared_ptr<Event> CreateEvent() override { return std::make_shared<CudaEvent>(device_); }

  void* native_handle() const override { return stream_; }

  absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) override {
    auto task = std::make_unique<HostTask>();
    task->kind = HostTask::kRecordHost;
    task->capture = std::move(capture);
    std::lock_guard<std::mutex> lock(enqueue_mu_);
    return LaunchLocked(std::move(task));
  }

  // Records `handle` on this stream: the capture that CudaEvent keeps.
  absl::StatusOr<CudaCapture> RecordCudaEvent(std::shared_ptr<CudaEventHandle> handle) {
    std::lock_guard<std::mutex> lock(enqueue_mu_);
    SL_RETURN_IF_ERROR(Annotate(SL_CUDA_STATUS(cudaEventRecord(handle->event, stream_)),
                                absl::StrCat("stream '", name_, "'")));
    return CudaCapture{std::move(handle), state_, host_funcs_, id()};
  }

 private:
  // Launches `task` as the next host function, unless the stream is poisoned. A host capture that
  // cannot be launched completes with the error, so that nobody waits for it.
  absl::Status LaunchLocked(std::unique_ptr<HostTask> task)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(enqueue_mu_) {
    absl::Status status = state_->status();
    if (status.ok()) {
      task->state = state_;
      task->seq = ++host_funcs_;
      status = SL_CUDA_STATUS(cudaLaunchHostFunc(stream_, &RunHostTask, task.get()));
      if (status.ok()) {
        task.release();
        return absl::OkStatus();
      }
      // The stream's order is broken from here on: poison it.
      status = Annotate(status, absl::StrCat("stream '", name_, "'"));
      state_->Poison(status, task->seq);
    }
    if (task->kind == HostTask::kRecordHost) task->capture->Complete(status);
    return status;
  }

  // Polls until the stream's work has run: OK, a CUDA error, or DeadlineExceeded.
  absl::Status Drain(absl::Time deadline) {
    PollBackoff backoff;
    while (true) {
      const cudaError_t error = cudaStreamQuery(stream_);
      if (error == cudaSuccess) return absl::OkStatus();
      if (error != cudaErrorNotReady) {
        return Annotate(SL_CUDA_STATUS(error), absl::StrCat("stream '", name_, "'"));
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("stream '", name_, "': Synchronize timed out waiting for its CUDA work"));
      }
      backoff.Pause();
    }
  }

  const int device_;
  const std::string name_;
  const absl::Duration wait_timeout_;
  const cudaStream_t stream_;
  const std::shared_ptr<CudaStreamState> state_;
  // Keeps host-function numbering in stream order when several threads enqueue.
  std::mutex enqueue_mu_;
  uint64_t host_funcs_ ABSL_GUARDED_BY(enqueue_mu_) = 0;
};

// StreamOptions::priority on the current device's scale: CUDA's numerically lower values are more
// urgent, `least` is its default, and `greatest` its most urgent.
absl::StatusOr<int> CudaPriority(const StreamOptions& options) {
  int least = 0;
  int greatest = 0;
  SL_RETURN_IF_ERROR(
      Annotate(SL_CUDA_STATUS(cudaDeviceGetStreamPriorityRange(&least, &greatest)),
               absl::StrCat("stream '", options.name, "': reading the stream priority range")));
  if (options.priority <= 0) return least;
  // least - priority without overflow: the range spans a handful of levels.
  if (options.priority >= least - greatest) return greatest;
  return least - options.priority;
}

absl::Status CudaEvent::Record(Stream& stream) {
  auto* cuda = dynamic_cast<CudaStream*>(&stream);
  if (cuda == nullptr || cuda->device_index() != device_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA event of ", device().ToString(), " cannot be recorded on stream '", stream.name(),
        "' (", stream.device().ToString(), "); create the event with that stream's CreateEvent()"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<CudaEventHandle> handle = capture_.handle;
  // A pending host wait holds the old handle: give this record a new one, so that the wait keeps
  // waiting for what it captured.
  if (handle == nullptr || handle.use_count() > 2) {
    SL_ASSIGN_OR_RETURN(handle, CreateEventHandle(device_));
  }
  SL_ASSIGN_OR_RETURN(capture_, cuda->RecordCudaEvent(std::move(handle)));
  return cuda->status();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stream>> CreateCudaStream(int device, StreamOptions options) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the error behind for unrelated callers
    return absl::UnavailableError(absl::StrCat("cannot create CUDA stream '", options.name,
                                               "' on cuda:", device, ": ",
                                               SL_CUDA_STATUS(error).message()));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrCat("cannot create CUDA stream '", options.name,
                                               "': cuda:", device, " does not exist (", count,
                                               " CUDA device(s) visible)"));
  }
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, stream_internal::ResolveWaitTimeout(options));
  if (options.clock != nullptr && options.clock != &WallClock()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create CUDA stream '", options.name,
                                                   "' on a ", options.clock->name(),
                                                   " clock: CUDA streams run on the wall clock"));
  }
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(guard.Set(device));
  SL_ASSIGN_OR_RETURN(const int priority, CudaPriority(options));
  cudaStream_t stream = nullptr;
  SL_RETURN_IF_ERROR(Annotate(
      SL_CUDA_STATUS(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority)),
      absl::StrCat("stream '", options.name, "'")));
  const StreamTracer tracer(options);
  return std::make_unique<CudaStream>(device, std::move(options.name), wait_timeout, stream,
                                      tracer);
}

}  // namespace shardline

#endif  // SHARDLINE_WITH_CUDA
