// File: bindings/c/c_scheduler.cc
// -----------------------------------------------------------------------------
// The C API over the C++ layers: handles own shared pointers to the C++ objects; every entry
// point converts its Status into a result code and this thread's error text, and catches what
// C++ may throw (allocation failures) so that nothing unwinds into C.

#include "bindings/c/shardline.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/bootstrap.h"
#include "collectives/communicator.h"
#include "collectives/local/local_communicator.h"
#include "runtime/allocator.h"
#include "runtime/callback_stream.h"
#include "runtime/config.h"
#include "runtime/flat_layout.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/scheduler.h"
#include "scheduler/sync_states.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

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

// The ABI rule of the header: a field added to an option struct lies at or past the sizeof of
// every older layout, so that an older struct_size (trailing padding included) never covers it.
// The first release's shardlineSchedulerConfig_t ended with reduce_op.
static_assert(offsetof(shardlineSchedulerConfig_t, unsharded_allocator) >=
                  ((offsetof(shardlineSchedulerConfig_t, reduce_op) + sizeof(shardlineRedOp_t) +
                    alignof(shardlineSchedulerConfig_t) - 1) /
                   alignof(shardlineSchedulerConfig_t) * alignof(shardlineSchedulerConfig_t)),
              "a field added to shardlineSchedulerConfig_t overlaps the first layout's padding");
// The second layout ended with trace.
static_assert(offsetof(shardlineSchedulerConfig_t, time_communication) >=
                  ((offsetof(shardlineSchedulerConfig_t, trace) + sizeof(shardlineTrace_t) +
                    alignof(shardlineSchedulerConfig_t) - 1) /
                   alignof(shardlineSchedulerConfig_t) * alignof(shardlineSchedulerConfig_t)),
              "a field added to shardlineSchedulerConfig_t overlaps the second layout's padding");

namespace {

using shardline::DType;
using shardline::ReduceOp;

thread_local std::string last_error;

shardlineResult_t Fail(shardlineResult_t code, std::string message) {
  last_error = std::move(message);
  return code;
}

shardlineResult_t FromStatus(const absl::Status& status) {
  if (status.ok()) return shardlineSuccess;
  last_error = status.ToString();
  if (shardline::IsPeerError(status)) return shardlineRemoteError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return shardlineInvalidArgument;
    case absl::StatusCode::kDeadlineExceeded:
      return shardlineTimeout;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return shardlineRemoteError;
    case absl::StatusCode::kFailedPrecondition:
      return shardlineFailedPrecondition;
    case absl::StatusCode::kNotFound:
      return shardlineNotFound;
    case absl::StatusCode::kResourceExhausted:
      return shardlineResourceExhausted;
    case absl::StatusCode::kUnimplemented:
      return shardlineUnimplemented;
    case absl::StatusCode::kDataLoss:
      return shardlineDataLoss;
    case absl::StatusCode::kAlreadyExists:
      return shardlineAlreadyExists;
    default:
      return shardlineInternalError;
  }
}

#ifdef SHARDLINE_WITH_CUDA
// FromStatus for calls that open a device (wrapping a framework's CUDA stream or event): there,
// Unavailable means the device cannot be used (no GPU or driver, a bad index), not a peer.
shardlineResult_t FromDeviceStatus(const absl::Status& status) {
  const shardlineResult_t result = FromStatus(status);
  return status.code() == absl::StatusCode::kUnavailable ? shardlineDeviceUnavailable : result;
}
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

#define SL_C_REQUIRE(cond, what)                                                                  \
  do {                                                                                            \
    if (!(cond)) return Fail(shardlineInvalidArgument, absl::StrCat("INVALID_ARGUMENT: ", what)); \
  } while (false)

absl::Duration Timeout(double seconds) {
  if (seconds <= 0) {
    absl::StatusOr<absl::Duration> d = shardline::DefaultTimeout();
    return d.ok() ? *d : absl::Seconds(600);
  }
  return absl::Seconds(seconds);
}

bool ToDType(shardlineDataType_t in, DType* out) {
  switch (in) {
    case shardlineFloat32:
      *out = DType::kF32;
      return true;
    case shardlineFloat64:
      *out = DType::kF64;
      return true;
    case shardlineFloat16:
      *out = DType::kF16;
      return true;
    case shardlineBfloat16:
      *out = DType::kBF16;
      return true;
    case shardlineInt32:
      *out = DType::kI32;
      return true;
    case shardlineInt64:
      *out = DType::kI64;
      return true;
    case shardlineUint8:
      *out = DType::kU8;
      return true;
    case shardlineInt8:
      *out = DType::kI8;
      return true;
    default:
      break;
  }
  return false;
}

bool ToOp(shardlineRedOp_t in, ReduceOp* out) {
  switch (in) {
    case shardlineSum:
      *out = ReduceOp::kSum;
      return true;
    case shardlineAvg:
      *out = ReduceOp::kAvg;
      return true;
    case shardlineMin:
      *out = ReduceOp::kMin;
      return true;
    case shardlineMax:
      *out = ReduceOp::kMax;
      return true;
  }
  return false;
}

// Copies a caller's option struct of `caller_size` bytes over the defaults (newer fields the
// caller does not know keep their defaults).
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

// A framework allocator's callbacks, checked.
shardlineResult_t ReadCallbacks(const shardlineAllocator_t* in, shardlineAllocator_t* out,
                                const char* field) {
  const shardlineAllocator_t defaults = SHARDLINE_ALLOCATOR_INIT;
  if (shardlineResult_t r = ReadConfig(in, defaults, out, "shardlineAllocator_t");
      r != shardlineSuccess) {
    return r;
  }
  if (out->alloc == nullptr || out->free == nullptr) {
    return Fail(shardlineInvalidArgument,
                absl::StrCat("INVALID_ARGUMENT: shardlineSchedulerConfig_t.", field,
                             ": alloc and free must both be set"));
  }
  return shardlineSuccess;
}

// A checked framework allocator as the runtime's callback allocator.
shardline::AllocatorCallbacks FromC(const shardlineAllocator_t& a) {
  return {.user = a.user, .alloc = a.alloc, .free = a.free, .origin = "shardlineAllocator_t"};
}

