// The sim backend's topology: validation and the cost formulas of collectives and compute
// (collectives/sim/topology.h; the JSON form is topology_json.cc).

#include "collectives/sim/topology.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/sim/internal/topology_fields.h"
#include "runtime/status.h"

namespace shardline {

namespace topology_internal {

std::string Where(const Topology& t) {
  return t.name.empty() ? std::string("topology") : absl::StrCat("topology '", t.name, "'");
}

absl::Status FieldError(const Topology& t, absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(Where(t), ": field '", field, "' ", what));
}

}  // namespace topology_internal

using topology_internal::FieldError;
using topology_internal::kAlgorithms;
using topology_internal::kGB;
using topology_internal::kKinds;
using topology_internal::kTera;
using topology_internal::kUs;
using topology_internal::Where;

namespace {

absl::Status ValidateLink(const Topology& t, const LinkModel& link, const std::string& prefix,
                          absl::string_view bandwidth_field) {
  if (!(link.bandwidth_bytes_per_s > 0) || std::isinf(link.bandwidth_bytes_per_s)) {
    return FieldError(t, absl::StrCat(prefix, ".", bandwidth_field),
                      absl::StrCat("must be positive and finite, got ",
                                   link.bandwidth_bytes_per_s / kGB, " GB/s"));
  }
  if (!(link.latency_s >= 0) || std::isinf(link.latency_s)) {
    return FieldError(t, absl::StrCat(prefix, ".latency_us"),
                      absl::StrCat("must be >= 0 and finite, got ", link.latency_s / kUs, " us"));
  }
  for (size_t i = 0; i < link.efficiency.size(); ++i) {
    const EfficiencyPoint& p = link.efficiency[i];
    const std::string field = absl::StrCat(prefix, ".efficiency[", i, "]");
    if (!(p.bytes > 0) || std::isinf(p.bytes)) {
      return FieldError(t, absl::StrCat(field, ".bytes"),
                        absl::StrCat("must be positive and finite, got ", p.bytes));
    }
    if (!(p.efficiency > 0 && p.efficiency <= 1)) {
      return FieldError(t, absl::StrCat(field, ".efficiency"),
                        absl::StrCat("must be in (0, 1], got ", p.efficiency));
    }
    if (i > 0 && !(p.bytes > link.efficiency[i - 1].bytes)) {
      return FieldError(t, absl::StrCat(field, ".bytes"),
                        absl::StrCat("must be larger than the previous point's (",
                                     link.efficiency[i - 1].bytes, "), got ", p.bytes));
    }
  }
  return absl::OkStatus();
}

// ---- cost formulas ---------------------------------------------------------------------------

int CeilLog2(int n) {
  int h = 0;
  while ((1 << h) < n) ++h;
  return h;
}

// Transfer time of `bytes` at bandwidth*eff(m) (0 bytes: 0).
double Transfer(double bytes, double bandwidth, const LinkModel& link, double m) {
  if (bytes <= 0) return 0;
  return bytes / (bandwidth * link.Efficiency(m));
}

absl::StatusOr<CollectiveCost> Formula(const Topology& t, CollectiveAlgorithm algorithm,
                                       CollectiveKind kind, size_t count, DType dtype,
                                       const GroupShape& g) {
  CollectiveCost c;
  c.algorithm = algorithm;
  if (g.ranks <= 1) return c;
  const double n = g.ranks;
  const double N = g.nodes;
  const double k = g.ranks_per_node;
  const double bytes = static_cast<double>(count) * static_cast<double>(DTypeSize(dtype));
  const LinkModel& in = t.intra_node;
  const LinkModel& net = t.inter_node;
  const double b_in = in.bandwidth_bytes_per_s;
  const double b_rail = g.nodes > 1 ? t.rail_bandwidth_bytes_per_s() : 0;
  auto not_applicable = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(t), ": algorithm ", CollectiveAlgorithmName(algorithm), " does not apply to ",
        CollectiveName(kind), " on ", g.ranks, " ranks over ", g.nodes, " node(s) (", why, ")"));
  };
  if (!AlgorithmSupports(algorithm, kind)) return not_applicable("no such variant");

  switch (algorithm) {
    case CollectiveAlgorithm::kRing: {
      double steps = n - 1, m = bytes, bus = 0;
      switch (kind) {
        case CollectiveKind::kAllGather:
        case CollectiveKind::kReduceScatter:
        case CollectiveKind::kAllToAll:
          bus = (n - 1) * bytes;
          break;
        case CollectiveKind::kAllReduce:
          steps = 2 * (n - 1);
          m = bytes / n;
          bus = 2 * (n - 1) * bytes / n;
          break;
        case CollectiveKind::kBroadcast:
          bus = bytes;
          break;
        case CollectiveKind::kBarrier:
          steps = 2 * (n - 1);
          m = 0;
          break;
        case CollectiveKind::kSend:  // one message: one step of `bytes`
        case CollectiveKind::kRecv:
          steps = 1;
          bus = bytes;
          break;
      }
      if (g.nodes == 1) {
        c.latency_s = steps * in.latency_s;
        c.intra_bytes = bus;
        c.transfer_s = Transfer(bus, b_in, in, m);
      } else {
        c.latency_s = steps * net.latency_s;
        c.intra_bytes = bus * (k - 1) / k;
        c.inter_bytes = bus / k;
        c.transfer_s =
            std::max(Transfer(c.intra_bytes, b_in, in, m), Transfer(c.inter_bytes, b_rail, net, m));
      }
      return c;
    }
    case CollectiveAlgorithm::kTree: {
      if (g.nodes < 2) return not_applicable("a tree spans at least 2 nodes");
      const double h = CeilLog2(g.nodes);
      const double factor = kind == CollectiveKind::kAllReduce ? 2 : 1;
      c.latency_s = factor * ((k - 1) * in.latency_s + h * net.latency_s);
      c.intra_bytes = factor * bytes * (k - 1) / k;
      c.inter_bytes = factor * bytes / k;
      c.transfer_s = std::max(Transfer(c.intra_bytes, b_in, in, bytes),
                              Transfer(c.inter_bytes, b_rail, net, bytes));
      return c;
    }
    case CollectiveAlgorithm::kHierarchical: {
      if (g.nodes < 2 || g.ranks_per_node < 2) {
        return not_applicable("a hierarchy needs at least 2 nodes and 2 ranks per node");
      }
      switch (kind) {
        case CollectiveKind::kAllGather:
        case CollectiveKind::kReduceScatter:
          c.latency_s = (N - 1) * net.latency_s + (k - 1) * in.latency_s;
          c.inter_bytes = (N - 1) * bytes;
          c.intra_bytes = (k - 1) * N * bytes;
          c.transfer_s = Transfer(c.inter_bytes, b_rail, net, bytes) +
                         Transfer(c.intra_bytes, b_in, in, N * bytes);
          return c;
        case CollectiveKind::kAllReduce:
          c.latency_s = 2 * (k - 1) * in.latency_s + 2 * (N - 1) * net.latency_s;
          c.intra_bytes = 2 * (k - 1) * bytes / k;
          c.inter_bytes = 2 * (N - 1) * bytes / (k * N);
          c.transfer_s = Transfer(c.intra_bytes, b_in, in, bytes / k) +
                         Transfer(c.inter_bytes, b_rail, net, bytes / (k * N));
          return c;
        case CollectiveKind::kBroadcast:
          c.latency_s = (N - 1) * net.latency_s + (k - 1) * in.latency_s;
          c.inter_bytes = bytes;
          c.intra_bytes = bytes;
          c.transfer_s = Transfer(bytes, b_rail, net, bytes) + Transfer(bytes, b_in, in, bytes);
          return c;
        default:
          return not_applicable("no such variant");
      }
    }
  }
  return absl::InternalError("unknown collective algorithm");
}

