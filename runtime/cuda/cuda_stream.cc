// CUDA streams (see runtime/cuda/cuda_stream.h for the semantics beyond stream.h): host
// functions, waits for host events, CreateCudaStream and WrapCudaStream. Events: cuda_event.cc.

#ifdef SHARDLINE_WITH_CUDA

#include "runtime/cuda/cuda_stream.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
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
#include "runtime/cuda/internal/cuda_host_wait.h"
#include "runtime/cuda/internal/cuda_stream_internal.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {

SL_PARAM(bool, CudaWaitValue, "CUDA_WAIT_VALUE", true,
         "CUDA streams wait for host events on the device (cuStreamWaitValue32 on a pinned flag). "
         "0: in a host function that blocks CUDA's host-callback thread while it waits (the "
         "fallback for platforms without stream memory operations).");

namespace cuda_internal {

using stream_internal::HostCapture;
using stream_internal::StreamTracer;

namespace {

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
  // Only a failure at an earlier step skips this one: a wait for a host event enqueued later may
  // have failed already (its outcome is known on the host before the device gets there).
  const absl::Status poison = state.FailureUpTo(task->seq - 1);
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
      // The fallback without stream memory operations: blocks CUDA's host-callback thread.
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

// One wait of a CUDA stream for a host capture, done on the device: the stream waits on a pinned
// flag, which is signalled by the capture's completion callback, or by the watchdog once the
// stream's wait_timeout has passed. The first of the two decides the outcome. A failure
// poisons the stream at the wait's step before the flag lets the device go on, so host
// functions and events after the wait see it.
class DeviceHostWait {
 public:
  DeviceHostWait(std::shared_ptr<CudaStreamState> state, uint64_t step, HostFlag flag)
      : state_(std::move(state)), step_(step), flag_(flag) {}
  DeviceHostWait(const DeviceHostWait&) = delete;
  DeviceHostWait& operator=(const DeviceHostWait&) = delete;
  ~DeviceHostWait() {
    // Both owners (the capture's callback and the watchdog) dropped it unfinished: never leave
    // the device waiting on a flag nobody will set.
    Finish(absl::InternalError(
        absl::StrCat("stream '", state_->name(), "': a wait for a host event was abandoned")));
  }

  // The watchdog entry to cancel when the wait finishes first (0: none).
  void Armed(uint64_t watchdog) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_) {
        watchdog_ = watchdog;
        return;
      }
    }
    cuda_internal::CancelWatchdog(watchdog);
  }

  void Finish(absl::Status status) {
    uint64_t watchdog = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      watchdog = watchdog_;
    }
    if (!status.ok()) state_->Poison(std::move(status), step_);
    cuda_internal::SignalHostFlag(flag_);
    if (watchdog != 0) cuda_internal::CancelWatchdog(watchdog);
  }

 private:
  const std::shared_ptr<CudaStreamState> state_;
  const uint64_t step_;
  const HostFlag flag_;
  std::mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t watchdog_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

struct CudaStreamConfig {
  int device = 0;
  std::string name;
  absl::Duration wait_timeout;
  cudaStream_t stream = nullptr;
  bool owned = true;         // created here: drained and destroyed with the Stream
  bool legacy = false;       // cudaStreamLegacy: resolved through the current device
  bool device_waits = true;  // wait for host events with cuStreamWaitValue32
  StreamTracer tracer;
};

// Owned (CreateCudaStream) and wrapped (WrapCudaStream) streams are this one class; they differ
// only in what the destructor does.
class CudaStream final : public Stream, public stream_internal::HostCaptureRecorder {
 public:
  explicit CudaStream(CudaStreamConfig config)
      : device_(config.device),
        name_(config.name),
        wait_timeout_(config.wait_timeout),
        stream_(config.stream),
        owned_(config.owned),
        legacy_(config.legacy),
        device_waits_(config.device_waits),
        state_(std::make_shared<CudaStreamState>(std::move(config.name), config.tracer)) {}

