// Fair-share bandwidth between overlapping sim collectives
// (collectives/sim/internal/link_arbiter.h).

#include "collectives/sim/internal/link_arbiter.h"

#include <algorithm>
#include <utility>

#include "runtime/check.h"

namespace shardline::sim_internal {

void LinkArbiter::Advance(absl::Time now) {
  const double elapsed = absl::ToDoubleSeconds(now - last_);
  if (elapsed > 0) {
    for (auto& [id, flow] : flows_) flow.remaining_s -= elapsed * flow.rate;
  }
  last_ = std::max(last_, now);
}

void LinkArbiter::Rebalance(absl::Time now) {
  for (auto& [id, flow] : flows_) {
    int most = 1;
    for (const int64_t port : flow.ports) most = std::max(most, users_[port]);
    const double rate = 1.0 / most;
    if (rate == flow.rate) continue;
    flow.rate = rate;
    if (flow.timer.has_value()) timeline_.Cancel(*flow.timer);
    const double left = std::max(0.0, flow.remaining_s) / rate;
    flow.timer = timeline_.ScheduleAt(now + absl::Seconds(left),
                                      [self = shared_from_this(), id = id] { self->End(id); });
  }
}

void LinkArbiter::Start(std::vector<int64_t> ports, double seconds,
                        absl::AnyInvocable<void() &&> done) {
  SL_CHECK(seconds > 0);
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = timeline_.Now();
  Advance(now);
  for (const int64_t port : ports) ++users_[port];
  Flow flow;
  flow.ports = std::move(ports);
  flow.remaining_s = seconds;
  flow.done = std::move(done);
  flows_.emplace(next_id_++, std::move(flow));
  Rebalance(now);
}

void LinkArbiter::End(uint64_t id) {
  absl::AnyInvocable<void() &&> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = flows_.find(id);
    SL_CHECK(it != flows_.end());
    const absl::Time now = timeline_.Now();
    Advance(now);
    for (const int64_t port : it->second.ports) {
      if (--users_[port] == 0) users_.erase(port);
    }
    done = std::move(it->second.done);
    flows_.erase(it);
    Rebalance(now);
  }
  std::move(done)();
}

void LinkArbiter::Count(int device, double intra_bytes, double inter_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (traffic_.size() <= static_cast<size_t>(device)) traffic_.resize(device + 1);
  SimLinkTraffic& t = traffic_[device];
  t.intra_node_bytes += intra_bytes;
  t.inter_node_bytes += inter_bytes;
  ++t.collectives;
}

std::vector<SimLinkTraffic> LinkArbiter::Traffic() const {
  std::lock_guard<std::mutex> lock(mu_);
  return traffic_;
}

int LinkArbiter::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(flows_.size());
}

}  // namespace shardline::sim_internal