absl::Status CheckShape(const Topology& t, const GroupShape& g) {
  if (g.ranks < 1 || g.nodes < 1 || g.ranks_per_node < 1 || g.nodes > t.nodes ||
      g.ranks_per_node > t.devices_per_node || g.ranks > g.nodes * g.ranks_per_node ||
      g.ranks < g.nodes + g.ranks_per_node - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(t), ": a group of ", g.ranks, " ranks over ", g.nodes,
                     " node(s) with at most ", g.ranks_per_node, " per node does not fit ", t.nodes,
                     " node(s) of ", t.devices_per_node, " device(s)"));
  }
  return absl::OkStatus();
}

CollectiveCost Corrected(CollectiveCost c, const AlgorithmModel& model) {
  c.transfer_s /= model.bandwidth_factor;
  c.latency_s += model.latency_s;
  return c;
}

}  // namespace

double LinkModel::Efficiency(double m) const {
  if (efficiency.empty()) return 1.0;
  if (!(m > efficiency.front().bytes)) return efficiency.front().efficiency;
  if (!(m < efficiency.back().bytes)) return efficiency.back().efficiency;
  // The first point above m (there is one: m < the last point's size).
  const auto hi =
      std::upper_bound(efficiency.begin(), efficiency.end(), m,
                       [](double size, const EfficiencyPoint& p) { return size < p.bytes; });
  const auto lo = hi - 1;
  const double x =
      (std::log2(m) - std::log2(lo->bytes)) / (std::log2(hi->bytes) - std::log2(lo->bytes));
  return lo->efficiency + x * (hi->efficiency - lo->efficiency);
}