  ~CudaStream() override {
    // A wrapped stream is the framework's: its work keeps running, and the handle stays valid.
    if (!owned_) return;
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
    if (std::optional<CudaCapture> snapshot = SnapshotCudaEvent(event)) {
      CudaCapture capture = *std::move(snapshot);
      if (capture.handle == nullptr) return status();
      std::lock_guard<std::mutex> lock(enqueue_mu_);
      SL_RETURN_IF_ERROR(state_->status());
      CudaDeviceGuard guard;
      SL_RETURN_IF_ERROR(MakeCurrent(guard));
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
      if (capture == nullptr) return status();
      absl::Status captured;
      if (capture->done(&captured)) {
        if (captured.ok()) return status();
        // Already failed: the failure enters this stream here, in its order.
        std::lock_guard<std::mutex> lock(enqueue_mu_);
        SL_RETURN_IF_ERROR(state_->status());
        state_->Poison(std::move(captured), ++steps_);
        return absl::OkStatus();
      }
      if (device_waits_.load(std::memory_order_relaxed)) {
        absl::Status waited = WaitOnDevice(capture);
        if (!absl::IsUnimplemented(waited)) return waited;
        if (device_waits_.exchange(false)) {
          SL_LOG(WARN, STREAM) << "CUDA stream '" << name_
                               << "' waits for host events in blocking host functions: " << waited;
        }
      }
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

  std::shared_ptr<Event> CreateEvent() override { return CreateCudaEvent(device_); }

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
    CudaDeviceGuard guard;
    SL_RETURN_IF_ERROR(MakeCurrent(guard));
    SL_RETURN_IF_ERROR(Annotate(SL_CUDA_STATUS(cudaEventRecord(handle->event, stream_)),
                                absl::StrCat("stream '", name_, "'")));
    return CudaCapture{std::move(handle), state_, steps_, id()};
  }

 private:
  // The legacy default stream means "the default stream of the current device": every call on
  // it needs this stream's device current.
  absl::Status MakeCurrent(CudaDeviceGuard& guard) const {
    if (!legacy_) return absl::OkStatus();
    return Annotate(guard.Set(device_), absl::StrCat("stream '", name_, "'"));
  }

  // The wait for a pending host capture on the device: cuStreamWaitValue32 on a pinned flag that
  // the capture's completion (or the watchdog at wait_timeout) sets. Unimplemented if the
  // platform has no stream memory operations (nothing was enqueued then).
  absl::Status WaitOnDevice(const std::shared_ptr<HostCapture>& capture) {
    // This stream's device current throughout: a new page of flags is pinned in its context
    // (not in whichever device this thread had), and cudaHostGetDevicePointer answers for it.
    CudaDeviceGuard guard;
    SL_RETURN_IF_ERROR(Annotate(guard.Set(device_), absl::StrCat("stream '", name_, "'")));
    absl::StatusOr<HostFlag> flag = cuda_internal::AcquireHostFlag();
    if (!flag.ok()) return Annotate(flag.status(), absl::StrCat("stream '", name_, "'"));
    std::shared_ptr<DeviceHostWait> wait;
    {
      std::lock_guard<std::mutex> lock(enqueue_mu_);
      absl::Status enqueued = state_->status();
      if (enqueued.ok()) {
        enqueued = cuda_internal::EnqueueHostFlagWait(stream_, *flag);
        if (!enqueued.ok() && !absl::IsUnimplemented(enqueued)) {
          enqueued = Annotate(enqueued, absl::StrCat("stream '", name_, "'"));
        }
      }
      if (!enqueued.ok()) {
        cuda_internal::ReturnHostFlag(*flag);
        return enqueued;
      }
      wait = std::make_shared<DeviceHostWait>(state_, ++steps_, *flag);
    }
    // The device wait has no timeout of its own: the watchdog ends it at wait_timeout, counted
    // from now (the blocking fallback counts from when the stream reaches the wait).
    if (wait_timeout_ < absl::InfiniteDuration()) {
      std::string timed_out = absl::StrCat(
          "stream '", name_, "' (wait_timeout ", absl::FormatDuration(wait_timeout_),
          "): timed out waiting for an event recorded on stream '", capture->stream_name(), "'");
      wait->Armed(cuda_internal::ArmWatchdog(
          absl::Now() + wait_timeout_, [wait, timed_out = std::move(timed_out)]() mutable {
            wait->Finish(absl::DeadlineExceededError(std::move(timed_out)));
          }));
    }
    capture->OnComplete([wait](absl::Status status) { wait->Finish(std::move(status)); });
    return absl::OkStatus();
  }

  // Launches `task` as the next host function, unless the stream is poisoned. A host capture that
  // cannot be launched completes with the error, so that nobody waits for it.
  absl::Status LaunchLocked(std::unique_ptr<HostTask> task)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(enqueue_mu_) {
    absl::Status status = state_->status();
    if (status.ok()) {
      task->state = state_;
      task->seq = ++steps_;
      CudaDeviceGuard guard;
      status = MakeCurrent(guard);
      if (status.ok()) {
        status = SL_CUDA_STATUS(cudaLaunchHostFunc(stream_, &RunHostTask, task.get()));
      }
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
    CudaDeviceGuard guard;
    SL_RETURN_IF_ERROR(MakeCurrent(guard));
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
  const bool owned_;
  const bool legacy_;
  // Cleared for good when the platform refuses cuStreamWaitValue32.
  std::atomic<bool> device_waits_;
  const std::shared_ptr<CudaStreamState> state_;
  // Keeps step numbering in stream order when several threads enqueue.
  std::mutex enqueue_mu_;
  uint64_t steps_ ABSL_GUARDED_BY(enqueue_mu_) = 0;
};

namespace {

// The parts of a stream's configuration that do not depend on the cudaStream_t.
absl::StatusOr<CudaStreamConfig> ConfigFor(int device, StreamOptions& options,
                                           absl::string_view what) {
  SL_RETURN_IF_ERROR(CheckDeviceExists(device, what));
  CudaStreamConfig config;
  config.device = device;
  SL_ASSIGN_OR_RETURN(config.wait_timeout, stream_internal::ResolveWaitTimeout(options));
  if (options.clock != nullptr && options.clock != &WallClock()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " on a ", options.clock->name(),
                                                   " clock: CUDA streams run on the wall clock"));
  }
  SL_ASSIGN_OR_RETURN(const bool wait_value, ParamCudaWaitValue().Get());
  config.device_waits = wait_value && cuda_internal::DeviceWaitsAvailable(device);
  config.tracer = StreamTracer(options);
  config.name = std::move(options.name);
  return config;
}

// StreamOptions::priority on the current device's scale: CUDA's numerically lower values are more
// urgent, `least` is its default, and `greatest` its most urgent.
absl::StatusOr<int> CudaPriority(int priority, absl::string_view name) {
  int least = 0;
  int greatest = 0;
  SL_RETURN_IF_ERROR(
      Annotate(SL_CUDA_STATUS(cudaDeviceGetStreamPriorityRange(&least, &greatest)),
               absl::StrCat("stream '", name, "': reading the stream priority range")));
  if (priority <= 0) return least;
  // least - priority without overflow: the range spans a handful of levels.
  if (priority >= least - greatest) return greatest;
  return least - priority;
}

}  // namespace

CudaStream* AsCudaStreamOf(Stream& stream, int device) {
  auto* cuda = dynamic_cast<CudaStream*>(&stream);
  return cuda != nullptr && cuda->device_index() == device ? cuda : nullptr;
}

absl::StatusOr<CudaCapture> RecordCudaEvent(CudaStream& stream,
                                            std::shared_ptr<CudaEventHandle> handle) {
  return stream.RecordCudaEvent(std::move(handle));
}

absl::Status CheckDeviceExists(int device, absl::string_view what) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the error behind for unrelated callers
    return absl::UnavailableError(
        absl::StrCat(what, " on cuda:", device, ": ", SL_CUDA_STATUS(error).message()));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrCat(what, ": cuda:", device, " does not exist (", count,
                                               " CUDA device(s) visible)"));
  }
  return absl::OkStatus();
}

}  // namespace cuda_internal

