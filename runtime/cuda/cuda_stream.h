// File: runtime/cuda/cuda_stream.h
// -----------------------------------------------------------------------------
// The CUDA implementation of runtime/stream.h (built with SHARDLINE_WITH_CUDA). Most code reaches
// it through CreateStream(Device::Cuda(n)); this header is for code that needs the CUDA stream
// by name, or that hands us a framework's streams and events (WrapCudaStream, WrapCudaEvent).
//
// A CUDA stream is a cudaStream_t: one we create with cudaStreamNonBlocking, or a framework's
// that we wrap. Its events are cudaEvent_t created with cudaEventDisableTiming (created on first
// Record). Semantics beyond stream.h:
//   * Enqueue(work) runs `work` as a host function (cudaLaunchHostFunc), ordered with the
//     stream's kernels. Work must not call CUDA. A failing work item poisons the stream: later
//     host work on it is skipped, but kernels already enqueued still run (CUDA cannot cancel
//     them); events recorded after the failure report it once the device reaches them.
//   * WaitEvent(cuda event) is cudaStreamWaitEvent (cross-device allowed); if the event's stream
//     can fail (it ran host work before the record), a host function after the wait carries the
//     failure over.
//   * WaitEvent(host event) waits on the device: cuStreamWaitValue32 on a pinned, device-mapped
//     flag that the host event's completion sets (no host function, so CUDA's single
//     host-callback thread stays free for other streams' host functions). If the host event
//     fails, the stream is poisoned at the wait: host work after it is skipped and events after
//     it report the failure. The device wait has no timeout of its own: a watchdog thread ends
//     it once wait_timeout has passed, counted on the wall clock from the WaitEvent() call
//     (not from when the stream reaches the wait), and poisons the stream with
//     DeadlineExceeded. The failure becomes the stream's status() as soon as it is known on the
//     host, possibly before the device gets to the wait (work enqueued before the wait is not
//     affected).
//     Fallback, when the driver or platform lacks stream memory operations or
//     SHARDLINE_CUDA_WAIT_VALUE=0: a host function that blocks until the host event completes,
//     bounded by wait_timeout counted from when the stream reaches it. It occupies CUDA's
//     host-callback thread while it blocks, which delays host functions of every stream of the
//     process (a cycle through them resolves only at wait_timeout).
//   * A host event can be recorded on a CUDA stream (a host function completes it).
//   * Synchronize(deadline) polls cudaStreamQuery with a bounded backoff; it never synchronizes
//     the device. Query()/Synchronize() of a CUDA event likewise poll cudaEventQuery.
//   * Host and caller streams can wait for a CUDA event: their thread polls it until the
//     wait_timeout.
//   * Record(stream) of a CUDA event needs a CUDA stream (ours or wrapped) on the event's device.
//   * The destructor of a stream we created waits for its work (until the SHARDLINE_TIMEOUT_S
//     deadline), then destroys it. A wrapped stream's destructor does neither.
//   * StreamOptions::priority: cudaStreamCreateWithPriority with the mapping stream.h describes
//     (cudaDeviceGetStreamPriorityRange of the device). A wrapped stream keeps the priority the
//     framework created it with; the option is ignored there.
//   * Timing: events are created with cudaEventDisableTiming, so Event::completed_at() is
//     nullopt and ElapsedBetween() fails on them. StreamOptions::trace times host functions only
//     (Submit'ed ops, and waits for host events in the blocking fallback), on CUDA's
//     host-callback thread and the wall clock. Kernels and copies enqueued by
//     runtime/stream_ops.h, waits for CUDA events and waits for host events on the device make
//     no span.
//     TODO: spans for device work need timing events recorded around it.
//
// Knob: SHARDLINE_CUDA_WAIT_VALUE (default 1; 0 selects the blocking fallback above).

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_

#include <cuda_runtime.h>

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/stream.h"

namespace shardline {

// A CUDA stream on device `device`. Unavailable if CUDA reports no such device (no driver, no
// GPU, index out of range); InvalidArgument for a bad wait_timeout or a clock other than the wall
// clock; Internal for other CUDA errors. Defined only when shardline is built with
// SHARDLINE_WITH_CUDA.
absl::StatusOr<std::unique_ptr<Stream>> CreateCudaStream(int device, StreamOptions options = {});

// A Stream over a framework's `stream` of cuda:`device`, without taking it over: it behaves as a
// CUDA stream of ours (Submit runs host functions on it, WaitEvent, CreateEvent, poisoning of
// our host work), but its destructor neither waits for the stream's work nor destroys it, and
// the cudaStream_t stays the framework's to use and destroy (after the Stream is gone).
// native_handle() returns it, so the nccl backend and CudaAllocator accept the Stream like one of
// ours.
//
// Poisoning covers only the work enqueued through this Stream: the framework's own kernels on
// the stream (and the host work it enqueues itself) run regardless, and a failure does not stop
// them. Callers that must not compute on the results of a failed collective check its
// Work::status() or an event before they enqueue that computation.
//
// nullptr (or cudaStreamLegacy) wraps the legacy default stream of `device` (PyTorch's default
// stream); every call on it is made with `device` current, and native_handle() returns
// cudaStreamLegacy. cudaStreamPerThread is InvalidArgument (it is a different stream on every
// host thread). InvalidArgument too if CUDA says the stream belongs to another device (checked
// with CUDA 12.8 or newer), and for a bad wait_timeout or clock; Unavailable if cuda:`device`
// does not exist.
absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(cudaStream_t stream, int device,
                                                       StreamOptions options = {});

// An Event over a framework's `event` of cuda:`device`, without taking it over: the Event never
// destroys it, so the framework must keep it alive as long as the Event and every wait on it
// (host waits, OnComplete) that is still pending. Until the first Record() here, Query(),
// Synchronize() and OnComplete() follow the framework's latest cudaEventRecord, and our CUDA
// streams wait on it with cudaStreamWaitEvent. Record(stream) needs one of our (or a wrapped)
// CUDA streams of `device` and records the same cudaEvent_t there, so the framework can wait on
// it; later queries follow that record (host waits see the latest record, CUDA's rule, rather
// than the one they started with). Only CUDA errors are reported for records made by the
// framework; the failure of a stream of ours is reported for records made here, as for our
// events. InvalidArgument for a null or unusable event (cudaEventQuery fails); Unavailable if
// cuda:`device` does not exist.
absl::StatusOr<std::shared_ptr<Event>> WrapCudaEvent(cudaEvent_t event, int device);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_STREAM_H_
