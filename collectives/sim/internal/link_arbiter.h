// File: collectives/sim/internal/link_arbiter.h
// -----------------------------------------------------------------------------
// Bandwidth sharing between the sim backend's collectives (private to collectives/sim/): flows
// occupy ports (a device's port on one link level), each port is split equally among the flows
// on it, and a flow progresses at the smallest share it gets on any of its ports. The flows are
// the timeline's (VirtualTimeline::sharing(), runtime/virtual_sharing.h: ports are resources of
// capacity 1 in the arbiter's own space), so on a host-memory machine a collective also takes
// its ranks' threads on their hosts' cores, beside the memory ops of the streams there. It also
// counts the bytes each device sent on each level.

#ifndef SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_
#define SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "collectives/sim/sim_communicator.h"
#include "runtime/virtual_sharing.h"
#include "runtime/virtual_time.h"

namespace shardline::sim_internal {

class LinkArbiter {
 public:
  explicit LinkArbiter(VirtualTimeline& timeline)
      : sharing_(timeline.sharing()), space_(sharing_.NewSpace()) {}

  // The port of `device` on link level `level` (0: intra_node, 1: inter_node).
  static int64_t Port(int device, int level) { return int64_t{device} * 2 + level; }

  // Starts a flow now (on the engine's thread): `seconds` of transfer at share 1 over `ports`
  // (distinct), and `host_threads` (host -> threads, each > 0) on the timeline's hosts. `done`
  // runs on the engine when it has moved them all. seconds > 0.
  // host_threads: host -> (threads counted there, threads in lock-step there).
  void Start(const std::vector<int64_t>& ports,
             const std::map<int, std::pair<int, int>>& host_threads, double seconds,
             absl::AnyInvocable<void() &&> done);

  // Traffic accounting (SimTrafficByDevice): `device` sent these bytes in one collective.
  void Count(int device, double intra_bytes, double inter_bytes);
  std::vector<SimLinkTraffic> Traffic() const;

 private:
  VirtualSharing& sharing_;
  const uint64_t space_;
  mutable std::mutex mu_;
  std::vector<SimLinkTraffic> traffic_;  // by device
};

}  // namespace shardline::sim_internal

#endif  // SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_
