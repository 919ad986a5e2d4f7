// Fair-share bandwidth between overlapping sim collectives
// (collectives/sim/internal/link_arbiter.h), on the timeline's capacity sharing.

#include "collectives/sim/internal/link_arbiter.h"

#include <algorithm>
#include <utility>

#include "runtime/check.h"

namespace shardline::sim_internal {

void LinkArbiter::Start(const std::vector<int64_t>& ports,
                        const std::map<int, std::pair<int, int>>& host_threads, double seconds,
                        absl::AnyInvocable<void() &&> done) {
  std::vector<VirtualDemand> demands;
  demands.reserve(ports.size() + host_threads.size());
  for (const int64_t port : ports) demands.push_back({{space_, port}, 1.0});
  for (const auto& [host, threads] : host_threads) {
    demands.push_back({VirtualSharing::Host(host), static_cast<double>(threads.first),
                       static_cast<double>(threads.second)});
  }
  sharing_.Start(std::move(demands), seconds, std::move(done));
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

}  // namespace shardline::sim_internal
