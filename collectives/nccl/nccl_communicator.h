// File: collectives/nccl/nccl_communicator.h
// -----------------------------------------------------------------------------
// The `nccl` backend: collectives over CUDA device memory, enqueued on the caller's CUDA stream
// (built with SHARDLINE_WITH_CUDA). One rank per GPU, in one process per GPU or as threads of one
// process (each on its own device).
//
//   SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> world,
//                       CreateNcclCommunicator({.rank = r, .size = n, .store = store,
//                                               .device = local_rank}));
//   SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, CreateStream(Device::Cuda(local_rank)));
//   SL_ASSIGN_OR_RETURN(Work work, world->AllGather(shard, full, count, DType::kBF16, *stream));
//
// Creation: rank 0 draws the NCCL unique id and publishes it under "<name>/nccl/unique_id" in the
// store; the others read it (bounded by the timeout). Every rank then initialises a non-blocking
// NCCL communicator on `device` and polls it until it is ready, fails, or the timeout passes
// (then it is aborted: DeadlineExceeded; NCCL cannot tell which ranks are missing). A `name` must
// be used once per store.
//
// Collectives: issued on the caller's CUDA stream, which must be a stream of the communicator's
// device: one of ours (CreateStream(Device::Cuda(device))) or a framework's wrapped with
// WrapCudaStream (runtime/cuda/cuda_stream.h; the check looks only at the device and
// native_handle()). A host stream or another device's stream is InvalidArgument before anything
// is enqueued. Buffers must be memory of that device (or managed
// memory); a host pointer or another device's memory is InvalidArgument, also found before
// anything is enqueued (the communicator stays usable). Every dtype and op of communicator.h maps
// onto NCCL's own (avg is ncclAvg; integer averages truncate); all-to-all is grouped
// ncclSend/ncclRecv; a barrier is a one-element all-reduce on an internal device buffer. A
// communicator of one rank copies instead (NCCL before 2.29.7 leaves the tail of a one-rank avg
// unwritten: NVIDIA/nccl#1950).
// The call returns once NCCL has enqueued the work: the host does not wait for the data.
//
// Split() is ncclCommSplit (non-blocking, polled like creation): no store traffic, and the new
// communicator shares the parent's device and timeout.
//
// Failures. A watchdog thread per communicator polls, while collectives are in flight, NCCL's
// asynchronous error state and the deadline of every collective (its timeout counts from the
// moment it starts on its stream). An NCCL error (Unavailable for a dead peer or network,
// Internal otherwise, with NCCL's message) or a missed deadline (DeadlineExceeded; NCCL cannot
// tell which ranks are missing) aborts the communicator: ncclCommAbort stops its kernels, so no
// stream stays blocked, and the Status is what Communicator::status() returns. Every collective
// is followed on its stream by a tiny host function that fails the stream with that Status if
// the communicator was aborted by then, so Work::Wait, events recorded later and streams that
// wait on the Work report the failure instead of a silent OK (stream.h's poisoning). A
// communicator aborted on one rank is not aborted on the others by NCCL: they fail at their own
// deadline, or earlier when NCCL notices the lost peer.
//
// Point-to-point (Send, Recv): ncclSend and ncclRecv on the caller's stream, each its own NCCL
// call. NCCL buffers nothing: a send completes when its receive has taken the data, so two ranks
// that both send first on one stream wait for each other until the deadline (put the receive
// first, or on another stream). NCCL matches the messages between two ranks in the order they
// were issued and has no tags (a tag other than 0 is InvalidArgument) and no receive from any
// rank (Unimplemented); a receive of another size than its send is not detected.
//
// Mismatched collectives (different kinds, counts, dtypes, roots or order across ranks) are not
// detected by NCCL: they hang until the deadline or corrupt memory.
// SHARDLINE_NCCL_CHECK_FINGERPRINTS=1 makes every collective first all-gather the ranks'
// fingerprints and compare them on the host, failing on every rank with the API's mismatch error
// (InvalidArgument naming both ranks). It synchronises the host with the stream before each
// collective, which removes all overlap of issue and execution: a debugging aid, off by default.
//
// Destruction: a healthy communicator is finalized (ncclCommFinalize, waiting at most the timeout
// for its collectives to drain) and destroyed; an aborted one is already gone.
//
// Knobs: SHARDLINE_NCCL_CHECK_FINGERPRINTS, SHARDLINE_NCCL_WATCHDOG_MS,
// SHARDLINE_NCCL_STREAM_STATUS; NCCL's own NCCL_* variables apply as usual.

#ifndef SHARDLINE_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"

namespace shardline {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  // Shared by all ranks; used only at creation (to pass the unique id).
  std::shared_ptr<Store> store;
  // The CUDA ordinal whose memory this rank's collectives move.
  int device = 0;
  // The same on every rank; prefixes the store key and appears in messages.
  std::string name = "world";
  // Bound on creation and the default of every collective. Unset (zero): SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
};

// This rank's communicator of the group. InvalidArgument for a bad rank, size, device, timeout
// or a missing store; Unavailable if there is no usable CUDA device or cuda:`device` does not
// exist ("cuda:3 does not exist (2 devices)"); DeadlineExceeded if the unique id or the peers do
// not arrive in time; Internal/Unavailable with NCCL's message if NCCL fails.
absl::StatusOr<std::shared_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_
