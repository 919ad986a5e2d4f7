// File: runtime/virtual_sharing.h
// -----------------------------------------------------------------------------
// Capacity sharing between the concurrent flows of one VirtualTimeline (runtime/virtual_time.h):
// the sim backend's collectives on link ports (collectives/sim/) and, on host-memory machines,
// every memory-moving op of every simulated rank on a host's cores.
//
// A resource has a capacity (a link port: 1; a host: its cores). A flow is `seconds` of work at
// full speed and a demand on some resources (a collective on a host: one thread per rank it has
// there; a stream's memory op: one). The rule, processor sharing: a resource whose flows demand
// `load` in all gives each unit of demand min(1, capacity / load) of its full speed, and a flow
// progresses at the smallest share it gets on any of its resources. So k single-thread flows on
// a host of c cores each take max(1, k / c) times their time alone, and with capacity 1 and
// demand 1 a port is split equally among its flows. A demand may be in lock-step
// (VirtualDemand::lockstep = r > 1: r threads that progress only while all of them run, as a
// collective's ranks on one host): its share there is then (min(1, capacity / load))^r. Rates
// change only when a flow starts or ends; then the flows whose rate changed get a new end time. The
// engine's event order (time, then scheduling order) makes it deterministic. Capacity left idle by
// a flow that is held back on another resource is not handed to the others.
//
// Resources are (space, id) pairs. Space 0 holds the timeline's hosts (Host(h)), whose capacity
// is VirtualTimelineOptions::host_cores; every other space comes from NewSpace() (a user's own
// resources, capacity 1 unless SetCapacity says otherwise), so two users never share by
// accident.
//
// Thread safety: Start and SetCapacity run on the engine's thread (inside an op's start, a
// callback); the accessors may be called from any thread.

#ifndef SHARDLINE_RUNTIME_VIRTUAL_SHARING_H_
#define SHARDLINE_RUNTIME_VIRTUAL_SHARING_H_

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "runtime/virtual_time.h"

namespace shardline {

struct VirtualResource {
  uint64_t space = 0;
  int64_t id = 0;
  auto operator<=>(const VirtualResource&) const = default;
};

struct VirtualDemand {
  VirtualResource resource;
  double amount = 1;  // > 0: the capacity the flow uses at full speed (threads, ports)
  // >= 1: how many threads of the flow must run at once for it to progress (a collective's
  // ranks on a host, in lock-step): its share on this resource is share^lockstep.
  double lockstep = 1;
};

class VirtualSharing : public std::enable_shared_from_this<VirtualSharing> {
 public:
  // host_cores: the capacity of every host (space 0); > 0.
  VirtualSharing(VirtualTimeline& timeline, double host_cores);

  static VirtualResource Host(int host) { return {0, host}; }

  // A fresh space (1, 2, ...).
  uint64_t NewSpace();
  // The capacity of `resource` (> 0, checked) from now on; flows in progress are re-rated.
  void SetCapacity(VirtualResource resource, double capacity);
  double Capacity(VirtualResource resource) const;

  // Starts a flow now: `seconds` (> 0) at full speed, with `demands` (distinct resources, amounts
  // > 0; none: it runs at full speed). `done` runs on the engine when its work is done.
  void Start(std::vector<VirtualDemand> demands, double seconds,
             absl::AnyInvocable<void() &&> done);

  // Flows in progress; the demand in progress on `resource` (tests).
  int active() const;
  double load(VirtualResource resource) const;

 private:
  struct Flow {
    std::vector<VirtualDemand> demands;
    double remaining_s = 0;             // at full speed
    double rate = 0;                    // current share
    std::optional<VirtualTimer> timer;  // its end, once it has a rate
    absl::AnyInvocable<void() &&> done;
  };

  double CapacityLocked(VirtualResource resource) const;
  // Moves every flow's progress to `now` at its current rate.
  void Advance(absl::Time now);
  // Recomputes every rate; flows whose rate changed get a new end time (`now` + remaining/rate).
  void Rebalance(absl::Time now);
  void End(uint64_t id);

  VirtualTimeline& timeline_;
  const double host_cores_;
  mutable std::mutex mu_;
  absl::Time last_ = absl::UnixEpoch();
  uint64_t next_id_ = 0;
  uint64_t next_space_ = 1;
  std::map<uint64_t, Flow> flows_;
  std::map<VirtualResource, double> load_;      // resource -> demand on it
  std::map<VirtualResource, double> capacity_;  // set explicitly
};

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_VIRTUAL_SHARING_H_