absl::string_view CollectiveAlgorithmName(CollectiveAlgorithm algorithm) {
  switch (algorithm) {
    case CollectiveAlgorithm::kRing:
      return "ring";
    case CollectiveAlgorithm::kTree:
      return "tree";
    case CollectiveAlgorithm::kHierarchical:
      return "hierarchical";
  }
  return "?";
}

bool AlgorithmSupports(CollectiveAlgorithm algorithm, CollectiveKind kind) {
  switch (algorithm) {
    case CollectiveAlgorithm::kRing:
      return true;
    case CollectiveAlgorithm::kTree:
      return kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kBroadcast;
    case CollectiveAlgorithm::kHierarchical:
      return kind == CollectiveKind::kAllGather || kind == CollectiveKind::kReduceScatter ||
             kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kBroadcast;
  }
  return false;
}

double Topology::rail_bandwidth_bytes_per_s() const {
  return inter_node.bandwidth_bytes_per_s * nics_per_node / devices_per_node;
}

std::array<std::vector<AlgorithmModel>, kNumCollectiveKinds> DefaultCollectiveAlgorithms() {
  std::array<std::vector<AlgorithmModel>, kNumCollectiveKinds> out;
  for (const CollectiveKind kind : kKinds) {
    for (const CollectiveAlgorithm a : kAlgorithms) {
      if (AlgorithmSupports(a, kind)) out[static_cast<int>(kind)].push_back({.algorithm = a});
    }
  }
  return out;
}

