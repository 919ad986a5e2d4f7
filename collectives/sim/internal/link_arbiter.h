// File: collectives/sim/internal/link_arbiter.h
// -----------------------------------------------------------------------------
// Bandwidth sharing between the sim backend's collectives (private to collectives/sim/): flows
// occupy ports (a device's port on one link level), each port is split equally among the flows
// on it, and a flow progresses at the smallest share it gets on any of its ports. Rates change
// only when a flow starts or ends; then the flows whose rate changed get a new end time. The
// engine's event order (time, then scheduling order) makes it deterministic. It also counts the
// bytes each device sent on each level.

#ifndef SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_
#define SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "collectives/sim/sim_communicator.h"
#include "runtime/virtual_time.h"

namespace shardline::sim_internal {

class LinkArbiter : public std::enable_shared_from_this<LinkArbiter> {
 public:
  explicit LinkArbiter(VirtualTimeline& timeline) : timeline_(timeline) {}

  // The port of `device` on link level `level` (0: intra_node, 1: inter_node).
  static int64_t Port(int device, int level) { return int64_t{device} * 2 + level; }

  // Starts a flow now (on the engine's thread): `seconds` of transfer at share 1 over `ports`
  // (distinct). `done` runs on the engine when it has moved them all. seconds > 0.
  void Start(std::vector<int64_t> ports, double seconds, absl::AnyInvocable<void() &&> done);

  // Flows in progress (tests).
  int active() const;

  // Traffic accounting (SimTrafficByDevice): `device` sent these bytes in one collective.
  void Count(int device, double intra_bytes, double inter_bytes);
  std::vector<SimLinkTraffic> Traffic() const;

 private:
  struct Flow {
    std::vector<int64_t> ports;
    double remaining_s = 0;             // at share 1
    double rate = 0;                    // current share
    std::optional<VirtualTimer> timer;  // its end, once it has a rate
    absl::AnyInvocable<void() &&> done;
  };

  // Moves every flow's progress to `now` at its current rate.
  void Advance(absl::Time now);
  // Recomputes every rate; flows whose rate changed get a new end time (`now` + remaining/rate).
  void Rebalance(absl::Time now);
  void End(uint64_t id);

  VirtualTimeline& timeline_;
  mutable std::mutex mu_;
  absl::Time last_ = absl::UnixEpoch();
  uint64_t next_id_ = 0;
  std::map<uint64_t, Flow> flows_;
  std::map<int64_t, int> users_;         // port -> flows on it
  std::vector<SimLinkTraffic> traffic_;  // by device
};

}  // namespace shardline::sim_internal

#endif  // SHARDLINE_COLLECTIVES_SIM_INTERNAL_LINK_ARBITER_H_
