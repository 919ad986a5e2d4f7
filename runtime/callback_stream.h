// File: runtime/callback_stream.h
// -----------------------------------------------------------------------------
// Streams, events and allocators of another runtime (an embedding framework's executor, event
// and memory pool) reached through plain function pointers and a `user` pointer: the fourth kind
// of stream beside host, caller, CUDA (runtime/stream.h) and virtual-time streams
// (runtime/virtual_time.h). The C API (bindings/c/shardline.h) adapts its shardline*Callbacks_t
// structs to these; C++ code can use them directly.
//
//   callback stream     every op, event record and wait becomes one fn(ctx) that the other
//                       runtime runs in its own stream's order. Its events are host events
//                       (CreateHostEvent), so host, caller and CUDA streams wait for them
//                       without polling.
//   callback event      an event the other runtime records and completes: waits go through its
//                       notify callback (no polling), Query through its query callback. It
//                       cannot be recorded on a shardline stream.
//   callback allocator  an Allocator whose blocks come from the other runtime's pool.
//
// Each struct's `origin` names, in error messages, what created the object (the C API passes
// its entry point, "shardline_stream_from_callbacks"); empty: nothing is named.

#ifndef SHARDLINE_RUNTIME_CALLBACK_STREAM_H_
#define SHARDLINE_RUNTIME_CALLBACK_STREAM_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace shardline {

// The other runtime's in-order queue of host work.
struct StreamCallbacks {
  // Passed back to every callback.
  void* user = nullptr;
  // Required. Appends fn(ctx) to the other runtime's stream and returns 0; non-zero: it cannot
  // (the stream then fails with Internal, naming the value, and stays failed). Every fn it
  // accepted must be called exactly once, in the order enqueued, one at a time, after the work
  // enqueued before it, on any thread (also inside enqueue itself). A fn runs an op, completes an
  // event's capture, or blocks its thread until an event of another stream completes (at most the
  // stream's wait_timeout; then the stream fails with DeadlineExceeded).
  int (*enqueue)(void* user, void (*fn)(void* ctx), void* ctx) = nullptr;
  // Optional. Called once by the stream's destructor, after it waited (at most wait_timeout) for
  // every accepted fn to run (fns still pending then are logged, and may still run later: what
  // they touch is shared with them). Not called if creating the stream fails.
  void (*release)(void* user) = nullptr;
  // Named in errors (see the file comment).
  std::string origin;
};

// A stream whose work `callbacks` runs. Uses options.name and options.wait_timeout (unset:
// SHARDLINE_TIMEOUT_S); its clock is the wall clock, and it writes no spans. InvalidArgument if
// enqueue is null, options.clock is set to another clock than WallClock(), options.trace is
// set, or the wait timeout is invalid (as for CreateHostStream). Its device is the host; its
// CreateEvent() is CreateHostEvent(). Synchronize() from inside one of its own fns is
// FailedPrecondition (it would wait for itself).
absl::StatusOr<std::unique_ptr<Stream>> CreateCallbackStream(StreamCallbacks callbacks,
                                                             StreamOptions options = {});

// The other runtime's event (of any device).
struct EventCallbacks {
  void* user = nullptr;
  // Required. 1 once the event's work is done, 0 while it runs, negative if it failed (the event
  // then reports Internal naming the value).
  int (*query)(void* user) = nullptr;
  // Required. Arranges for done(ctx, failed) to be called exactly once when the work completes
  // (at once if it already has), from any thread, without blocking; failed != 0 is a failure.
  void (*notify)(void* user, void (*done)(void* ctx, int failed), void* ctx) = nullptr;
  // Optional. Called once when the event is destroyed.
  void (*release)(void* user) = nullptr;
  // Named in errors (see the file comment).
  std::string origin;
};

// An event that `callbacks` complete; its device is the host (waiters are host threads or host
// callbacks). Record() is InvalidArgument: the other runtime records it. Synchronize() waits
// through notify, with its deadline on the wall clock. InvalidArgument if query or notify is
// null.
absl::StatusOr<std::shared_ptr<Event>> CreateCallbackEvent(EventCallbacks callbacks);

// The other runtime's memory pool.
struct AllocatorCallbacks {
  void* user = nullptr;
  // Required. Returns 0 and sets *ptr to `bytes` of memory of the allocator's device, aligned to
  // kCallbackAllocatorAlignment; non-zero when it has none. `stream` is the native_handle() of
  // the stream that will use the block first (null for host streams and for no stream).
  int (*alloc)(void* user, size_t bytes, void* stream, void** ptr) = nullptr;
  // Required. Takes back a block: only once every stream that used it is done with it (the
  // Allocator base class holds it until then), so `stream` is always null and the block may be
  // reused at once.
  void (*free)(void* user, void* ptr, size_t bytes, void* stream) = nullptr;
  // Named in errors (see the file comment).
  std::string origin;
};

// The alignment a callback allocator requires of the blocks alloc returns.
inline constexpr size_t kCallbackAllocatorAlignment = 64;

// An Allocator of `device` named `name` over `callbacks` (the memory alloc returns must be of
// that device). An allocation is ResourceExhausted when alloc returns non-zero or a null
// pointer, and InvalidArgument when the pointer is not aligned to kCallbackAllocatorAlignment
// (the block is then given back to free at once). The destructor waits for the blocks still in
// use (Allocator::DrainPending) and frees them. InvalidArgument if alloc or free is null.
absl::StatusOr<std::unique_ptr<Allocator>> CreateCallbackAllocator(AllocatorCallbacks callbacks,
                                                                   Device device, std::string name);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CALLBACK_STREAM_H_
