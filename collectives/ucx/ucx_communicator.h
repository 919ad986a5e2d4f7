// File: collectives/ucx/ucx_communicator.h
// -----------------------------------------------------------------------------
// The `ucx` backend: collectives over host memory between processes, within a machine and across
// machines (TCP, InfiniBand — whatever UCX finds). It is the default backend of
// InitProcessGroup() and what runs on laptops and CPU clusters.
//
//   SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> world,
//                       CreateUcxCommunicator({.rank = r, .size = n, .store = store}));
//
// Every rank creates its communicator with the same `name` over a store all ranks share; the
// ranks exchange UCX worker addresses under "<name>/ucx/<epoch>/..." keys and connect to each
// other. The epoch counts each rank's creations under `name`, so a communicator re-created under
// the same name (after the old one was destroyed or aborted) never reads its keys. Creation blocks
// until every rank has published its address or the timeout passes (DeadlineExceeded naming the
// missing ranks), then exchanges one handshake message with every peer; a rank whose
// SHARDLINE_UCX_CHUNK_BYTES, SHARDLINE_UCX_SMALL_BYTES or SHARDLINE_UCX_WINDOW differs from
// rank 0's fails creation on every rank (InvalidArgument naming the knob, both ranks and both
// values).
//
// Algorithms (docs/collectives.md has the numbers): every collective starts with an exchange of
// fingerprints between all ranks, so mismatched collectives fail on every rank before any user
// memory is written. Small payloads ride along with the fingerprints (one message round);
// large ones are received straight into the output (all-gather, all-to-all, broadcast) or
// reduced chunk by chunk in rank order, overlapping the next chunk's transfer (reduce-scatter;
// all-reduce = reduce-scatter + all-gather). Results are bit-identical to the local backend's.
//
// How large messages move between ranks on one machine (peers on other machines: UCX's network
// transports):
//   * the sender's buffer is shareable memory (runtime/shared_memory.h: the large blocks of
//     CreateHostAllocatorForTransfers' allocator, which for this backend is shareable while
//     same-host peers map): the receiver maps the sender's arena once and copies out of its
//     mapping with memcpy; reductions read their inputs straight out of the peers' mappings
//     (borrowed chunks, no copy at all);
//   * private memory, or SHARDLINE_UCX_MAP=0: one process_vm_readv copy out of the sender's
//     memory;
//   * SHARDLINE_UCX_CMA=0 (or peers that may not read each other's memory): UCX's shared-memory
//     transports (two copies per byte).
//
// Failures: a peer that dies (even in the middle of a read of its memory) is an error on every
// survivor (Unavailable naming the peer) within a fraction of a second on the same machine and
// through UCX's keepalive across machines; a rank that does not show up is DeadlineExceeded
// naming it; an error on one rank is sent to every peer, whose pending collectives fail with it.
// Destroying the communicator never hangs.
//
// Collectives run in the order they were issued, even when issued on different streams (an
// all-gather on a gather stream and a reduce-scatter on a reduce stream of one communicator).
//
// Knobs (docs/collectives.md): SHARDLINE_UCX_CHUNK_BYTES, SHARDLINE_UCX_SMALL_BYTES,
// SHARDLINE_UCX_WINDOW (the same on every rank), SHARDLINE_UCX_SPIN_US, SHARDLINE_UCX_CMA,
// SHARDLINE_UCX_MAP, SHARDLINE_UCX_SHM, SHARDLINE_HOST_SHAREABLE_BYTES and
// SHARDLINE_HOST_SHAREABLE_ARENA_BYTES (shareable allocations and arenas); UCX's own UCX_*
// variables apply as usual.
//
// RegisterMemory reports how the same-host peers read a range: kMapped for shareable memory,
// kProcessRead for private memory (nothing can make it mappable), kTransport where the peers
// may not read this process (or none is on this host), kAny for a group of one.

#ifndef SHARDLINE_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"

namespace shardline {

struct UcxOptions {
  int rank = 0;
  int size = 1;
  // Shared by all ranks; the communicator keeps a reference (subgroups from Split use it too).
  std::shared_ptr<Store> store;
  // The same on every rank; prefixes the store keys and appears in messages.
  std::string name = "world";
  // Bound on creation and the default of every collective. Unset (zero): SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
};

// This rank's communicator of the group. InvalidArgument for a bad rank, size or missing
// store; DeadlineExceeded if the peers do not publish their addresses in time; Internal if UCX
// cannot be initialised.
absl::StatusOr<std::shared_ptr<Communicator>> CreateUcxCommunicator(const UcxOptions& options);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_