absl::StatusOr<std::unique_ptr<Stream>> CreateCudaStream(int device, StreamOptions options) {
  const std::string what = absl::StrCat("cannot create CUDA stream '", options.name, "'");
  const int requested_priority = options.priority;
  SL_ASSIGN_OR_RETURN(cuda_internal::CudaStreamConfig config,
                      cuda_internal::ConfigFor(device, options, what));
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(guard.Set(device));
  SL_ASSIGN_OR_RETURN(const int priority,
                      cuda_internal::CudaPriority(requested_priority, config.name));
  SL_RETURN_IF_ERROR(Annotate(
      SL_CUDA_STATUS(cudaStreamCreateWithPriority(&config.stream, cudaStreamNonBlocking, priority)),
      absl::StrCat("stream '", config.name, "'")));
  return std::make_unique<cuda_internal::CudaStream>(std::move(config));
}

absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(cudaStream_t stream, int device,
                                                       StreamOptions options) {
  const std::string what = absl::StrCat("cannot wrap CUDA stream '", options.name, "'");
  if (stream == cudaStreamPerThread) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": cudaStreamPerThread names a different stream on every host thread; "
                     "wrap the framework's stream handle itself"));
  }
  SL_ASSIGN_OR_RETURN(cuda_internal::CudaStreamConfig config,
                      cuda_internal::ConfigFor(device, options, what));
  config.owned = false;
  config.legacy = stream == nullptr || stream == cudaStreamLegacy;
  config.stream = config.legacy ? cudaStreamLegacy : stream;
#if CUDART_VERSION >= 12080
  if (!config.legacy) {
    int stream_device = -1;
    const cudaError_t error = cudaStreamGetDevice(stream, &stream_device);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": not a valid stream: ", SL_CUDA_STATUS(error).message()));
    }
    if (stream_device != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the stream belongs to cuda:", stream_device, ", not cuda:", device));
    }
  }
#endif
  return std::make_unique<cuda_internal::CudaStream>(std::move(config));
}

}  // namespace shardline

#endif  // SHARDLINE_WITH_CUDA