shardlineResult_t Issue(absl::StatusOr<shardline::Work> work, shardlineWork_t* out) {
  if (!work.ok()) return FromStatus(work.status());
  *out = new shardlineWork_s{*std::move(work)};
  return shardlineSuccess;
}

double Seconds(const std::optional<absl::Duration>& d) {
  return d.has_value() ? absl::ToDoubleSeconds(*d) : -1.0;
}

}  // namespace

namespace {

absl::Status CheckUnit(shardlineScheduler_t s, int unit, const char* fn) {
  if (s == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": scheduler is NULL"));
  if (unit < 0 || unit >= s->scheduler->num_units()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": no unit ", unit, " (", s->scheduler->num_units(), " registered)"));
  }
  return absl::OkStatus();
}

template <typename Hook>
shardlineResult_t RunHook(shardlineScheduler_t s, int unit, const char* fn, Hook&& hook) {
  return Guard([&] {
    absl::Status status = CheckUnit(s, unit, fn);
    if (status.ok()) status = hook(*s->scheduler);
    return FromStatus(status);
  });
}

}  // namespace

extern "C" {

shardlineResult_t shardline_get_version(int* version) {
  SL_C_REQUIRE(version != nullptr, "shardline_get_version: version is NULL");
  *version = SHARDLINE_VERSION_CODE;
  return shardlineSuccess;
}

const char* shardline_last_error(void) { return last_error.c_str(); }

const char* shardline_result_string(shardlineResult_t result) {
  switch (result) {
    case shardlineSuccess:
      return "shardlineSuccess";
    case shardlineInvalidArgument:
      return "shardlineInvalidArgument";
    case shardlineTimeout:
      return "shardlineTimeout";
    case shardlineRemoteError:
      return "shardlineRemoteError";
    case shardlineFailedPrecondition:
      return "shardlineFailedPrecondition";
    case shardlineNotFound:
      return "shardlineNotFound";
    case shardlineResourceExhausted:
      return "shardlineResourceExhausted";
    case shardlineUnimplemented:
      return "shardlineUnimplemented";
    case shardlineInternalError:
      return "shardlineInternalError";
    case shardlineDeviceUnavailable:
      return "shardlineDeviceUnavailable";
    case shardlineDataLoss:
      return "shardlineDataLoss";
    case shardlineAlreadyExists:
      return "shardlineAlreadyExists";
    default:
      break;
  }
  return "unknown shardlineResult_t";
}

// ---- Communicators -------------------------------------------------------------------------

shardlineResult_t shardline_comm_init(const shardlineInitConfig_t* config, shardlineComm_t* world) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(world != nullptr, "shardline_comm_init: world is NULL");
    shardlineInitConfig_t c;
    const shardlineInitConfig_t defaults = SHARDLINE_INIT_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineInitConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::InitOptions options;
    if (c.backend != nullptr) options.backend = c.backend;
    if (c.timeout_s > 0) options.timeout = absl::Seconds(c.timeout_s);
    absl::StatusOr<shardline::ProcessGroup> group = shardline::InitProcessGroup(options);
    if (!group.ok()) return FromStatus(group.status());
    *world = new shardlineComm_s{group->world};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_comm_init_local(int size, double timeout_s, shardlineComm_t* comms) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(comms != nullptr, "shardline_comm_init_local: comms is NULL");
    SL_C_REQUIRE(size >= 1, absl::StrCat("shardline_comm_init_local: size ", size, " < 1"));
    shardline::LocalOptions options;
    if (timeout_s > 0) options.timeout = absl::Seconds(timeout_s);
    auto group = shardline::CreateLocalCommunicators(size, options);
    if (!group.ok()) return FromStatus(group.status());
    for (int r = 0; r < size; ++r) comms[r] = new shardlineComm_s{(*group)[r]};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_comm_rank(shardlineComm_t comm, int* rank) {
  SL_C_REQUIRE(comm != nullptr && rank != nullptr, "shardline_comm_rank: NULL argument");
  *rank = comm->comm->rank();
  return shardlineSuccess;
}

shardlineResult_t shardline_comm_size(shardlineComm_t comm, int* size) {
  SL_C_REQUIRE(comm != nullptr && size != nullptr, "shardline_comm_size: NULL argument");
  *size = comm->comm->size();
  return shardlineSuccess;
}

shardlineResult_t shardline_comm_destroy(shardlineComm_t comm) {
  delete comm;
  return shardlineSuccess;
}

// ---- Streams -------------------------------------------------------------------------------

shardlineResult_t shardline_stream_create_host(const char* name, shardlineStream_t* stream) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(stream != nullptr, "shardline_stream_create_host: stream is NULL");
    auto s = shardline::CreateHostStream({.name = name != nullptr ? name : "stream"});
    if (!s.ok()) return FromStatus(s.status());
    *stream = new shardlineStream_s{*std::move(s)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_stream_create_caller(const char* name, shardlineStream_t* stream) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(stream != nullptr, "shardline_stream_create_caller: stream is NULL");
    auto s = shardline::CreateCallerStream({.name = name != nullptr ? name : "compute"});
    if (!s.ok()) return FromStatus(s.status());
    *stream = new shardlineStream_s{*std::move(s)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_stream_from_callbacks(const char* name,
                                                  const shardlineStreamCallbacks_t* callbacks,
                                                  shardlineStream_t* stream) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(callbacks != nullptr && stream != nullptr,
                 "shardline_stream_from_callbacks: NULL argument");
    shardlineStreamCallbacks_t c;
    const shardlineStreamCallbacks_t defaults = SHARDLINE_STREAM_CALLBACKS_INIT;
    if (shardlineResult_t r = ReadConfig(callbacks, defaults, &c, "shardlineStreamCallbacks_t");
        r != shardlineSuccess) {
      return r;
    }
    SL_C_REQUIRE(c.enqueue != nullptr, "shardline_stream_from_callbacks: enqueue is NULL");
    absl::StatusOr<std::unique_ptr<shardline::Stream>> s =
        shardline::CreateCallbackStream({.user = c.user,
                                         .enqueue = c.enqueue,
                                         .release = c.release,
                                         .origin = "shardline_stream_from_callbacks"},
                                        {.name = name != nullptr ? name : "framework"});
    if (!s.ok()) return FromStatus(s.status());
    *stream = new shardlineStream_s{*std::move(s)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_stream_synchronize(shardlineStream_t stream, double timeout_s) {
  SL_C_REQUIRE(stream != nullptr, "shardline_stream_synchronize: stream is NULL");
  return Guard([&] {
    return FromStatus(
        stream->stream->Synchronize(stream->stream->clock().Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_stream_destroy(shardlineStream_t stream) {
  return Guard([&] {
    delete stream;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_stream_wrap_cuda(void* cuda_stream, int device, const char* name,
                                             shardlineStream_t* stream) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(stream != nullptr, "shardline_stream_wrap_cuda: stream is NULL");
#ifdef SHARDLINE_WITH_CUDA
    auto s = shardline::WrapCudaStream(static_cast<cudaStream_t>(cuda_stream), device,
                                       {.name = name != nullptr ? name : "framework"});
    if (!s.ok()) return FromDeviceStatus(s.status());
    *stream = new shardlineStream_s{*std::move(s)};
    return shardlineSuccess;
#else
    return Fail(shardlineUnimplemented,
                "UNIMPLEMENTED: shardline_stream_wrap_cuda: this library was built without CUDA");
#endif
  });
}

// ---- Events --------------------------------------------------------------------------------

shardlineResult_t shardline_event_record(shardlineStream_t stream, shardlineEvent_t* event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(stream != nullptr && event != nullptr, "shardline_event_record: NULL argument");
    absl::StatusOr<std::shared_ptr<shardline::Event>> e = shardline::RecordEvent(*stream->stream);
    if (!e.ok()) return FromStatus(e.status());
    *event = new shardlineEvent_s{*std::move(e)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_event_wrap_cuda(void* cuda_event, int device, shardlineEvent_t* event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(event != nullptr, "shardline_event_wrap_cuda: event is NULL");
#ifdef SHARDLINE_WITH_CUDA
    auto e = shardline::WrapCudaEvent(static_cast<cudaEvent_t>(cuda_event), device);
    if (!e.ok()) return FromDeviceStatus(e.status());
    *event = new shardlineEvent_s{*std::move(e)};
    return shardlineSuccess;
#else
    return Fail(shardlineUnimplemented,
                "UNIMPLEMENTED: shardline_event_wrap_cuda: this library was built without CUDA");
#endif
  });
}

shardlineResult_t shardline_stream_wait_event(shardlineStream_t stream, shardlineEvent_t event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(stream != nullptr && event != nullptr,
                 "shardline_stream_wait_event: NULL argument");
    return FromStatus(stream->stream->WaitEvent(*event->event));
  });
}

shardlineResult_t shardline_event_synchronize(shardlineEvent_t event, double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(event != nullptr, "shardline_event_synchronize: event is NULL");
    return FromStatus(event->event->Synchronize(absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_event_query(shardlineEvent_t event, int* done) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(event != nullptr && done != nullptr, "shardline_event_query: NULL argument");
    absl::StatusOr<bool> q = event->event->Query();
    if (!q.ok()) {
      *done = 1;
      return FromStatus(q.status());
    }
    *done = *q ? 1 : 0;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_event_from_callbacks(const shardlineEventCallbacks_t* callbacks,
                                                 shardlineEvent_t* event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(callbacks != nullptr && event != nullptr,
                 "shardline_event_from_callbacks: NULL argument");
    shardlineEventCallbacks_t c;
    const shardlineEventCallbacks_t defaults = SHARDLINE_EVENT_CALLBACKS_INIT;
    if (shardlineResult_t r = ReadConfig(callbacks, defaults, &c, "shardlineEventCallbacks_t");
        r != shardlineSuccess) {
      return r;
    }
    SL_C_REQUIRE(c.query != nullptr && c.notify != nullptr,
                 "shardline_event_from_callbacks: query and notify must both be set");
    absl::StatusOr<std::shared_ptr<shardline::Event>> e =
        shardline::CreateCallbackEvent({.user = c.user,
                                        .query = c.query,
                                        .notify = c.notify,
                                        .release = c.release,
                                        .origin = "shardline_event_from_callbacks"});
    if (!e.ok()) return FromStatus(e.status());
    *event = new shardlineEvent_s{*std::move(e)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_event_on_complete(shardlineEvent_t event,
                                              void (*callback)(void* user, shardlineResult_t),
                                              void* user) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(event != nullptr && callback != nullptr,
                 "shardline_event_on_complete: NULL argument");
    event->event->OnComplete([callback, user](absl::Status status) {
      // The code only: the error text is per thread, and this may run on any thread.
      const std::string saved = last_error;
      const shardlineResult_t result = FromStatus(status);
      last_error = saved;
      callback(user, result);
    });
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_event_destroy(shardlineEvent_t event) {
  return Guard([&] {
    delete event;
    return shardlineSuccess;
  });
}

// ---- Traces --------------------------------------------------------------------------------

shardlineResult_t shardline_trace_create(int rank, const char* process_name,
                                         shardlineTrace_t* trace) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(trace != nullptr, "shardline_trace_create: trace is NULL");
    SL_C_REQUIRE(rank >= 0, absl::StrCat("shardline_trace_create: rank ", rank, " < 0"));
    *trace = new shardlineTrace_s{
        shardline::TraceWriter(rank, process_name != nullptr ? process_name : "")};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_trace_write(shardlineTrace_t trace, const char* path) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(trace != nullptr && path != nullptr, "shardline_trace_write: NULL argument");
    return FromStatus(trace->writer.WriteFile(path));
  });
}

shardlineResult_t shardline_trace_num_events(shardlineTrace_t trace, size_t* events) {
  SL_C_REQUIRE(trace != nullptr && events != nullptr, "shardline_trace_num_events: NULL argument");
  *events = trace->writer.num_events();
  return shardlineSuccess;
}

shardlineResult_t shardline_trace_destroy(shardlineTrace_t trace) {
  return Guard([&] {
    delete trace;
    return shardlineSuccess;
  });
}

// ---- Collectives ---------------------------------------------------------------------------

#define SL_C_COLLECTIVE_ARGS(fn)                                        \
  SL_C_REQUIRE(comm != nullptr && stream != nullptr && work != nullptr, \
               fn ": comm, stream and work must not be NULL");          \
  DType dt;                                                             \
  SL_C_REQUIRE(ToDType(dtype, &dt), absl::StrCat(fn ": unknown dtype ", static_cast<int>(dtype)))

shardlineResult_t shardline_all_gather(shardlineComm_t comm, const void* input, void* output,
                                       size_t count, shardlineDataType_t dtype,
                                       shardlineStream_t stream, shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_all_gather");
    return Issue(comm->comm->AllGather(input, output, count, dt, *stream->stream), work);
  });
}

shardlineResult_t shardline_reduce_scatter(shardlineComm_t comm, const void* input, void* output,
                                           size_t count, shardlineDataType_t dtype,
                                           shardlineRedOp_t op, shardlineStream_t stream,
                                           shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_reduce_scatter");
    shardline::ReduceOptions options;
    SL_C_REQUIRE(ToOp(op, &options.op), "shardline_reduce_scatter: unknown op");
    return Issue(comm->comm->ReduceScatter(input, output, count, dt, *stream->stream, options),
                 work);
  });
}

shardlineResult_t shardline_all_reduce(shardlineComm_t comm, const void* input, void* output,
                                       size_t count, shardlineDataType_t dtype, shardlineRedOp_t op,
                                       shardlineStream_t stream, shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_all_reduce");
    shardline::ReduceOptions options;
    SL_C_REQUIRE(ToOp(op, &options.op), "shardline_all_reduce: unknown op");
    return Issue(comm->comm->AllReduce(input, output, count, dt, *stream->stream, options), work);
  });
}

shardlineResult_t shardline_broadcast(shardlineComm_t comm, void* buffer, size_t count,
                                      shardlineDataType_t dtype, int root, shardlineStream_t stream,
                                      shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_broadcast");
    shardline::BroadcastOptions options;
    options.root = root;
    return Issue(comm->comm->Broadcast(buffer, count, dt, *stream->stream, options), work);
  });
}

shardlineResult_t shardline_work_wait(shardlineWork_t work, double timeout_s) {
  SL_C_REQUIRE(work != nullptr, "shardline_work_wait: work is NULL");
  return Guard([&] { return FromStatus(work->work.Wait(absl::Now() + Timeout(timeout_s))); });
}

shardlineResult_t shardline_work_is_completed(shardlineWork_t work, int* completed) {
  SL_C_REQUIRE(work != nullptr && completed != nullptr,
               "shardline_work_is_completed: NULL argument");
  *completed = work->work.IsCompleted() ? 1 : 0;
  return FromStatus(work->work.status());
}

shardlineResult_t shardline_work_destroy(shardlineWork_t work) {
  delete work;
  return shardlineSuccess;
}

// ---- Scheduler -----------------------------------------------------------------------------

shardlineResult_t shardline_scheduler_create(shardlineComm_t world, shardlineStream_t compute,
                                             const shardlineSchedulerConfig_t* config,
                                             double timeout_s, shardlineScheduler_t* scheduler) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(world != nullptr && compute != nullptr && scheduler != nullptr,
                 "shardline_scheduler_create: world, compute and scheduler must not be NULL");
    shardlineSchedulerConfig_t c;
    const shardlineSchedulerConfig_t defaults = SHARDLINE_SCHEDULER_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineSchedulerConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SchedulerOptions o;
    if (c.name != nullptr) o.name = c.name;
    SL_C_REQUIRE(
        c.strategy >= shardlineFullShard && c.strategy <= shardlineHybridShard,
        absl::StrCat("shardlineSchedulerConfig_t.strategy ", static_cast<int>(c.strategy)));
    o.strategy = static_cast<shardline::ShardingStrategy>(c.strategy);
    o.shard_size = c.shard_size;
    o.forward_prefetch = c.forward_prefetch;
    SL_C_REQUIRE(c.backward_prefetch >= shardlineBackwardPrefetchOff &&
                     c.backward_prefetch <= shardlineBackwardPrefetchAfterGrad,
                 absl::StrCat("shardlineSchedulerConfig_t.backward_prefetch ",
                              static_cast<int>(c.backward_prefetch)));
    o.backward_prefetch = static_cast<shardline::BackwardPrefetch>(c.backward_prefetch);
    o.backward_prefetch_depth = c.backward_prefetch_depth;
    o.budget_bytes = c.budget_bytes;
    o.budget_units = c.budget_units;
    o.root_unit = c.root_unit;
    o.cpu_offload = c.cpu_offload != 0;
    o.time_communication = c.time_communication != 0;
    auto s = std::make_unique<shardlineScheduler_s>();
    DType param, reduce;
    SL_C_REQUIRE(ToDType(c.param_dtype, &param) && ToDType(c.reduce_dtype, &reduce),
                 "shardlineSchedulerConfig_t: unknown param_dtype or reduce_dtype");
    SL_C_REQUIRE(ToOp(c.reduce_op, &s->policy.reduce_op),
                 "shardlineSchedulerConfig_t: unknown reduce_op");
    s->policy.precision.param_dtype = param;
    s->policy.precision.reduce_dtype = reduce;
    const shardline::Device device = compute->stream->device();
    s->master_device = o.cpu_offload ? shardline::Device::Host() : device;
    if (c.unsharded_allocator != nullptr) {
      shardlineAllocator_t a;
      if (shardlineResult_t r = ReadCallbacks(c.unsharded_allocator, &a, "unsharded_allocator");
          r != shardlineSuccess) {
        return r;
      }
      // Two allocators over the same callbacks, each with its own accounting (the pools' peaks
      // in the metrics). Neither hands out a block before every stream that used it is done,
      // so sharing the framework's pool never makes the gather stream wait for a reduction
      // (the hazard SchedulerOptions::gather_pool warns of for shared caching pools).
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> gather =
          shardline::CreateCallbackAllocator(FromC(a), device, o.name + ".gather (framework)");
      if (!gather.ok()) return FromStatus(gather.status());
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> reduce =
          shardline::CreateCallbackAllocator(FromC(a), device, o.name + ".reduce (framework)");
      if (!reduce.ok()) return FromStatus(reduce.status());
      s->gather_pool = *std::move(gather);
      s->reduce_pool = *std::move(reduce);
      o.gather_pool = s->gather_pool.get();
      o.reduce_pool = s->reduce_pool.get();
    }
    if (c.shard_allocator != nullptr) {
      shardlineAllocator_t a;
      if (shardlineResult_t r = ReadCallbacks(c.shard_allocator, &a, "shard_allocator");
          r != shardlineSuccess) {
        return r;
      }
      // With CPU offload the shards are host memory: the framework's allocator replaces the
      // offload allocator (which replaces the shard allocator there).
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> shards =
          shardline::CreateCallbackAllocator(FromC(a), s->master_device,
                                             o.name + ".shards (framework)");
      if (!shards.ok()) return FromStatus(shards.status());
      s->shard_allocator = *std::move(shards);
      (o.cpu_offload ? o.offload_allocator : o.shard_allocator) = s->shard_allocator.get();
    }
    if (c.trace != nullptr) o.trace = &c.trace->writer;
    absl::StatusOr<std::unique_ptr<shardline::Scheduler>> created = shardline::Scheduler::Create(
        world->comm, *compute->stream, std::move(o), absl::Now() + Timeout(timeout_s));
    if (!created.ok()) return FromStatus(created.status());
    s->scheduler = *std::move(created);
    *scheduler = s.release();
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_destroy(shardlineScheduler_t scheduler) {
  return Guard([&] {
    delete scheduler;
    return shardlineSuccess;
  });
}

namespace {

// The UnitSpec of a C tensor list (names and shapes checked), with the scheduler's policy.
shardlineResult_t BuildSpec(shardlineScheduler_t scheduler, const char* fn, const char* name,
                            const shardlineTensorSpec_t* tensors, int num_tensors,
                            shardline::UnitSpec* spec) {
  SL_C_REQUIRE(scheduler != nullptr && name != nullptr &&
                   (tensors != nullptr || num_tensors == 0) && num_tensors >= 0,
               absl::StrCat(fn, ": NULL or negative argument"));
  spec->name = name;
  spec->policy = scheduler->policy;
  for (int t = 0; t < num_tensors; ++t) {
    SL_C_REQUIRE(tensors[t].name != nullptr && tensors[t].ndim >= 0 &&
                     (tensors[t].shape != nullptr || tensors[t].ndim == 0),
                 absl::StrCat(fn, "('", name, "'): tensor ", t,
                              " has a NULL name or shape or a negative ndim"));
    spec->tensors.push_back(
        {.name = tensors[t].name,
         .shape = std::vector<int64_t>(tensors[t].shape, tensors[t].shape + tensors[t].ndim)});
  }
  return shardlineSuccess;
}

// This rank's master shard elements for `spec` (the layout RegisterUnit builds).
absl::StatusOr<size_t> ShardElements(const shardline::Scheduler& scheduler,
                                     const shardline::UnitSpec& spec) {
  absl::StatusOr<shardline::FlatLayout> layout = shardline::FlatLayout::Create(
      spec.tensors, {.num_shards = scheduler.mesh().shard_size(),
                     .element_dtype = spec.policy.precision.master_dtype});
  if (!layout.ok()) return layout.status();
  return layout->shard_elements();
}

}  // namespace

shardlineResult_t shardline_scheduler_register_unit(shardlineScheduler_t scheduler,
                                                    const char* name,
                                                    const shardlineTensorSpec_t* tensors,
                                                    int num_tensors, int* unit) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(unit != nullptr, "shardline_scheduler_register_unit: unit is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_register_unit", name,
                                        tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<int> id = scheduler->scheduler->RegisterUnit(std::move(spec));
    if (!id.ok()) return FromStatus(id.status());
    *unit = *id;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_shard_elements(shardlineScheduler_t scheduler,
                                                     const shardlineTensorSpec_t* tensors,
                                                     int num_tensors, size_t* elements) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(elements != nullptr, "shardline_scheduler_shard_elements: elements is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_shard_elements", "unit",
                                        tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<size_t> n = ShardElements(*scheduler->scheduler, spec);
    if (!n.ok()) return FromStatus(n.status());
    *elements = *n;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_register_unit_adopted(
    shardlineScheduler_t scheduler, const char* name, const shardlineTensorSpec_t* tensors,
    int num_tensors, void* master_shard, size_t bytes, void (*release)(void* user, void* data),
    void* user, int* unit) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(unit != nullptr, "shardline_scheduler_register_unit_adopted: unit is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_register_unit_adopted",
                                        name, tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<size_t> elements = ShardElements(*scheduler->scheduler, spec);
    if (!elements.ok()) return FromStatus(elements.status());
    const size_t needed = *elements * shardline::DTypeSize(spec.policy.precision.master_dtype);
    SL_C_REQUIRE(master_shard != nullptr || needed == 0,
                 absl::StrCat("shardline_scheduler_register_unit_adopted('", name,
                              "'): master_shard is NULL"));
    SL_C_REQUIRE(bytes == needed,
                 absl::StrCat("shardline_scheduler_register_unit_adopted('", name,
                              "'): master_shard has ", bytes, " bytes but this rank's shard needs ",
                              needed, " (", *elements, " x f32)"));
    // `release` runs only for a registered unit: a RegisterUnit that fails drops the buffer, and
    // the memory then stays the caller's (the header's promise).
    auto registered = std::make_shared<std::atomic<bool>>(false);
    if (master_shard != nullptr) {
      spec.master_shard = shardline::Buffer::Adopt(
          master_shard, bytes, scheduler->master_device, [release, user, registered](void* data) {
            if (release != nullptr && registered->load(std::memory_order_acquire)) {
              release(user, data);
            }
          });
    }
    absl::StatusOr<int> id = scheduler->scheduler->RegisterUnit(std::move(spec));
    if (!id.ok()) return FromStatus(id.status());
    registered->store(true, std::memory_order_release);
    *unit = *id;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_set_post_optimizer_event(shardlineScheduler_t scheduler,
                                                               shardlineEvent_t event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && event != nullptr,
                 "shardline_scheduler_set_post_optimizer_event: NULL argument");
    scheduler->scheduler->SetPostOptimizerEvent(event->event);
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_unit_set_values(shardlineScheduler_t scheduler, int unit,
                                            const void* const* values, int num_tensors) {
  return RunHook(scheduler, unit, "shardline_unit_set_values", [&](shardline::Scheduler& s) {
    if (values == nullptr || num_tensors < 0) {
      return absl::InvalidArgumentError("shardline_unit_set_values: values is NULL");
    }
    return s.unit(unit).SetShardFromTensors(absl::MakeConstSpan(values, num_tensors));
  });
}

shardlineResult_t shardline_pre_forward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_pre_forward",
                 [&](shardline::Scheduler& x) { return x.PreForward(unit); });
}
shardlineResult_t shardline_post_forward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_post_forward",
                 [&](shardline::Scheduler& x) { return x.PostForward(unit); });
}
shardlineResult_t shardline_pre_backward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_pre_backward",
                 [&](shardline::Scheduler& x) { return x.PreBackward(unit); });
}
shardlineResult_t shardline_post_backward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_post_backward",
                 [&](shardline::Scheduler& x) { return x.PostBackward(unit); });
}
shardlineResult_t shardline_end_forward(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_end_forward: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->EndForward()); });
}
shardlineResult_t shardline_finish_backward(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_finish_backward: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->FinishBackward()); });
}
shardlineResult_t shardline_zero_grad(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_zero_grad: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->ZeroGrad()); });
}

