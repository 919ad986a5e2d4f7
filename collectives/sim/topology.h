// File: collectives/sim/topology.h
// -----------------------------------------------------------------------------
// The machine the `sim` backend simulates, and its cost model: how long a collective takes on a
// group of ranks placed on that machine, and how long a compute op of F FLOPs takes.
//
// A Topology is `nodes` nodes of `devices_per_node` devices each. Devices are numbered
// node * devices_per_node + local index. Two link levels connect them:
//   intra_node  each device's own port into the node's fabric (NVLink/NVSwitch: every device
//               reaches every other at `bandwidth` at once)
//   inter_node  the node's `nics_per_node` NICs, rail-aligned: each device drives
//               nics_per_node / devices_per_node NICs' worth of bandwidth (its "rail share")
// Each level has a per-hop latency `alpha`, a bandwidth `B` and a message-size efficiency curve
// eff(m) in (0, 1]: a message of m bytes moves at B * eff(m). The curve is piecewise linear in
// log2(m) through its points and flat beyond the first and the last (none: 1 everywhere).
//
// Cost of one collective on a group of n ranks over N nodes with k ranks per node (at most), for
// elements of e bytes and `count` as the Communicator API defines it: p = count * e is a rank's
// piece (all_gather, reduce_scatter, all_to_all), T = count * e the buffer (all_reduce,
// broadcast). Each algorithm gives a latency L (no bandwidth involved), the bytes each rank
// moves on each level and a transfer time X; the duration is L + X. With a per-(collective,
// algorithm) `bandwidth_factor` f and `latency_us` l: L += l, X /= f.
//
//   ring  (every collective; the only algorithm inside one node). `s` steps of m bytes:
//     all_gather, reduce_scatter, all_to_all   s = n-1,   m = p,    bus = (n-1) p
//     all_reduce                               s = 2(n-1), m = T/n, bus = 2(n-1) T/n
//     broadcast (pipelined chain)              s = n-1,   m = T,    bus = T
//     barrier                                  s = 2(n-1), no bytes
//     N = 1:  L = s alpha_intra,  X = bus / (B_intra eff_intra(m))
//     N > 1:  L = s alpha_inter; a rank sends bus (k-1)/k within its node and bus/k over the
//             network (each ring channel crosses each node once, rotating over the node's
//             ranks); X = max(intra / (B_intra eff_intra(m)), inter / (B_rail eff_inter(m))),
//             B_rail = nic_bandwidth * nics_per_node / devices_per_node.
//   tree  (all_reduce, broadcast; N > 1): a chain inside each node, a binary tree over nodes,
//     h = ceil(log2 N) hops; m = T:
//     all_reduce  L = 2((k-1) alpha_intra + h alpha_inter), intra = 2T(k-1)/k, inter = 2T/k
//     broadcast   L = (k-1) alpha_intra + h alpha_inter,     intra = T(k-1)/k,  inter = T/k
//     X = max(intra / (B_intra eff_intra(T)), inter / (B_rail eff_inter(T)))
//   hierarchical  (all_gather, reduce_scatter, all_reduce, broadcast; N > 1, k > 1): phases in
//     sequence, each a ring on one level (X is their sum):
//     all_gather / reduce_scatter: over the network among the N ranks of one local index with
//       pieces p, then inside the node among k ranks with pieces N p (reduce_scatter: the
//       reverse order, same cost):
//       L = (N-1) alpha_inter + (k-1) alpha_intra
//       X = (N-1) p / (B_rail eff_inter(p)) + (k-1) N p / (B_intra eff_intra(N p))
//     all_reduce: reduce_scatter in the node, all_reduce of T/k over the network, all_gather in
//       the node:
//       L = 2(k-1) alpha_intra + 2(N-1) alpha_inter
//       X = 2(k-1) (T/k) / (B_intra eff_intra(T/k)) + 2(N-1) T/(kN) / (B_rail eff_inter(T/(kN)))
//     broadcast: a chain over the nodes, then one inside each node:
//       L = (N-1) alpha_inter + (k-1) alpha_intra,  X = T / (B_rail eff_inter(T)) +
//       T / (B_intra eff_intra(T))
// A group of one rank costs nothing. Among the algorithms a topology lists for a collective
// (Topology::collectives; "ring" always among them), the one with the shortest duration that
// applies to the group is chosen (ties: the first listed).
//
// With a Topology, the ring inside one node is exactly the flat model of SimOptions (latency,
// bandwidth) in sim_communicator.h, with alpha = latency and B = bandwidth.
//
// Compute (ComputeDuration): an op's work (ComputeWork) in dtype d. By default its FLOPs take
// FLOPs / ComputeFlopsPerS(d): the throughput a device achieves, one figure for every dtype
// ("compute_TFLOPs": c) or one per dtype ("compute_TFLOPs": {"bf16": c, "f32": c'}; a dtype
// without one cannot be simulated). "peak_TFLOPs" holds the hardware's peak per dtype, from the
// datasheet that "peak_source" cites; MFU is measured against it (scheduler/tune/sweep.h), never
// against the achieved figure. Where the topology has a "compute_efficiency" (each figure from a
// published measurement its "source" cites, none fitted to what is predicted) an op takes, for
// the dtypes it names,
//   matmul_flops / (peak(d) * matmul(d))                    matrix products
//   + attention / attention_TFLOPs(d, s)                     attention's core: a FlashAttention
//        kernel's work, attention_flops / 2 when causal, and 2.5 times that in the backward,
//        at the throughput measured for its forward and backward together at sequence length s
//        (piecewise linear in log2(s) through the points, flat beyond them)
//   + elementwise_bytes / memory_ops.fill_GBps               memory-bound ops (norms, activation
//        functions, residual adds) at the rate the memory ops move bytes
//   + other_flops / ComputeFlopsPerS(d)
// and without it (or for a dtype it does not name) everything but the elementwise bytes at
// ComputeFlopsPerS(d).
//
// JSON (ParseTopology / TopologyToJson; docs/tuning.md has the schema with an example):
//   {"name": ..., "description": ..., "nodes": N, "devices_per_node": D,
//    "device_memory_GiB": g, "compute_TFLOPs": c,
//    "peak_TFLOPs": {"bf16": p, "f16": p, "f32": p, ...}, "peak_source": "...",
//    "compute_efficiency": {"matmul": {"bf16": e, ...},
//                           "attention_TFLOPs": {"bf16": [{"seq_len": s, "TFLOPs": a}, ...]},
//                           "source": "..."},
//    "intra_node": {"bandwidth_GBps": b, "latency_us": a,
//                   "efficiency": [{"bytes": m, "efficiency": e}, ...]},
//    "inter_node": {"nics_per_node": k, "nic_bandwidth_GBps": b, "latency_us": a,
//                   "efficiency": [...]},
//    "collectives": {"all_reduce": {"ring": {}, "tree": {"bandwidth_factor": f,
//                                                        "latency_us": l}}, ...},
//    "host_link_GBps": h, "host_cores": c, "memory_ops": {...}}
// (peak_TFLOPs, peak_source, compute_efficiency, collectives and the last three optional; the
// keys of the per-dtype objects are dtype names, runtime/dtype.h; compute_efficiency's matmul
// needs peak_TFLOPs for its dtypes)
// GBps is 10^9 bytes/s, TFLOPs 10^12 FLOP/s, GiB 2^30 bytes. inter_node is required when
// nodes > 1. Unknown members are errors (a typo must not silently fall back to a default).