absl::Status ValidateTopology(const Topology& t) {
  if (t.name.empty()) return FieldError(t, "name", "must not be empty");
  if (t.nodes < 1) return FieldError(t, "nodes", absl::StrCat("must be >= 1, got ", t.nodes));
  if (t.devices_per_node < 1) {
    return FieldError(t, "devices_per_node",
                      absl::StrCat("must be >= 1, got ", t.devices_per_node));
  }
  if (static_cast<int64_t>(t.nodes) * t.devices_per_node > (int64_t{1} << 30)) {
    return FieldError(t, "nodes", "times devices_per_node must be at most 2^30");
  }
  if (t.device_memory_bytes == 0) return FieldError(t, "device_memory_GiB", "must be positive");
  bool any_compute = false;
  for (const DType dtype : kAllDTypes) {
    const double own = t.compute_flops_by_dtype[static_cast<int>(dtype)];
    if (!(own >= 0) || std::isinf(own)) {
      return FieldError(t, absl::StrCat("compute_TFLOPs.", DTypeName(dtype)),
                        absl::StrCat("must be positive and finite, got ", own / kTera));
    }
    any_compute = any_compute || own > 0;
  }
  if (!(t.compute_flops_per_s >= 0) || std::isinf(t.compute_flops_per_s) ||
      (!any_compute && t.compute_flops_per_s == 0)) {
    return FieldError(
        t, "compute_TFLOPs",
        absl::StrCat("must be positive and finite, got ", t.compute_flops_per_s / kTera));
  }
  for (const DType dtype : kAllDTypes) {
    const double peak = t.PeakFlopsPerS(dtype);
    if (!(peak >= 0) || std::isinf(peak)) {
      return FieldError(t, absl::StrCat("peak_TFLOPs.", DTypeName(dtype)),
                        absl::StrCat("must be finite and not negative, got ", peak / kTera));
    }
  }
  for (const DType dtype : kAllDTypes) {
    const int d = static_cast<int>(dtype);
    const double matmul = t.compute_efficiency.matmul[d];
    const std::string name(DTypeName(dtype));
    if (!(matmul >= 0 && matmul <= 1)) {
      return FieldError(t, "compute_efficiency.matmul." + name,
                        absl::StrCat("must be in (0, 1], got ", matmul));
    }
    if (matmul > 0 && !(t.peak_flops_per_s[d] > 0)) {
      return FieldError(t, "compute_efficiency.matmul." + name,
                        "needs peak_TFLOPs for the dtype (a fraction of the peak)");
    }
    const auto& curve = t.compute_efficiency.attention[d];
    for (size_t i = 0; i < curve.size(); ++i) {
      const std::string at =
          absl::StrCat("compute_efficiency.attention_TFLOPs.", name, "[", i, "]");
      if (!(curve[i].seq_len >= 1) || std::isinf(curve[i].seq_len)) {
        return FieldError(t, at + ".seq_len",
                          absl::StrCat("must be at least 1 and finite, got ", curve[i].seq_len));
      }
      if (i > 0 && !(curve[i].seq_len > curve[i - 1].seq_len)) {
        return FieldError(t, at + ".seq_len", "must be larger than the previous point's");
      }
      if (!(curve[i].flops_per_s > 0) || std::isinf(curve[i].flops_per_s)) {
        return FieldError(
            t, at + ".TFLOPs",
            absl::StrCat("must be positive and finite, got ", curve[i].flops_per_s / kTera));
      }
    }
  }
  SL_RETURN_IF_ERROR(ValidateLink(t, t.intra_node, "intra_node", "bandwidth_GBps"));
  // A one-node topology may still describe its NICs (nics_per_node > 0): then they must be
  // valid too.
  if (t.nics_per_node < (t.nodes > 1 ? 1 : 0)) {
    return FieldError(t, "inter_node.nics_per_node",
                      absl::StrCat("must be >= ", t.nodes > 1 ? "1 when nodes > 1" : "0", ", got ",
                                   t.nics_per_node));
  }
  if (t.nodes > 1 || t.nics_per_node > 0) {
    SL_RETURN_IF_ERROR(ValidateLink(t, t.inter_node, "inter_node", "nic_bandwidth_GBps"));
  }
  const MemoryOpsModel& mem = t.memory_ops;
  for (const auto& [value, field] :
       {std::pair{mem.copy_bytes_per_s, "copy_GBps"}, std::pair{mem.cast_bytes_per_s, "cast_GBps"},
        std::pair{mem.reduce_bytes_per_s, "reduce_GBps"},
        std::pair{mem.fill_bytes_per_s, "fill_GBps"}}) {
    if (!(value > 0) || std::isinf(value)) {
      return FieldError(t, absl::StrCat("memory_ops.", field),
                        absl::StrCat("must be positive and finite, got ", value / kGB));
    }
  }
  if (!(t.host_link_bytes_per_s >= 0) || std::isinf(t.host_link_bytes_per_s)) {
    return FieldError(t, "host_link_GBps",
                      absl::StrCat("must be >= 0 and finite, got ", t.host_link_bytes_per_s / kGB));
  }
  if (!(t.host_cores >= 0) || std::isinf(t.host_cores)) {
    return FieldError(t, "host_cores", absl::StrCat("must be >= 0 and finite, got ", t.host_cores));
  }
  if (!(mem.op_overhead_s >= 0) || std::isinf(mem.op_overhead_s)) {
    return FieldError(t, "memory_ops.op_overhead_us",
                      absl::StrCat("must be >= 0 and finite, got ", mem.op_overhead_s / kUs));
  }
  for (const CollectiveKind kind : kKinds) {
    const std::vector<AlgorithmModel>& models = t.algorithms(kind);
    const std::string field = absl::StrCat("collectives.", CollectiveName(kind));
    bool ring = false;
    std::set<CollectiveAlgorithm> seen;
    for (const AlgorithmModel& m : models) {
      const std::string path = absl::StrCat(field, ".", CollectiveAlgorithmName(m.algorithm));
      if (!AlgorithmSupports(m.algorithm, kind)) {
        return FieldError(t, path, absl::StrCat("does not exist for ", CollectiveName(kind)));
      }
      if (!seen.insert(m.algorithm).second) return FieldError(t, path, "is listed twice");
      if (!(m.bandwidth_factor > 0 && m.bandwidth_factor <= 1)) {
        return FieldError(t, absl::StrCat(path, ".bandwidth_factor"),
                          absl::StrCat("must be in (0, 1], got ", m.bandwidth_factor));
      }
      if (!(m.latency_s >= 0) || std::isinf(m.latency_s)) {
        return FieldError(t, absl::StrCat(path, ".latency_us"),
                          absl::StrCat("must be >= 0 and finite, got ", m.latency_s / kUs));
      }
      ring |= m.algorithm == CollectiveAlgorithm::kRing;
    }
    if (!ring) {
      return FieldError(t, field,
                        "must list \"ring\" (the algorithm of every group inside one node)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupShape> GroupShapeOf(const Topology& t, absl::Span<const int> devices) {
  if (devices.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Where(t), ": a group needs at least 1 rank"));
  }
  std::vector<int> per_node;
  std::set<int> seen;
  for (size_t i = 0; i < devices.size(); ++i) {
    const int d = devices[i];
    if (d < 0 || d >= t.devices()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(t), ": rank ", i, " is placed on device ", d,
                       ", outside the topology's devices 0..", t.devices() - 1));
    }
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(t), ": rank ", i, " is placed on device ", d,
                       ", which an earlier rank of the group already occupies"));
    }
    const int node = d / t.devices_per_node;
    if (per_node.size() <= static_cast<size_t>(node)) per_node.resize(node + 1, 0);
    ++per_node[node];
  }
  GroupShape g;
  g.ranks = static_cast<int>(devices.size());
  g.nodes = static_cast<int>(
      std::count_if(per_node.begin(), per_node.end(), [](int c) { return c > 0; }));
  g.ranks_per_node = *std::max_element(per_node.begin(), per_node.end());
  return g;
}

