// File: runtime/cuda/internal/cuda_stream_internal.h
// -----------------------------------------------------------------------------
// Internal to runtime/cuda/ (not installed): what the CUDA streams (cuda_stream.cc) and the CUDA
// events (cuda_event.cc) share — a stream's failure state, which the events recorded on it read,
// an event's record (CudaCapture), and the few calls each makes into the other.
//
// CUDA builds only.

#ifndef SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_STREAM_INTERNAL_H_
#define SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_STREAM_INTERNAL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/stream.h"

namespace shardline::cuda_internal {

// The failure state of one CUDA stream, shared with its host functions in flight, its device
// waits for host events and the events recorded on it. The stream's steps that can fail — host
// functions and waits for host events — are numbered 1, 2, ... in stream order, so an event
// recorded after step n failed iff the stream failed at some step m <= n. A wait for a host
// event learns its outcome on the host, possibly before the device gets there, so failures can
// arrive out of order: the earliest step's failure wins. It also carries the stream's tracer,
// which the host functions use.
class CudaStreamState {
 public:
  CudaStreamState(std::string name, stream_internal::StreamTracer tracer)
      : name_(std::move(name)), tracer_(tracer) {}

  const std::string& name() const { return name_; }
  const stream_internal::StreamTracer& tracer() const { return tracer_; }

  // The failure at the earliest step, or OK.
  absl::Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

  void Poison(absl::Status status, uint64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    if (step >= failed_at_) return;
    status_ = std::move(status);
    failed_at_ = step;
  }

  // The stream's failure if it happened at or before step `step`, else OK.
  absl::Status FailureUpTo(uint64_t step) const {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_at_ <= step ? status_ : absl::OkStatus();
  }

 private:
  const std::string name_;
  const stream_internal::StreamTracer tracer_;
  mutable std::mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  uint64_t failed_at_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<uint64_t>::max();
};

// A cudaEvent_t: ours (destroyed with the handle) or a framework's (WrapCudaEvent: never).
struct CudaEventHandle {
  CudaEventHandle() = default;
  CudaEventHandle(cudaEvent_t e, bool own) : event(e), owned(own) {}
  CudaEventHandle(const CudaEventHandle&) = delete;
  CudaEventHandle& operator=(const CudaEventHandle&) = delete;
  ~CudaEventHandle() {
    if (owned && event != nullptr) (void)cudaEventDestroy(event);
  }
  cudaEvent_t event = nullptr;
  bool owned = true;
};

// One Record() of a CUDA event: what to query, and where a failure would come from.
struct CudaCapture {
  std::shared_ptr<CudaEventHandle> handle;  // nullptr: never recorded
  // The stream of the record; nullptr for a wrapped event recorded by its framework (its
  // failures are the framework's to report: only CUDA errors are seen here).
  std::shared_ptr<CudaStreamState> source;
  uint64_t source_seq = 0;  // steps enqueued on the source stream before the record
  uint64_t stream_id = 0;   // Stream::id() of the source stream
};

// The failure of the capture's source stream at or before the record (OK without a source).
absl::Status SourceFailure(const CudaCapture& capture);

// ---- cuda_event.cc ----

// A new CUDA event of cuda:`device` (its cudaEvent_t is created on the first Record).
std::shared_ptr<Event> CreateCudaEvent(int device);

// The latest record of `event` if it is a CUDA event; nullopt for any other kind of event.
std::optional<CudaCapture> SnapshotCudaEvent(Event& event);

// ---- cuda_stream.cc ----

class CudaStream;

// `stream` as a CUDA stream (ours or wrapped) of cuda:`device`; null for any other stream.
CudaStream* AsCudaStreamOf(Stream& stream, int device);

// Records `handle` on `stream`: the capture that a CUDA event keeps.
absl::StatusOr<CudaCapture> RecordCudaEvent(CudaStream& stream,
                                            std::shared_ptr<CudaEventHandle> handle);

// Unavailable unless cuda:`device` exists; `what` names the caller's object in the message.
absl::Status CheckDeviceExists(int device, absl::string_view what);

}  // namespace shardline::cuda_internal

#endif  // SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_STREAM_INTERNAL_H_
