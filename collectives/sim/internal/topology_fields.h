// File: collectives/sim/internal/topology_fields.h
// -----------------------------------------------------------------------------
// What the topology's two sources share (collectives/sim/topology.cc: validation and the cost
// model; topology_json.cc: the JSON form): the unit conversions, the collectives and algorithms
// in their listed order, and the field errors every check returns. Not installed.

#ifndef SHARDLINE_COLLECTIVES_SIM_INTERNAL_TOPOLOGY_FIELDS_H_
#define SHARDLINE_COLLECTIVES_SIM_INTERNAL_TOPOLOGY_FIELDS_H_

#include <array>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collectives/sim/topology.h"

namespace shardline::topology_internal {

inline constexpr double kGB = 1e9;
inline constexpr double kUs = 1e-6;
inline constexpr double kTera = 1e12;
inline constexpr double kGiB = 1073741824.0;

inline constexpr std::array<CollectiveKind, kNumCollectiveKinds> kKinds = {
    CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
    CollectiveKind::kBroadcast, CollectiveKind::kAllToAll,      CollectiveKind::kBarrier};
inline constexpr std::array<CollectiveAlgorithm, 3> kAlgorithms = {
    CollectiveAlgorithm::kRing, CollectiveAlgorithm::kTree, CollectiveAlgorithm::kHierarchical};

// "topology 'name'" (or "topology" while it has none), to begin a message.
std::string Where(const Topology& t);
// InvalidArgument "topology 'x': field 'f' <what>".
absl::Status FieldError(const Topology& t, absl::string_view field, absl::string_view what);

}  // namespace shardline::topology_internal

#endif  // SHARDLINE_COLLECTIVES_SIM_INTERNAL_TOPOLOGY_FIELDS_H_