absl::StatusOr<CollectiveCost> EstimateCollectiveWith(const Topology& t,
                                                      CollectiveAlgorithm algorithm,
                                                      CollectiveKind kind, size_t count,
                                                      DType dtype, const GroupShape& shape) {
  SL_RETURN_IF_ERROR(CheckShape(t, shape));
  SL_ASSIGN_OR_RETURN(CollectiveCost c, Formula(t, algorithm, kind, count, dtype, shape));
  for (const AlgorithmModel& m : t.algorithms(kind)) {
    if (m.algorithm == algorithm) return Corrected(c, m);
  }
  return c;
}

absl::StatusOr<CollectiveCost> EstimateCollective(const Topology& t, CollectiveKind kind,
                                                  size_t count, DType dtype,
                                                  const GroupShape& shape) {
  SL_RETURN_IF_ERROR(CheckShape(t, shape));
  if (IsPointToPoint(kind))  // a message is one ring step: no algorithm to choose
    return Formula(t, CollectiveAlgorithm::kRing, kind, count, dtype, shape);
  std::optional<CollectiveCost> best;
  for (const AlgorithmModel& m : t.algorithms(kind)) {
    absl::StatusOr<CollectiveCost> c = Formula(t, m.algorithm, kind, count, dtype, shape);
    if (!c.ok()) continue;  // does not apply to this group
    const CollectiveCost corrected = Corrected(*c, m);
    if (!best.has_value() || corrected.seconds() < best->seconds()) best = corrected;
  }
  if (!best.has_value()) {
    // Validation guarantees a ring, which applies to every group.
    return absl::InternalError(absl::StrCat(Where(t), ": no algorithm for ", CollectiveName(kind)));
  }
  return *best;
}

double ComputeEfficiency::AttentionFlopsPerS(DType dtype, double seq_len) const {
  const std::vector<AttentionPoint>& curve = attention[static_cast<int>(dtype)];
  if (curve.empty()) return 0;
  if (seq_len <= curve.front().seq_len) return curve.front().flops_per_s;
  if (seq_len >= curve.back().seq_len) return curve.back().flops_per_s;
  size_t i = 1;
  while (curve[i].seq_len < seq_len) ++i;
  const double x0 = std::log2(curve[i - 1].seq_len), x1 = std::log2(curve[i].seq_len);
  const double w = (std::log2(seq_len) - x0) / (x1 - x0);
  return curve[i - 1].flops_per_s + w * (curve[i].flops_per_s - curve[i - 1].flops_per_s);
}

absl::Duration ComputeDuration(const Topology& t, const ComputeWork& work, DType dtype) {
  const int d = static_cast<int>(dtype);
  const ComputeEfficiency& e = t.compute_efficiency;
  double other = work.other_flops, seconds = 0;
  if (e.matmul[d] > 0 && t.peak_flops_per_s[d] > 0) {
    seconds += work.matmul_flops / (t.peak_flops_per_s[d] * e.matmul[d]);
  } else {
    other += work.matmul_flops;
  }
  const double attention_rate = e.AttentionFlopsPerS(dtype, work.attention_seq_len);
  if (attention_rate > 0) {
    const double kernel = work.attention_flops / (work.causal ? 2 : 1) * (work.backward ? 2.5 : 1);
    seconds += kernel / attention_rate;
  } else {
    other += work.attention_flops * (work.backward ? 2 : 1);  // the model's count
  }
  if (e.matmul[d] > 0 || !e.attention[d].empty()) {
    seconds += work.elementwise_bytes / t.memory_ops.fill_bytes_per_s;
  }
  if (other > 0) {
    const double rate = t.ComputeFlopsPerS(dtype);
    if (!(rate > 0)) return absl::InfiniteDuration();
    seconds += other / rate;
  }
  return absl::Seconds(seconds);
}

absl::Duration ComputeDuration(const Topology& t, double flops, DType dtype) {
  return ComputeDuration(t, ComputeWork{.other_flops = flops}, dtype);
}

}  // namespace shardline