#ifndef SHARDLINE_COLLECTIVES_SIM_TOPOLOGY_H_
#define SHARDLINE_COLLECTIVES_SIM_TOPOLOGY_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "runtime/dtype.h"

namespace shardline {

// One point of a size-efficiency curve.
struct EfficiencyPoint {
  double bytes = 0;       // message size, > 0
  double efficiency = 1;  // in (0, 1]
  bool operator==(const EfficiencyPoint&) const = default;
};

// One link level.
struct LinkModel {
  // intra_node: per device; inter_node: per NIC. Bytes per second, > 0.
  double bandwidth_bytes_per_s = 0;
  // Per hop (one ring step), seconds, >= 0.
  double latency_s = 0;
  // Strictly increasing sizes; empty: efficiency 1 at every size.
  std::vector<EfficiencyPoint> efficiency;

  // eff(m): piecewise linear in log2(m) through the points, flat outside them.
  double Efficiency(double message_bytes) const;
  bool operator==(const LinkModel&) const = default;
};

enum class CollectiveAlgorithm : uint8_t { kRing, kTree, kHierarchical };
inline constexpr int kNumCollectiveKinds = 6;  // CollectiveKind's values

// "ring", "tree", "hierarchical".
absl::string_view CollectiveAlgorithmName(CollectiveAlgorithm algorithm);
// Whether `algorithm` exists for `kind` at all (a group may still be too small for it).
bool AlgorithmSupports(CollectiveAlgorithm algorithm, CollectiveKind kind);

// One algorithm a topology allows for a collective, with its corrections.
struct AlgorithmModel {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kRing;
  double bandwidth_factor = 1;  // in (0, 1]: X is divided by it
  double latency_s = 0;         // >= 0: added to L
  bool operator==(const AlgorithmModel&) const = default;
};

// How long a device's memory ops take: the casts, copies, reductions and zero-fills the
// scheduler submits to its streams (runtime/stream.h's StreamOpKind; an op of `bytes` takes
// op_overhead + bytes / throughput, bytes being the op's input). JSON: the optional
// "memory_ops" object, {"copy_GBps", "cast_GBps", "reduce_GBps", "fill_GBps",
// "op_overhead_us"}, each optional; a missing one keeps the default below, which is the virtual
// timeline's own (runtime/virtual_time.h).
struct MemoryOpsModel {
  double copy_bytes_per_s = 100e9;
  double cast_bytes_per_s = 50e9;
  double reduce_bytes_per_s = 50e9;
  double fill_bytes_per_s = 200e9;
  double op_overhead_s = 0;
  bool operator==(const MemoryOpsModel&) const = default;
};

// What the device achieves beside its peak, from published measurements (ComputeDuration).
struct ComputeEfficiency {
  // Fraction of peak_TFLOPs a matrix product achieves, per dtype (0: not stated).
  std::array<double, kAllDTypes.size()> matmul{};
  // FlashAttention's forward-and-backward throughput in its own FLOP count, per dtype: FLOP/s
  // at increasing sequence lengths (empty: not stated).
  struct AttentionPoint {
    double seq_len = 0;
    double flops_per_s = 0;
    bool operator==(const AttentionPoint&) const = default;
  };
  std::array<std::vector<AttentionPoint>, kAllDTypes.size()> attention;
  // The attention throughput at sequence length `seq_len` for `dtype` (0: not stated).
  double AttentionFlopsPerS(DType dtype, double seq_len) const;
  std::string source;
  bool operator==(const ComputeEfficiency&) const = default;
};

// One compute op's work by kind (scheduler/tune/model.h gives it per use of a model).
struct ComputeWork {
  double matmul_flops = 0;
  // Attention's core as the model counts it (the full s x s square, forward); `causal`: the
  // kernel computes half of it; `backward`: the op is the backward kernel (twice the forward's
  // FLOPs in the model's count where timed at compute_TFLOPs).
  double attention_flops = 0;
  bool causal = false;
  bool backward = false;
  double attention_seq_len = 0;  // the kernel's sequence length
  double elementwise_bytes = 0;  // read and written by memory-bound ops
  double other_flops = 0;        // FLOPs of no kind above
};

struct Topology {
  std::string name;
  std::string description;
  int nodes = 1;
  int devices_per_node = 1;
  uint64_t device_memory_bytes = 0;  // > 0
  // Achieved per device: compute_flops_per_s for every dtype, or where compute_flops_by_dtype
  // (indexed by DType) holds a figure, that one. One of them > 0.
  double compute_flops_per_s = 0;
  std::array<double, kAllDTypes.size()> compute_flops_by_dtype{};
  // The hardware's dense peak per device for matrix products in each dtype (indexed by DType;
  // 0: not stated), and where it comes from. What MFU is measured against.
  std::array<double, kAllDTypes.size()> peak_flops_per_s{};
  std::string peak_source;
  ComputeEfficiency compute_efficiency;
  LinkModel intra_node;
  int nics_per_node = 0;  // >= 1 when nodes > 1
  LinkModel inter_node;   // bandwidth per NIC; used only when nodes > 1
  MemoryOpsModel memory_ops;
  // A device's link to host memory, bytes/s each way (JSON "host_link_GBps", optional, >= 0;
  // 0: not described): what CPU offload's copies take in a simulation.
  double host_link_bytes_per_s = 0;
  // A host-memory machine (JSON "host_cores", optional, >= 0; 0: not one): the cores of each
  // node's host, which run every memory op of the node's ranks and the copies of their
  // collectives (the UCX backend copies with the CPU). A simulation on it shares them
  // (VirtualTimelineOptions::host_cores, runtime/virtual_sharing.h): the memory ops and
  // collective transfers running at once on a node each progress at min(1, cores / their
  // threads) of their speed alone. GPU nodes leave it 0: their copies run on the devices.
  double host_cores = 0;
  // With host_cores (JSON "host_lockstep", optional, default false): a collective's ranks on a
  // node progress only while all of them run at once (VirtualTimelineOptions::host_lockstep).
  bool host_lockstep = false;
  // Indexed by CollectiveKind: the algorithms considered, "ring" among them.
  std::array<std::vector<AlgorithmModel>, kNumCollectiveKinds> collectives;

