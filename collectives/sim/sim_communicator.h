// File: collectives/sim/sim_communicator.h
// -----------------------------------------------------------------------------
// The `sim` backend: the ranks of a group are communicators on one VirtualTimeline
// (runtime/virtual_time.h), whose collectives take virtual time from a cost model. With it the
// real scheduler runs many ranks in one thread, deterministically, and its issue order, overlap
// and memory can be checked exactly.
//
//   VirtualTimeline timeline;
//   SL_ASSIGN_OR_RETURN(auto comms, CreateSimCommunicators(timeline, 4));
//   // rank r: comms[r]->AllGather(in_r, out_r, count, DType::kF32, *virtual_stream_r);
//   SL_RETURN_IF_ERROR(timeline.RunUntilIdle());
//
// Each collective "arrives" when its virtual stream reaches it (its start). Once every rank of
// the group has arrived, the fingerprints are compared (ranks that disagree fail on every rank
// with the API's MismatchError, at the last arrival, and move nothing); otherwise the collective
// completes on every rank at max(arrival) + cost, where the cost is a ring model of n ranks,
// latency L and bandwidth B (SimOptions), for `count` as the Communicator API defines it and
// elements of e bytes:
//
//   all_gather, reduce_scatter, all_to_all   (n-1) * (L + count*e / B)
//   all_reduce                               2(n-1) * (L + count*e / (n*B))
//   broadcast (a pipelined chain)            (n-1) * L + count*e / B
//   barrier (an all_reduce of nothing)       2(n-1) * L
//   any collective on one rank               0
//
// (SimCollectiveCost computes it.)
//
// With a topology (SimOptions::topology, collectives/sim/topology.h) the cost is the topology's
// instead: rank r of the group runs on device SimOptions::devices[r], the group's shape (nodes
// spanned, ranks per node) picks the algorithm and EstimateCollective gives its latency L and
// transfer time X; the collective completes at max(arrival) + L + (X stretched by contention).
// Splits and Dups keep their members' devices (a ProcessMesh's shard group inside a node and its
// replicate group across nodes get the shapes they have). Contention: each device has one port
// per link level (intra_node, inter_node); a collective occupies, during its transfer phase, the
// ports of its ranks' devices on the levels it sends bytes on. All groups created from one
// CreateSimCommunicators call (their splits and dups included) share the ports. The fair-share
// rule: at every start or end of a transfer phase, each port's bandwidth is split equally among
// the collectives occupying it, and a collective progresses at the smallest share it gets on any
// of its ports (1 / the most collectives on one of them); X is the time at share 1. So two
// identical collectives on the same ports that start their transfers together both end after
// L + 2X, and one that starts when another is half done gets share 1/2 until it ends. Without a
// topology there is no contention (the flat model above).
//
// With SimOptions::move_data and the timeline's run_ops, the
// data is moved, at the completion time, in host memory: reductions combine the ranks' inputs
// in rank order with ReduceMany (avg: then Scale by 1/n), exactly as the local backend does, so
// the results are bit-identical to it. Without them no memory is touched (phantom memory).
//
// Failures follow the API: a rank that never arrives makes the arrived ranks fail with
// DeadlineExceeded at arrival + timeout (virtual time: only if other work moves the clock that
// far; otherwise the driver reports the stall, naming the collective, the ranks that wait, the
// ranks whose streams have not reached it and the ranks that have not issued it). A failed or
// aborted collective aborts the whole group, as in the local backend.
//
// Point-to-point (Send, Recv; the rules in communicator.h): a send ends on its stream when it
// starts (its data copied into a message, when data moves) and its message arrives at the
// receiver one message later: L + count*e / B (SimCollectiveCost of kSend), or with a topology
// the topology's cost of one message between the two ranks' devices, whose transfer occupies
// both devices' ports like a collective's. A receive ends at max(its start, its message's
// arrival); from kAnySource it takes the earliest arrived message among each source's first of
// its tag. A receive whose message never comes fails with DeadlineExceeded at its start +
// timeout (as collectives do). Representative mode has no point-to-point (Unimplemented).
//
// Streams: only virtual streams of the group's timeline (InvalidArgument otherwise).
//
// Split and Dup: Split(0, rank) on every rank — what Dup() does — completes at once, without
// waiting for the other ranks, so one thread can Dup every rank's communicator in turn (see
// SimOptions::dup_without_rendezvous). Any other split is a rendezvous of the calling threads,
// as with the local backend: the ranks must call it from different threads, and it waits (in
// wall-clock time, until the deadline) for all of them. The new communicators share the
// timeline and the options.
//
// Representative mode (CreateRepresentativeSimCommunicator): where every rank of a group does
// the same thing at the same time (a symmetric placement), one rank can stand for all of them.
// The communicator has the group's size but only its own rank exists: a collective completes
// when that rank arrives (the others are assumed to arrive at the same moment, with the same
// fingerprint), at arrival + the cost of the whole group on its placement (SimOptions::devices
// lists every rank's device). Contention counts only the representative's own ports: by symmetry
// every other device's ports carry the same number of collectives at the same times, so the
// share it gets is the share every member gets. Every split of the group
// CreateRepresentativeSimCommunicator made (a Dup included) takes the ranks' (color, key) from
// SimOptions::split_call instead of a rendezvous; the groups of those splits can only Dup
// (another split is Unimplemented). No data moves (move_data must be false).
// SimTrafficByDevice reports the representative's device only.
//
// Lifetimes: the timeline must outlive the communicators.

