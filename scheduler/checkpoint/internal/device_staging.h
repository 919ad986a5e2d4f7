// File: scheduler/checkpoint/internal/device_staging.h
// -----------------------------------------------------------------------------
// Checkpoints and full-weight files of a scheduler on a GPU: the files are read and written from
// host memory, so device memory goes through host copies (runtime/stream_ops.h's CopyBlocking),
// and the few host bytes the ranks exchange (outcomes, fingerprints) go through the device when
// the world moves device memory (nccl, ucx staged). Blocking calls: checkpoints run between
// steps.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_DEVICE_STAGING_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_DEVICE_STAGING_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace shardline::checkpoint_internal {

// The all-gather of `per` host bytes of every rank (`send` -> `recv`, rank-major) over `comm`:
// on `host_stream` for a host communicator; for a device communicator through its device's memory
// on a stream of its own. Blocks until done or `deadline`.
absl::Status AllGatherHostBytes(Communicator& comm, Stream& host_stream, const void* send,
                                void* recv, size_t per, const CollectiveOptions& options,
                                absl::Time deadline);

}  // namespace shardline::checkpoint_internal

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_INTERNAL_DEVICE_STAGING_H_