  int devices() const { return nodes * devices_per_node; }
  // What a device achieves computing in `dtype`; 0 where the topology does not say.
  double ComputeFlopsPerS(DType dtype) const {
    const double own = compute_flops_by_dtype[static_cast<int>(dtype)];
    return own > 0 ? own : compute_flops_per_s;
  }
  // The peak for `dtype`; 0 where the topology does not state it.
  double PeakFlopsPerS(DType dtype) const { return peak_flops_per_s[static_cast<int>(dtype)]; }
  // A device's share of its node's NICs: nic bandwidth * nics_per_node / devices_per_node.
  double rail_bandwidth_bytes_per_s() const;
  // The algorithms listed for `kind`; none for messages (kSend, kRecv: one ring step each).
  const std::vector<AlgorithmModel>& algorithms(CollectiveKind kind) const {
    static const std::vector<AlgorithmModel> kNone;
    return IsPointToPoint(kind) ? kNone : collectives[static_cast<int>(kind)];
  }
  bool operator==(const Topology&) const = default;
};

// Every applicable algorithm, factors 1 and no extra latency: ring for every collective, tree for
// all_reduce and broadcast, hierarchical for all_gather, reduce_scatter, all_reduce, broadcast.
std::array<std::vector<AlgorithmModel>, kNumCollectiveKinds> DefaultCollectiveAlgorithms();

// OK, or InvalidArgument naming the first field out of range ("topology 'x': field
// 'inter_node.nics_per_node' must be >= 1 when nodes > 1, got 0").
absl::Status ValidateTopology(const Topology& topology);

// Reads and validates the JSON form (the header comment). InvalidArgument naming the field (or
// the JSON line and column) on any error.
absl::StatusOr<Topology> ParseTopology(absl::string_view json);
// ParseTopology of a file's contents; NotFound / Unavailable if it cannot be read, errors
// prefixed with the path.
absl::StatusOr<Topology> LoadTopology(const std::string& path);
// The JSON form; ParseTopology reads it back to an equal Topology (up to the unit conversions'
// last bit).
std::string TopologyToJson(const Topology& topology);

// Where a group's ranks sit: how many nodes it spans and how many of its ranks share a node.
struct GroupShape {
  int ranks = 1;
  int nodes = 1;
  int ranks_per_node = 1;  // the most on any one node
  bool operator==(const GroupShape&) const = default;
};
// The shape of a group whose rank i is on device devices[i]. InvalidArgument if a device is out
// of range or appears twice, or `devices` is empty.
absl::StatusOr<GroupShape> GroupShapeOf(const Topology& topology, absl::Span<const int> devices);

// The modelled cost of one collective (the header comment).
struct CollectiveCost {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kRing;
  double latency_s = 0;    // L: bandwidth sharing does not stretch it
  double transfer_s = 0;   // X: at the full bandwidth of every link it uses
  double intra_bytes = 0;  // per rank, sent within the node
  double inter_bytes = 0;  // per rank, sent over the network
  bool uses_intra() const { return intra_bytes > 0; }
  bool uses_inter() const { return inter_bytes > 0; }
  double seconds() const { return latency_s + transfer_s; }
  absl::Duration duration() const { return absl::Seconds(seconds()); }
};

// The cost with the best algorithm the topology lists for `kind` (kSend, kRecv: one message
// between the group's two ranks, one ring step). InvalidArgument if the shape does not fit the
// topology (more nodes, or more ranks per node, than it has).
absl::StatusOr<CollectiveCost> EstimateCollective(const Topology& topology, CollectiveKind kind,
                                                  size_t count, DType dtype,
                                                  const GroupShape& shape);
// The cost with one algorithm (its listed corrections if the topology lists it, none otherwise).
// InvalidArgument naming the algorithm if it does not apply to the kind or the group.
absl::StatusOr<CollectiveCost> EstimateCollectiveWith(const Topology& topology,
                                                      CollectiveAlgorithm algorithm,
                                                      CollectiveKind kind, size_t count,
                                                      DType dtype, const GroupShape& shape);

// How long a compute op of `flops` FLOPs in `dtype` takes on one device:
// flops / ComputeFlopsPerS(dtype); InfiniteDuration where the topology states no throughput for
// the dtype (the simulation refuses such a configuration first).
absl::Duration ComputeDuration(const Topology& topology, double flops, DType dtype);
// How long an op of `work` in `dtype` takes (the header comment's formula).
absl::Duration ComputeDuration(const Topology& topology, const ComputeWork& work, DType dtype);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_SIM_TOPOLOGY_H_
