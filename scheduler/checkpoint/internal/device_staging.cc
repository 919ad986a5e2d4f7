// Host copies of device memory for checkpoints (device_staging.h).

#include "scheduler/checkpoint/internal/device_staging.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "runtime/allocator.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"

namespace shardline::checkpoint_internal {

absl::Status AllGatherHostBytes(Communicator& comm, Stream& host_stream, const void* send,
                                void* recv, size_t per, const CollectiveOptions& options,
                                absl::Time deadline) {
  const Device device = comm.device();
  if (device.is_host()) {
    absl::StatusOr<Work> work = comm.AllGather(send, recv, per, DType::kU8, host_stream, options);
    return work.ok() ? work->Wait(deadline) : work.status();
  }
  const size_t all = per * static_cast<size_t>(comm.size());
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateStream(device, {.name = absl::StrCat(comm.name(), ".host bytes")}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Allocator> memory,
                      CreateCudaAllocator(device.index(), "checkpoint exchange"));
  SL_ASSIGN_OR_RETURN(Buffer in, memory->Allocate(std::max<size_t>(per, 1), *stream));
  SL_ASSIGN_OR_RETURN(Buffer out, memory->Allocate(std::max<size_t>(all, 1), *stream));
  SL_RETURN_IF_ERROR(EnqueueCopy(*stream, in.data(), send, per));
  absl::StatusOr<Work> work =
      comm.AllGather(in.data(), out.data(), per, DType::kU8, *stream, options);
  if (!work.ok()) return work.status();
  SL_RETURN_IF_ERROR(work->Wait(deadline));
  SL_RETURN_IF_ERROR(EnqueueCopy(*stream, recv, out.data(), all));
  return stream->Synchronize(deadline);
}

}  // namespace shardline::checkpoint_internal
