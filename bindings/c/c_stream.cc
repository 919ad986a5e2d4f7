// File: bindings/c/c_stream.cc
// -----------------------------------------------------------------------------
// The C API's streams and events: shardline's own (host, caller), a framework's wrapped CUDA
// stream and event, and a framework's stream of host work and event through callbacks
// (runtime/callback_stream.h).

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "runtime/callback_stream.h"
#include "runtime/stream.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

using shardline::c_api::Fail;
using shardline::c_api::FromStatus;
using shardline::c_api::Guard;
using shardline::c_api::ReadConfig;
using shardline::c_api::ResultOf;
using shardline::c_api::Timeout;
#ifdef SHARDLINE_WITH_CUDA
using shardline::c_api::FromDeviceStatus;
#endif

extern "C" {

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
      callback(user, ResultOf(status));
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

}  // extern "C"
