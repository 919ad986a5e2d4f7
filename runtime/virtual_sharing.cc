// Processor sharing between the flows of a virtual timeline (runtime/virtual_sharing.h).

#include "runtime/virtual_sharing.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "runtime/check.h"

namespace shardline {

VirtualSharing::VirtualSharing(VirtualTimeline& timeline, double host_cores)
    : timeline_(timeline), host_cores_(host_cores) {
  SL_CHECK(host_cores > 0);
}

uint64_t VirtualSharing::NewSpace() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_space_++;
}

double VirtualSharing::CapacityLocked(VirtualResource resource) const {
  if (auto it = capacity_.find(resource); it != capacity_.end()) return it->second;
  return resource.space == 0 ? host_cores_ : 1.0;
}

double VirtualSharing::Capacity(VirtualResource resource) const {
  std::lock_guard<std::mutex> lock(mu_);
  return CapacityLocked(resource);
}

void VirtualSharing::SetCapacity(VirtualResource resource, double capacity) {
  SL_CHECK(capacity > 0);
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = timeline_.Now();
  Advance(now);
  capacity_[resource] = capacity;
  Rebalance(now);
}

void VirtualSharing::Advance(absl::Time now) {
  const double elapsed = absl::ToDoubleSeconds(now - last_);
  if (elapsed > 0) {
    for (auto& [id, flow] : flows_) flow.remaining_s -= elapsed * flow.rate;
  }
  last_ = std::max(last_, now);
}

void VirtualSharing::Rebalance(absl::Time now) {
  for (auto& [id, flow] : flows_) {
    double rate = 1.0;
    for (const VirtualDemand& d : flow.demands) {
      const double load = load_[d.resource];
      const double capacity = CapacityLocked(d.resource);
      // Written as a division of capacity by load so that ports (capacity 1, demand 1 each) get
      // exactly 1 / flows, as the link arbiter always had.
      if (load > capacity) {
        const double share = capacity / load;
        rate = std::min(rate, d.lockstep > 1 ? std::pow(share, d.lockstep) : share);
      }
    }
    if (rate == flow.rate) continue;
    flow.rate = rate;
    if (flow.timer.has_value()) timeline_.Cancel(*flow.timer);
    const double left = std::max(0.0, flow.remaining_s) / rate;
    flow.timer = timeline_.ScheduleAt(now + absl::Seconds(left),
                                      [self = shared_from_this(), id = id] { self->End(id); });
  }
}

void VirtualSharing::Start(std::vector<VirtualDemand> demands, double seconds,
                           absl::AnyInvocable<void() &&> done) {
  SL_CHECK(seconds > 0);
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = timeline_.Now();
  Advance(now);
  for (const VirtualDemand& d : demands) {
    SL_CHECK(d.amount > 0);
    load_[d.resource] += d.amount;
  }
  Flow flow;
  flow.demands = std::move(demands);
  flow.remaining_s = seconds;
  flow.done = std::move(done);
  flows_.emplace(next_id_++, std::move(flow));
  Rebalance(now);
}

void VirtualSharing::End(uint64_t id) {
  absl::AnyInvocable<void() &&> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = flows_.find(id);
    SL_CHECK(it != flows_.end());
    const absl::Time now = timeline_.Now();
    Advance(now);
    for (const VirtualDemand& d : it->second.demands) {
      auto l = load_.find(d.resource);
      l->second -= d.amount;
      // Sums of small integers are exact; anything below half the smallest demand is rounding.
      if (l->second < 1e-9) load_.erase(l);
    }
    done = std::move(it->second.done);
    flows_.erase(it);
    Rebalance(now);
  }
  std::move(done)();
}

int VirtualSharing::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(flows_.size());
}

double VirtualSharing::load(VirtualResource resource) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = load_.find(resource);
  return it == load_.end() ? 0.0 : it->second;
}

}  // namespace shardline