#ifndef SHARDLINE_COLLECTIVES_SIM_SIM_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_SIM_SIM_COMMUNICATOR_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/sim/topology.h"
#include "runtime/virtual_time.h"

namespace shardline {

struct SimOptions {
  std::string name = "world";
  // Per ring step. Must not be negative.
  absl::Duration latency = absl::Microseconds(5);
  // Per link. Must be positive (infinity: only latency counts).
  double bandwidth_bytes_per_s = 10e9;
  // Move the data (host memory) when a collective completes; false: touch no memory.
  bool move_data = true;
  // Unset (zero): SHARDLINE_TIMEOUT_S. Virtual time.
  absl::Duration timeout = absl::ZeroDuration();
  // Split(0, own rank) — what Dup() calls — completes at once, assuming every rank makes the same
  // call, so that one thread can Dup every rank's communicator in turn. General splits from
  // threads in which some rank's call has that form (ProcessMesh: the ranks of the first row and
  // of the first column) need false: then every split is a rendezvous. A rank that makes another
  // call where its peers' were taken for Dup gets InvalidArgument saying so, and the
  // communicator those peers got fails its collectives with that error.
  bool dup_without_rendezvous = true;
  // Optional: the simulated machine. Collectives then take its cost model's time (latency and
  // bandwidth_bytes_per_s above are not used) and share links (the header comment).
  std::shared_ptr<const Topology> topology;
  // With a topology: the device of each rank (node * devices_per_node + local index), one per
  // rank, distinct; empty: rank r on device r.
  std::vector<int> devices;
  // Representative mode only: the (color, key) that rank `rank` of the created group passes to
  // its split number `split` (0, 1, ... in the order the group's ranks call Split). Must agree
  // with the representative's own call.
  std::function<std::pair<int, int>(uint64_t split, int rank)> split_call;
};

// `size` communicators forming one group on `timeline`; element r is rank r. InvalidArgument if
// size < 1, an option is out of range (with a topology: it is invalid, devices has another size
// than `size`, or a device is out of range or repeated), or the timeout knob is invalid.
absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateSimCommunicators(
    VirtualTimeline& timeline, int size, const SimOptions& options = {});

// Representative mode (the header comment): rank `rank` of a group of `size`, alone.
// InvalidArgument as CreateSimCommunicators, or if rank is out of range, move_data is set or
// split_call is missing.
absl::StatusOr<std::shared_ptr<Communicator>> CreateRepresentativeSimCommunicator(
    VirtualTimeline& timeline, int size, int rank, const SimOptions& options);

// With a topology: what each device has sent on each link level so far, in the collectives that
// completed their rendezvous (CollectiveCost::intra_bytes / inter_bytes per rank), over every
// group of the simulation that `comm` belongs to (its CreateSimCommunicators call, splits and
// dups included). Indexed by device id, up to the highest device that sent anything.
struct SimLinkTraffic {
  double intra_node_bytes = 0;
  double inter_node_bytes = 0;
  int64_t collectives = 0;  // collectives of more than one rank it took part in, messages sent
};
// Empty if `comm` is not a sim communicator or its simulation has no topology.
std::vector<SimLinkTraffic> SimTrafficByDevice(const Communicator& comm);

// The modelled duration of one collective (the table above): `count` as the Communicator API
// defines it for `kind`, on `size` ranks.
absl::Duration SimCollectiveCost(CollectiveKind kind, size_t count, DType dtype, int size,
                                 const SimOptions& options);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_SIM_SIM_COMMUNICATOR_H_
