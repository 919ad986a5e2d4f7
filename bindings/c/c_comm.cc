// File: bindings/c/c_comm.cc
// -----------------------------------------------------------------------------
// The C API's communicators (a process group from the launcher's environment, or ranks as
// threads) and their collectives, each returning a Work handle.

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "collectives/bootstrap.h"
#include "collectives/communicator.h"
#include "collectives/local/local_communicator.h"
#include "runtime/dtype.h"

namespace {

using shardline::DType;
using shardline::c_api::FromStatus;
using shardline::c_api::Guard;
using shardline::c_api::ReadConfig;
using shardline::c_api::Timeout;
using shardline::c_api::ToDType;
using shardline::c_api::ToOp;

shardlineResult_t Issue(absl::StatusOr<shardline::Work> work, shardlineWork_t* out) {
  if (!work.ok()) return FromStatus(work.status());
  *out = new shardlineWork_s{*std::move(work)};
  return shardlineSuccess;
}

static_assert(SHARDLINE_ANY_SOURCE == shardline::kAnySource);

}  // namespace

extern "C" {

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

shardlineResult_t shardline_send(shardlineComm_t comm, const void* data, size_t count,
                                 shardlineDataType_t dtype, int peer, uint64_t tag,
                                 shardlineStream_t stream, shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_send");
    return Issue(comm->comm->Send(data, count, dt, peer, *stream->stream, {.match_tag = tag}),
                 work);
  });
}

shardlineResult_t shardline_recv(shardlineComm_t comm, void* data, size_t count,
                                 shardlineDataType_t dtype, int peer, uint64_t tag,
                                 shardlineStream_t stream, shardlineWork_t* work) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_COLLECTIVE_ARGS("shardline_recv");
    return Issue(comm->comm->Recv(data, count, dt, peer, *stream->stream, {.match_tag = tag}),
                 work);
  });
}

shardlineResult_t shardline_work_source(shardlineWork_t work, int* source) {
  SL_C_REQUIRE(work != nullptr && source != nullptr, "shardline_work_source: NULL argument");
  *source = work->work.source();
  return shardlineSuccess;
}

shardlineResult_t shardline_work_destroy(shardlineWork_t work) {
  delete work;
  return shardlineSuccess;
}

}  // extern "C"
