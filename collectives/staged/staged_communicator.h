// File: collectives/staged/staged_communicator.h
// -----------------------------------------------------------------------------
// A host communicator (ucx) that moves CUDA memory, staged through pinned host memory: for ranks
// that share a GPU (NCCL refuses two ranks on one device: tests, small jobs), as gloo does for
// CUDA tensors. InitProcessGroup / CreateCommunicator build one for backend "ucx" with a CUDA
// device:
//
//   SL_ASSIGN_OR_RETURN(ProcessGroup group,
//                       InitProcessGroup({.backend = "ucx", .device = Device::Cuda(0)}));
//
// It is a Communicator of device cuda:N (device(); backend() is the host communicator's) and
// takes what the nccl backend takes: memory of cuda:N (or managed memory) on CUDA streams of that
// device, a framework's wrapped stream too. Each collective, on its stream:
//   1. copies its input into a pinned staging block (from a stream-ordered pool, so nothing waits
//      on the host for memory),
//   2. runs the host communicator's collective on the staging blocks, on a host stream of its own
//      that waits for that copy (no host function occupies CUDA's callback thread),
//   3. makes the CUDA stream wait for that collective on the device (a host event: see
//      cuda_stream.h), and copies the result back into the output.
// The caller's stream does not block the host at any step; work enqueued on it after the call
// sees the output. Collectives run in issue order across the caller's streams (communicator.h),
// and a collective's copy-in starts only after the previous one's copy-out.
//
// Memory kinds are detected per buffer (cudaPointerGetAttributes): host memory (pageable or
// pinned), memory of another device, or a host buffer beside a device one is InvalidArgument
// naming the buffer and its kind, before anything is enqueued.
//
// Failures are the host communicator's: its errors (a dead peer, a mismatch) fail this
// communicator's collective with the same status, and aborting either aborts both. Split and Dup
// split the host communicator and stage the result on the same device; Shrink is Unimplemented;
// point-to-point works between known peers (no kAnySource).
//
// Defined only with SHARDLINE_WITH_CUDA.

#ifndef SHARDLINE_COLLECTIVES_STAGED_STAGED_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_STAGED_STAGED_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"

namespace shardline {

// `host` (a host-memory communicator: ucx, local) moving the memory of cuda:`device`.
// InvalidArgument if `host` is null or not a host communicator; Unavailable if cuda:`device`
// cannot be used (no GPU, no driver, an index out of range).
absl::StatusOr<std::shared_ptr<Communicator>> CreateStagedCommunicator(
    std::shared_ptr<Communicator> host, int device);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STAGED_STAGED_COMMUNICATOR_H_
