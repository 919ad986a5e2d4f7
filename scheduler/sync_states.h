// File: scheduler/sync_states.h
// -----------------------------------------------------------------------------
// SyncModuleStates: FSDP's sync_module_states. A framework that initialises its parameters (and
// buffers) on one rank, or with a different random seed per rank, broadcasts the root's values to
// every rank before handing them to the scheduler (Scheduler::RegisterUnit,
// FlatParameter::SetShardFromTensors), so that every rank shards the same model.
//
//   std::vector<SyncTensor> tensors = {{.data = w, .count = 4096, .dtype = DType::kF32},
//                                      {.data = b, .count = 64, .dtype = DType::kBF16}};
//   SL_RETURN_IF_ERROR(SyncModuleStates(*world, tensors, {.bucket_bytes = 16 << 20}, deadline));
//
// The tensors are treated as one stream of bytes, in the given order, cut into buckets of at most
// bucket_bytes: one broadcast per bucket, of the bucket's bytes. A bucket that lies inside one
// tensor is broadcast in place; one that spans several is packed into a bucket buffer on the
// root and unpacked from it elsewhere. So memory beyond the tensors is at most one bucket, and a
// tensor larger than a bucket takes several broadcasts. Before the first broadcast the ranks
// compare their lists (an all-gather of the number of tensors, the total bytes and a hash of the
// sizes): a rank whose list differs from the root's fails every rank with InvalidArgument naming
// it, instead of a broadcast of the wrong size.
//
// Collective over `comm`: every rank calls it with tensors of the same sizes. Blocks the calling
// thread; every wait is bounded by `deadline` (DeadlineExceeded, or the communicator's error for a
// dead peer). Host memory only (the communicator must move host memory: local, ucx). Errors:
// InvalidArgument for a null pointer with count > 0, bucket_bytes 0, a root outside the group, an
// invalid dtype.

#ifndef SHARDLINE_SCHEDULER_SYNC_STATES_H_
#define SHARDLINE_SCHEDULER_SYNC_STATES_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"

namespace shardline {

// A tensor's memory: `count` elements of `dtype` at `data` (count * DTypeSize(dtype) bytes).
struct SyncTensor {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kU8;
};

struct SyncModuleStatesOptions {
  int root = 0;  // the rank whose values every rank receives
  // The most bytes one broadcast moves (>= 1). 25 MiB, as PyTorch's DDP and FSDP use.
  size_t bucket_bytes = size_t{25} << 20;
  // The caller stream the broadcasts run on. Null: a caller stream made for the call.
  Stream* stream = nullptr;
  // The flight recorder's tag of the broadcasts.
  std::string tag = "sync_module_states";
};

// Broadcasts the root's tensors to every rank of `comm` (see the header comment).
absl::Status SyncModuleStates(Communicator& comm, absl::Span<const SyncTensor> tensors,
                              const SyncModuleStatesOptions& options, absl::Time deadline);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_SYNC_STATES_H_