shardlineResult_t shardline_unit_param(shardlineScheduler_t s, int unit, int tensor, void** data,
                                       size_t* numel) {
  return RunHook(s, unit, "shardline_unit_param", [&](shardline::Scheduler& x) -> absl::Status {
    if (data == nullptr || numel == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_param: data and numel must not be NULL");
    }
    absl::StatusOr<shardline::TensorView> v = x.unit(unit).View(tensor);
    if (!v.ok()) return v.status();
    *data = v->data;
    *numel = v->numel;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_grad(shardlineScheduler_t s, int unit, int tensor, void** data,
                                      size_t* numel) {
  return RunHook(s, unit, "shardline_unit_grad", [&](shardline::Scheduler& x) -> absl::Status {
    if (data == nullptr || numel == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_grad: data and numel must not be NULL");
    }
    absl::StatusOr<shardline::TensorView> v = x.unit(unit).GradView(tensor);
    if (!v.ok()) return v.status();
    *data = v->data;
    *numel = v->numel;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_master_shard(shardlineScheduler_t s, int unit, void** data,
                                              size_t* elements) {
  return RunHook(s, unit, "shardline_unit_master_shard", [&](shardline::Scheduler& x) {
    if (data == nullptr || elements == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_master_shard: NULL output");
    }
    const shardline::FlatShardView v = x.unit(unit).master_shard();
    *data = v.data;
    *elements = v.elements;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_shard_grad(shardlineScheduler_t s, int unit, void** data,
                                            size_t* elements) {
  return RunHook(s, unit, "shardline_unit_shard_grad",
                 [&](shardline::Scheduler& x) -> absl::Status {
                   if (data == nullptr || elements == nullptr) {
                     return absl::InvalidArgumentError("shardline_unit_shard_grad: NULL output");
                   }
                   absl::StatusOr<shardline::FlatShardView> v = x.unit(unit).ShardGrad();
                   if (!v.ok()) return v.status();
                   *data = v->data;
                   *elements = v->elements;
                   return absl::OkStatus();
                 });
}

shardlineResult_t shardline_unit_shard_slice(shardlineScheduler_t s, int unit, int tensor,
                                             size_t* first, size_t* count, size_t* tensor_offset) {
  return RunHook(s, unit, "shardline_unit_shard_slice",
                 [&](shardline::Scheduler& x) -> absl::Status {
                   if (first == nullptr || count == nullptr || tensor_offset == nullptr) {
                     return absl::InvalidArgumentError("shardline_unit_shard_slice: NULL output");
                   }
                   const shardline::FlatLayout& layout = x.unit(unit).layout();
                   if (tensor < 0 || tensor >= layout.num_tensors()) {
                     return absl::InvalidArgumentError(
                         absl::StrCat("shardline_unit_shard_slice: no tensor ", tensor));
                   }
                   std::optional<shardline::ShardSlice> slice =
                       layout.Intersection(tensor, x.unit(unit).shard_rank());
                   *first = slice ? slice->shard_offset : 0;
                   *count = slice ? slice->length : 0;
                   *tensor_offset = slice ? slice->tensor_offset : 0;
                   return absl::OkStatus();
                 });
}

shardlineResult_t shardline_scheduler_metrics(shardlineScheduler_t s, double timeout_s,
                                              shardlineStepMetrics_t* metrics) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(s != nullptr && metrics != nullptr, "shardline_scheduler_metrics: NULL argument");
    SL_C_REQUIRE(metrics->struct_size >= offsetof(shardlineStepMetrics_t, step) &&
                     metrics->struct_size <= sizeof(shardlineStepMetrics_t),
                 absl::StrCat("shardlineStepMetrics_t.struct_size is ", metrics->struct_size,
                              " (initialise it with SHARDLINE_STEP_METRICS_INIT)"));
    absl::StatusOr<shardline::StepMetrics> m =
        s->scheduler->LastStepMetrics(absl::Now() + Timeout(timeout_s));
    if (!m.ok()) return FromStatus(m.status());
    shardlineStepMetrics_t out = SHARDLINE_STEP_METRICS_INIT;
    out.step = m->step;
    out.bytes_gathered = m->bytes_gathered;
    out.bytes_reduced = m->bytes_reduced;
    out.budget_bytes = m->budget_bytes;
    out.peak_inflight_bytes = m->peak_inflight_bytes;
    out.peak_inflight_units = m->peak_inflight_units;
    out.budget_overshoots = m->budget_overshoots;
    out.deferred_prefetches = m->deferred_prefetches;
    out.order_deviations = m->order_deviations;
    out.step_time_s = Seconds(m->step_time);
    out.exposed_communication_s = Seconds(m->exposed_communication);
    out.overlap_fraction = m->overlap_fraction.value_or(-1.0);
    out.host_hook_time_s = absl::ToDoubleSeconds(m->host_hook_time);
    // Only as many bytes as the caller's struct has.
    const size_t size = metrics->struct_size;
    std::memcpy(static_cast<void*>(metrics), &out, size);
    metrics->struct_size = size;
    return shardlineSuccess;
  });
}

// ---- Checkpoints ---------------------------------------------------------------------------
// The first release's shardlineCheckpointConfig_t ended with read_chunk_bytes (see the scheduler
// config's static_assert for the rule).
static_assert(offsetof(shardlineCheckpointConfig_t, max_snapshot_bytes) >=
                  ((offsetof(shardlineCheckpointConfig_t, read_chunk_bytes) + sizeof(size_t) +
                    alignof(shardlineCheckpointConfig_t) - 1) /
                   alignof(shardlineCheckpointConfig_t) * alignof(shardlineCheckpointConfig_t)),
              "a field added to shardlineCheckpointConfig_t overlaps the first layout's padding");
// Each entry point checks its handles and arguments, then forwards to the C++ Checkpointer with
// the timeout turned into a deadline; a new collective (an asynchronous save, an export) follows
// the same shape: Guard, SL_C_REQUIRE on the arguments, FromStatus of the C++ call.

}  // extern "C"

struct shardlineCheckpointer_s {
  shardlineScheduler_t scheduler;  // not owned: outlives the checkpointer
  std::unique_ptr<shardline::Checkpointer> checkpointer;
};

extern "C" {

shardlineResult_t shardline_checkpointer_create(shardlineScheduler_t scheduler,
                                                const shardlineCheckpointConfig_t* config,
                                                double timeout_s,
                                                shardlineCheckpointer_t* checkpointer) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && checkpointer != nullptr,
                 "shardline_checkpointer_create: scheduler and checkpointer must not be NULL");
    shardlineCheckpointConfig_t c;
    const shardlineCheckpointConfig_t defaults = SHARDLINE_CHECKPOINT_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineCheckpointConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::CheckpointOptions o;
    o.checksum_block_bytes = c.checksum_block_bytes;
    o.read_chunk_bytes = c.read_chunk_bytes;
    o.max_snapshot_bytes = c.max_snapshot_bytes;
    absl::StatusOr<std::unique_ptr<shardline::Checkpointer>> created =
        shardline::Checkpointer::Create(*scheduler->scheduler, o, absl::Now() + Timeout(timeout_s));
    if (!created.ok()) return FromStatus(created.status());
    *checkpointer = new shardlineCheckpointer_s{scheduler, *std::move(created)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_add_state(shardlineCheckpointer_t checkpointer, int unit,
                                                   const char* name, void* data, size_t bytes,
                                                   shardlineDataType_t dtype) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && name != nullptr,
                 "shardline_checkpointer_add_state: checkpointer and name must not be NULL");
    if (absl::Status s =
            CheckUnit(checkpointer->scheduler, unit, "shardline_checkpointer_add_state");
        !s.ok()) {
      return FromStatus(s);
    }
    DType d;
    SL_C_REQUIRE(ToDType(dtype, &d), absl::StrCat("shardline_checkpointer_add_state: state '", name,
                                                  "': unknown dtype ", static_cast<int>(dtype)));
    const shardline::FlatParameter& p = checkpointer->scheduler->scheduler->unit(unit);
    const size_t want = p.layout().shard_elements() * shardline::DTypeSize(d);
    SL_C_REQUIRE(
        bytes == want,
        absl::StrCat("shardline_checkpointer_add_state: state '", name, "' of unit '", p.name(),
                     "' is ", bytes, " bytes; the unit's shard of ", p.layout().shard_elements(),
                     " elements of ", shardline::DTypeName(d), " is ", want, " bytes"));
    return FromStatus(checkpointer->checkpointer->AddState(
        {.unit = unit, .name = name, .data = data, .dtype = d}));
  });
}

shardlineResult_t shardline_checkpointer_save(shardlineCheckpointer_t checkpointer, const char* dir,
                                              double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_save: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->Save(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_load(shardlineCheckpointer_t checkpointer, const char* dir,
                                              double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_load: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->Load(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_destroy(shardlineCheckpointer_t checkpointer) {
  return Guard([&] {
    delete checkpointer;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_add_replicated_state(shardlineCheckpointer_t checkpointer,
                                                              const char* name, void* data,
                                                              const int64_t* shape, int ndim,
                                                              shardlineDataType_t dtype) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && name != nullptr,
                 "shardline_checkpointer_add_replicated_state: checkpointer and name must not be "
                 "NULL");
    SL_C_REQUIRE(ndim >= 0 && (ndim == 0 || shape != nullptr),
                 absl::StrCat("shardline_checkpointer_add_replicated_state: state '", name,
                              "': ndim ", ndim, " with shape ", shape == nullptr ? "NULL" : "set",
                              " (ndim >= 0; shape may be NULL only for a scalar)"));
    DType d;
    SL_C_REQUIRE(ToDType(dtype, &d),
                 absl::StrCat("shardline_checkpointer_add_replicated_state: state '", name,
                              "': unknown dtype ", static_cast<int>(dtype)));
    std::vector<int64_t> dims(shape, shape + ndim);
    return FromStatus(checkpointer->checkpointer->AddReplicatedState(
        {.name = name, .shape = std::move(dims), .dtype = d, .data = data}));
  });
}

shardlineResult_t shardline_checkpointer_save_async(shardlineCheckpointer_t checkpointer,
                                                    const char* dir, double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_save_async: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->SaveAsync(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_wait_for_save(shardlineCheckpointer_t checkpointer,
                                                       double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr,
                 "shardline_checkpointer_wait_for_save: checkpointer must not be NULL");
    return FromStatus(checkpointer->checkpointer->WaitForSave(absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_save_pending(shardlineCheckpointer_t checkpointer,
                                                      int* pending) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && pending != nullptr,
                 "shardline_checkpointer_save_pending: checkpointer and pending must not be NULL");
    *pending = checkpointer->checkpointer->save_pending() ? 1 : 0;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_last_save_stats(shardlineCheckpointer_t checkpointer,
                                                         shardlineCheckpointSaveStats_t* stats) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && stats != nullptr,
                 "shardline_checkpointer_last_save_stats: checkpointer and stats must not be NULL");
    SL_C_REQUIRE(
        stats->struct_size >= offsetof(shardlineCheckpointSaveStats_t, version) + sizeof(int) &&
            stats->struct_size <= sizeof(shardlineCheckpointSaveStats_t),
        absl::StrCat("shardline_checkpointer_last_save_stats: "
                     "shardlineCheckpointSaveStats_t.struct_size is ",
                     stats->struct_size, "; this library knows sizes up to ",
                     sizeof(shardlineCheckpointSaveStats_t),
                     " (initialise it with SHARDLINE_CHECKPOINT_SAVE_STATS_INIT)"));
    const shardline::CheckpointSaveStats st = checkpointer->checkpointer->last_save_stats();
    shardlineCheckpointSaveStats_t out = SHARDLINE_CHECKPOINT_SAVE_STATS_INIT;
    out.background = st.background ? 1 : 0;
    out.finished = st.finished ? 1 : 0;
    out.snapshot_bytes = st.snapshot_bytes;
    out.snapshot_capacity_bytes = st.snapshot_capacity_bytes;
    out.blocked_s = absl::ToDoubleSeconds(st.blocked);
    out.waited_s = absl::ToDoubleSeconds(st.waited);
    out.snapshot_s = absl::ToDoubleSeconds(st.snapshot);
    out.write_s = absl::ToDoubleSeconds(st.write);
    const size_t size = stats->struct_size;
    std::memcpy(static_cast<void*>(stats), &out, size);
    stats->struct_size = size;
    return shardlineSuccess;
  });
}

// ---- Full weights and sync_module_states ------------------------------------------------------

shardlineResult_t shardline_export_safetensors(shardlineScheduler_t scheduler, const char* path,
                                               const shardlineSafetensorsExportConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && path != nullptr,
                 "shardline_export_safetensors: scheduler and path must not be NULL");
    shardlineSafetensorsExportConfig_t c;
    const shardlineSafetensorsExportConfig_t defaults = SHARDLINE_SAFETENSORS_EXPORT_CONFIG_INIT;
    if (shardlineResult_t r =
            ReadConfig(config, defaults, &c, "shardlineSafetensorsExportConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SafetensorsExportOptions o;
    o.writer_rank = c.writer_rank;
    o.cast_chunk_bytes = c.cast_chunk_bytes;
    SL_C_REQUIRE(c.cast == 0 || c.cast == 1,
                 absl::StrCat("shardline_export_safetensors: cast is ", c.cast, " (0 or 1)"));
    if (c.cast == 1) {
      DType d;
      SL_C_REQUIRE(ToDType(c.dtype, &d), absl::StrCat("shardline_export_safetensors: unknown "
                                                      "dtype ",
                                                      static_cast<int>(c.dtype)));
      o.dtype = d;
    }
    SL_C_REQUIRE(c.num_metadata >= 0 && (c.num_metadata == 0 || (c.metadata_keys != nullptr &&
                                                                 c.metadata_values != nullptr)),
                 absl::StrCat("shardline_export_safetensors: num_metadata is ", c.num_metadata,
                              " with metadata_keys or metadata_values NULL"));
    for (int i = 0; i < c.num_metadata; ++i) {
      SL_C_REQUIRE(c.metadata_keys[i] != nullptr && c.metadata_values[i] != nullptr,
                   absl::StrCat("shardline_export_safetensors: metadata entry ", i, " is NULL"));
      o.metadata.emplace_back(c.metadata_keys[i], c.metadata_values[i]);
    }
    return FromStatus(shardline::ExportSafetensors(*scheduler->scheduler, path, o,
                                                   absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_import_safetensors(shardlineScheduler_t scheduler, const char* path,
                                               const shardlineSafetensorsImportConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && path != nullptr,
                 "shardline_import_safetensors: scheduler and path must not be NULL");
    shardlineSafetensorsImportConfig_t c;
    const shardlineSafetensorsImportConfig_t defaults = SHARDLINE_SAFETENSORS_IMPORT_CONFIG_INIT;
    if (shardlineResult_t r =
            ReadConfig(config, defaults, &c, "shardlineSafetensorsImportConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SafetensorsImportOptions o;
    o.ignore_unknown_tensors = c.ignore_unknown_tensors != 0;
    return FromStatus(shardline::ImportSafetensors(*scheduler->scheduler, path, o,
                                                   absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_sync_module_states(shardlineComm_t comm, void* const* data,
                                               const size_t* counts,
                                               const shardlineDataType_t* dtypes, int num_tensors,
                                               const shardlineSyncConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(comm != nullptr, "shardline_sync_module_states: comm must not be NULL");
    SL_C_REQUIRE(num_tensors >= 0 && (num_tensors == 0 ||
                                      (data != nullptr && counts != nullptr && dtypes != nullptr)),
                 absl::StrCat("shardline_sync_module_states: ", num_tensors,
                              " tensors with data, counts or dtypes NULL"));
    shardlineSyncConfig_t c;
    const shardlineSyncConfig_t defaults = SHARDLINE_SYNC_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineSyncConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    std::vector<shardline::SyncTensor> tensors(static_cast<size_t>(num_tensors));
    for (int t = 0; t < num_tensors; ++t) {
      SL_C_REQUIRE(ToDType(dtypes[t], &tensors[t].dtype),
                   absl::StrCat("shardline_sync_module_states: tensor ", t, ": unknown dtype ",
                                static_cast<int>(dtypes[t])));
      tensors[t].data = data[t];
      tensors[t].count = counts[t];
    }
    shardline::SyncModuleStatesOptions o;
    o.root = c.root;
    o.bucket_bytes = c.bucket_bytes;
    return FromStatus(
        shardline::SyncModuleStates(*comm->comm, tensors, o, absl::Now() + Timeout(timeout_s)));
  });
}

}  // extern "C"
