// File: bindings/c/c_internal.h
// -----------------------------------------------------------------------------
// Private to the C API's sources (bindings/c/c_*.cc); not installed. The handles behind the
// header's opaque types, and the conversions every entry point uses: a Status into a result
// code and this thread's error text (c_status.cc), C++ exceptions into results (Guard), the
// header's enums and timeouts into C++ values (c_types.cc), and option structs read by their
// struct_size (ReadConfig).
//
// Every entry point has the same shape: Guard, SL_C_REQUIRE on the handles and arguments,
// ReadConfig of its option struct, then FromStatus of the C++ call.

#ifndef SHARDLINE_BINDINGS_C_C_INTERNAL_H_
#define SHARDLINE_BINDINGS_C_C_INTERNAL_H_

#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bindings/c/shardline.h"
#include "collectives/communicator.h"
#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "scheduler/scheduler.h"

// ---- The handles ---------------------------------------------------------------------------
// Each owns (or shares) the C++ object; destroying the handle destroys it.

struct shardlineComm_s {
  std::shared_ptr<shardline::Communicator> comm;
};
struct shardlineStream_s {
  std::unique_ptr<shardline::Stream> stream;
};
struct shardlineWork_s {
  shardline::Work work;
};
struct shardlineEvent_s {
  std::shared_ptr<shardline::Event> event;
};
struct shardlineTrace_s {
  shardline::TraceWriter writer;
};
struct shardlineScheduler_s {
  // The framework's allocators, destroyed after the scheduler (declared before it).
  std::unique_ptr<shardline::Allocator> gather_pool;
  std::unique_ptr<shardline::Allocator> reduce_pool;
  std::unique_ptr<shardline::Allocator> shard_allocator;  // as the shard or the offload allocator
  std::unique_ptr<shardline::Scheduler> scheduler;
  shardline::UnitPolicy policy;  // of every unit it registers (from the config)
  // Where master shards live: the compute stream's device, the host with CPU offload.
  shardline::Device master_device = shardline::Device::Host();
};

namespace shardline::c_api {

// ---- Results and error text (c_status.cc) --------------------------------------------------

// Sets this thread's error text (shardline_last_error) to `message` and returns `code`.
shardlineResult_t Fail(shardlineResult_t code, std::string message);

// The result code of `status` (shardlineSuccess for OK), without touching the error text.
shardlineResult_t ResultOf(const absl::Status& status);

// ResultOf(status), with the error text set to status.ToString() when it is not OK.
shardlineResult_t FromStatus(const absl::Status& status);

#ifdef SHARDLINE_WITH_CUDA
// FromStatus for calls that open a device (wrapping a framework's CUDA stream or event): there,
// Unavailable means the device cannot be used (no GPU or driver, a bad index), not a peer.
shardlineResult_t FromDeviceStatus(const absl::Status& status);
#endif

// Runs `body` (returning a shardlineResult_t) with C++ exceptions turned into results.
template <typename Body>
shardlineResult_t Guard(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(shardlineResourceExhausted, "RESOURCE_EXHAUSTED: out of host memory");
  } catch (const std::exception& e) {
    return Fail(shardlineInternalError, absl::StrCat("INTERNAL: ", e.what()));
  } catch (...) {
    return Fail(shardlineInternalError, "INTERNAL: unknown C++ exception");
  }
}

// ---- The header's values as C++ values (c_types.cc) ----------------------------------------

// A caller's timeout in seconds; <= 0: SHARDLINE_TIMEOUT_S (600 s if that knob is invalid).
absl::Duration Timeout(double seconds);

// false for a value the header does not define.
bool ToDType(shardlineDataType_t in, DType* out);
bool ToOp(shardlineRedOp_t in, ReduceOp* out);

// Copies a caller's option struct of `in->struct_size` bytes over the defaults (newer fields the
// caller does not know keep their defaults). NULL: the defaults. InvalidArgument, naming `what`,
// for a struct_size this library does not know.
template <typename T>
shardlineResult_t ReadConfig(const T* in, T defaults, T* out, const char* what) {
  *out = defaults;
  if (in == nullptr) return shardlineSuccess;
  if (in->struct_size < offsetof(T, version) + sizeof(int) || in->struct_size > sizeof(T)) {
    return Fail(shardlineInvalidArgument,
                absl::StrCat("INVALID_ARGUMENT: ", what, ".struct_size is ", in->struct_size,
                             "; this library knows sizes up to ", sizeof(T),
                             " (initialise the struct with its _INIT macro)"));
  }
  std::memcpy(static_cast<void*>(out), in, in->struct_size);
  out->struct_size = sizeof(T);
  return shardlineSuccess;
}

// ---- Schedulers (c_scheduler.cc) -----------------------------------------------------------

// InvalidArgument, naming `fn`, if `s` is NULL or has no unit `unit`.
absl::Status CheckUnit(shardlineScheduler_t s, int unit, const char* fn);

}  // namespace shardline::c_api

// Returns shardlineInvalidArgument with "INVALID_ARGUMENT: " + `what` as the error text unless
// `cond` holds.
#define SL_C_REQUIRE(cond, what)                                                 \
  do {                                                                           \
    if (!(cond)) {                                                               \
      return ::shardline::c_api::Fail(shardlineInvalidArgument,                  \
                                      absl::StrCat("INVALID_ARGUMENT: ", what)); \
    }                                                                            \
  } while (false)

#endif  // SHARDLINE_BINDINGS_C_C_INTERNAL_H_
