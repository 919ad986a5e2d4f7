// File: runtime/cuda/cuda_stream.h
// -----------------------------------------------------------------------------
// The CUDA implementation of runtime/stream.h (built with SHARDLINE_WITH_CUDA). Most code reaches
// it through CreateStream(Device::Cuda(n)); this header is for code that needs the CUDA stream
// by name.
//
// A CUDA stream is a cudaStream_t created with cudaStreamNonBlocking; its events are cudaEvent_t
// created with cudaEventDisableTiming (created on first Record). Semantics beyond stream.h:
//   * Enqueue(work) runs `work` as a host function (cudaLaunchHostFunc), ordered with the
//     stream's kernels. Work must not call CUDA. A failing work item poisons the stream: later
//     host work on it is skipped, but kernels already enqueued still run (CUDA cannot cancel
//     them); events recorded after the failure report it.
//   * WaitEvent(cuda event) is cudaStreamWaitEvent (cross-device allowed); if the event's stream
//     can fail (it ran host work before the record), a host function after the wait carries the
//     failure over. WaitEvent(host event) enqueues a host function that blocks until the host
//     event completes, bounded by wait_timeout (DeadlineExceeded poisons the stream). It occupies
//     CUDA's host-callback thread while it blocks, which delays host functions of other streams.
//   * A host event can be recorded on a CUDA stream (a host function completes it).
//   * Synchronize(deadline) polls cudaStreamQuery with a bounded backoff; it never synchronizes
//     the device. Query()/Synchronize() of a CUDA event likewise poll cudaEventQuery.
//   * Host and caller streams can wait for a CUDA event: their thread polls it until the
//     wait_timeout.
//   * Record(stream) of a CUDA event needs a CUDA stream on the event's device.
//   * The destructor waits for the stream's work (until the SHARDLINE_TIMEOUT_S deadline), then
//     destroys it.
//   * StreamOptions::priority: cudaStreamCreateWithPriority with the mapping stream.h describes
//     (cudaDeviceGetStreamPriorityRange of the device).
//   * Timing: events are created with cudaEventDisableTiming, so Event::completed_at() is
//     nullopt and ElapsedBetween() fails on them. StreamOptions::trace times host functions only
//     (Submit'ed ops, waits for host events), on CUDA's host-callback thread and the wall clock.
//     Kernels and copies enqueued by runtime/stream_ops.h and waits for CUDA events make no span.
//     TODO: spans for device work need timing events recorded around it.

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/stream.h"

namespace shardline {

// A CUDA stream on device `device`. Unavailable if CUDA reports no such device (no driver, no
// GPU, index out of range); InvalidArgument for a bad wait_timeout; Internal for other CUDA
// errors. Defined only when shardline is built with SHARDLINE_WITH_CUDA.
absl::StatusOr<std::unique_ptr<Stream>> CreateCudaStream(int device, StreamOptions options = {});

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_
