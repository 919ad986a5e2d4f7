// File: collectives/ucx/internal/ucx_algorithms.h
// -----------------------------------------------------------------------------
// The data movement of the ucx backend once the fingerprints agree (backend-private). Each
// function posts its requests on `run`, drives them to completion and leaves the result in the
// op's output.
//
//   small (per-peer payload <= SHARDLINE_UCX_SMALL_BYTES): the payload travelled with the
//     fingerprints into staging buffers, or sits in the peers' mailboxes (mailbox.h);
//     FinishSmall copies / reduces it into the output.
//   all_gather, all_to_all, broadcast: direct — every peer's data is received straight into its
//     slice of the output (intra-node: a single CMA copy by the receiver, in place: no copy-in).
//   reduce_scatter: direct and pipelined — chunk c of this rank's block of every peer's input is
//     reduced (in rank order, so results match the local backend bit for bit) straight into the
//     output, with non-temporal stores (in place from 16 MiB blocks). A peer on this host
//     offers its block whole (one descriptor, one fin) and this rank reads it chunk by chunk out
//     of its mapping (or with process_vm_readv); other peers send chunks into a window of
//     scratch slots, the next ones in flight while one is reduced.
//   all_reduce: the same reduce-scatter over n nearly equal blocks, each reduced chunk sent to
//     every peer at once, received straight into their outputs; every peer's block arrives in
//     chunks (a window of them in flight), with plain stores.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_ALGORITHMS_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_ALGORITHMS_H_

#include <vector>

#include "absl/status/status.h"
#include "collectives/ucx/internal/ucx_collective.h"

namespace shardline::ucx_internal {

// Bytes rank `from` sends to rank `to` in the small protocol of run's op (0: no message).
size_t SmallPayloadBytes(const CollectiveRun& run, int from, int to);
// Where rank `from`'s small payload to `to` starts, on rank `from`.
const void* SmallPayload(const CollectiveRun& run, int to);
// Whether the op uses the small protocol (the same answer on every rank that agrees on it).
bool IsSmall(const CollectiveRun& run);
// The small payload of run's op into this rank's mailbox slot (`out`, room for size() blocks):
// what goes to peer p (SmallPayload) at block p if the op sends each peer its own block, at the
// start if it sends everyone the same.
void FillMailbox(const CollectiveRun& run, uint8_t* out);
// Where, in the mailbox payload `box` of rank `from`, this rank's part starts (null if `from`
// sends this rank nothing).
const uint8_t* MailboxPayloadFor(const CollectiveRun& run, const uint8_t* box, int from);
// Writes the output from the staged payloads (staging[p]: what rank p sent; null for self).
absl::Status FinishSmall(CollectiveRun& run, const std::vector<const uint8_t*>& staging);

absl::Status LargeAllGather(CollectiveRun& run);
absl::Status LargeAllToAll(CollectiveRun& run);
absl::Status LargeBroadcast(CollectiveRun& run);
absl::Status LargeReduceScatter(CollectiveRun& run);
absl::Status LargeAllReduce(CollectiveRun& run);

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_ALGORITHMS_H_
