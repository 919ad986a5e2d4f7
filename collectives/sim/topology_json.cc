// The sim backend's topology in JSON: ParseTopology, LoadTopology and TopologyToJson
// (collectives/sim/topology.h; the schema is in docs/tuning.md).

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/sim/internal/topology_fields.h"
#include "collectives/sim/topology.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {

using topology_internal::FieldError;
using topology_internal::kAlgorithms;
using topology_internal::kGB;
using topology_internal::kGiB;
using topology_internal::kKinds;
using topology_internal::kTera;
using topology_internal::kUs;

namespace {

// ---- JSON reading ----------------------------------------------------------------------------

// The members of one JSON object, read by name; Finish() rejects those nobody read.
class Fields {
 public:
  Fields(const Topology& t, const JsonValue& object, std::string path)
      : t_(t), object_(object), path_(std::move(path)) {}

  static absl::StatusOr<Fields> Of(const Topology& t, const JsonValue& v, std::string path) {
    if (v.kind() != JsonValue::Kind::kObject) {
      return FieldError(t, path.empty() ? "(top level)" : path,
                        absl::StrCat("must be an object, got ", JsonKindName(v.kind())));
    }
    return Fields(t, v, std::move(path));
  }

  std::string Path(absl::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }
  const JsonValue* Find(absl::string_view key) {
    used_.insert(std::string(key));
    return object_.Find(key);
  }
  absl::StatusOr<const JsonValue*> Required(absl::string_view key) {
    const JsonValue* v = Find(key);
    if (v == nullptr) return FieldError(t_, Path(key), "is missing");
    return v;
  }
  absl::StatusOr<double> Number(absl::string_view key) {
    SL_ASSIGN_OR_RETURN(const JsonValue* v, Required(key));
    return NumberOf(*v, Path(key));
  }
  absl::StatusOr<double> NumberOf(const JsonValue& v, const std::string& path) const {
    if (!v.is_number()) {
      return FieldError(t_, path, absl::StrCat("must be a number, got ", JsonKindName(v.kind())));
    }
    return v.number();
  }
  absl::StatusOr<double> OptionalNumber(absl::string_view key, double fallback) {
    const JsonValue* v = Find(key);
    if (v == nullptr) return fallback;
    return NumberOf(*v, Path(key));
  }
  absl::StatusOr<bool> OptionalBool(absl::string_view key, bool fallback) {
    const JsonValue* v = Find(key);
    if (v == nullptr) return fallback;
    if (v->kind() != JsonValue::Kind::kBool) {
      return FieldError(t_, Path(key),
                        absl::StrCat("must be true or false, got ", JsonKindName(v->kind())));
    }
    return v->boolean();
  }
  absl::StatusOr<int> Int(absl::string_view key) {
    SL_ASSIGN_OR_RETURN(const JsonValue* v, Required(key));
    if (v->kind() != JsonValue::Kind::kInteger || v->integer() < 0 || v->integer() > (1 << 30)) {
      return FieldError(t_, Path(key),
                        v->kind() == JsonValue::Kind::kInteger
                            ? absl::StrCat("must be in [0, 2^30], got ", v->integer())
                            : absl::StrCat("must be an integer, got ", JsonKindName(v->kind())));
    }
    return static_cast<int>(v->integer());
  }
  absl::StatusOr<std::string> String(absl::string_view key, bool required) {
    const JsonValue* v = Find(key);
    if (v == nullptr) {
      if (required) return FieldError(t_, Path(key), "is missing");
      return std::string();
    }
    if (v->kind() != JsonValue::Kind::kString) {
      return FieldError(t_, Path(key),
                        absl::StrCat("must be a string, got ", JsonKindName(v->kind())));
    }
    return v->string();
  }
  absl::Status Finish() const {
    for (const JsonValue::Member& m : object_.members()) {
      if (used_.count(m.first) == 0) {
        return FieldError(t_, Path(m.first), "is not a topology field (misspelt?)");
      }
    }
    return absl::OkStatus();
  }

 private:
  const Topology& t_;
  const JsonValue& object_;
  std::string path_;
  std::set<std::string> used_;
};

absl::StatusOr<std::vector<EfficiencyPoint>> ParseEfficiency(const Topology& t, Fields& parent,
                                                             absl::string_view key) {
  std::vector<EfficiencyPoint> points;
  const JsonValue* v = parent.Find(key);
  if (v == nullptr) return points;
  const std::string path = parent.Path(key);
  if (v->kind() != JsonValue::Kind::kArray) {
    return FieldError(t, path, absl::StrCat("must be an array, got ", JsonKindName(v->kind())));
  }
  for (size_t i = 0; i < v->items().size(); ++i) {
    SL_ASSIGN_OR_RETURN(Fields f, Fields::Of(t, v->items()[i], absl::StrCat(path, "[", i, "]")));
    EfficiencyPoint p;
    SL_ASSIGN_OR_RETURN(p.bytes, f.Number("bytes"));
    SL_ASSIGN_OR_RETURN(p.efficiency, f.Number("efficiency"));
    SL_RETURN_IF_ERROR(f.Finish());
    points.push_back(p);
  }
  return points;
}

// A link's figures: `bandwidth_key` in GB/s, "latency_us" and the optional "efficiency" curve.
absl::Status ParseLink(const Topology& t, Fields& f, absl::string_view bandwidth_key,
                       LinkModel& link) {
  SL_ASSIGN_OR_RETURN(const double bandwidth, f.Number(bandwidth_key));
  link.bandwidth_bytes_per_s = bandwidth * kGB;
  SL_ASSIGN_OR_RETURN(const double latency, f.Number("latency_us"));
  link.latency_s = latency * kUs;
  SL_ASSIGN_OR_RETURN(link.efficiency, ParseEfficiency(t, f, "efficiency"));
  return absl::OkStatus();
}

absl::Status ParseCollectives(Topology& t, const JsonValue& v) {
  SL_ASSIGN_OR_RETURN(Fields kinds, Fields::Of(t, v, "collectives"));
  for (const CollectiveKind kind : kKinds) {
    const std::string kind_name(CollectiveName(kind));
    const JsonValue* entry = kinds.Find(kind_name);
    if (entry == nullptr) continue;
    SL_ASSIGN_OR_RETURN(Fields algos, Fields::Of(t, *entry, kinds.Path(kind_name)));
    std::vector<AlgorithmModel> models;
    // Listed order is the JSON order: ties between algorithms go to the first listed.
    for (const JsonValue::Member& m : entry->members()) {
      const CollectiveAlgorithm* found = nullptr;
      for (const CollectiveAlgorithm& a : kAlgorithms) {
        if (CollectiveAlgorithmName(a) == m.first) found = &a;
      }
      const std::string path = algos.Path(m.first);
      if (found == nullptr) {
        return FieldError(t, path, "is not an algorithm (ring, tree, hierarchical)");
      }
      if (!AlgorithmSupports(*found, kind)) {
        return FieldError(t, path, absl::StrCat("does not exist for ", kind_name));
      }
      algos.Find(m.first);
      SL_ASSIGN_OR_RETURN(Fields f, Fields::Of(t, m.second, path));
      AlgorithmModel model;
      model.algorithm = *found;
      SL_ASSIGN_OR_RETURN(model.bandwidth_factor, f.OptionalNumber("bandwidth_factor", 1.0));
      SL_ASSIGN_OR_RETURN(const double latency_us, f.OptionalNumber("latency_us", 0.0));
      model.latency_s = latency_us * kUs;
      SL_RETURN_IF_ERROR(f.Finish());
      models.push_back(model);
    }
    t.collectives[static_cast<int>(kind)] = std::move(models);
  }
  return kinds.Finish();
}

// An object of positive numbers per dtype ({"bf16": 989.4, "f32": 67}) into `out` (indexed by
// DType), each times `scale` (kTera: TFLOP/s to FLOP/s).
absl::Status ParsePerDType(const Topology& t, Fields& parent, absl::string_view key,
                           std::array<double, kAllDTypes.size()>& out, double scale) {
  const JsonValue* v = parent.Find(key);
  SL_ASSIGN_OR_RETURN(Fields f, Fields::Of(t, *v, parent.Path(key)));
  for (const JsonValue::Member& m : v->members()) {
    const std::string path = f.Path(m.first);
    absl::StatusOr<DType> dtype = ParseDType(m.first);
    if (!dtype.ok()) return FieldError(t, path, "is not a dtype (bf16, f16, f32, ...)");
    f.Find(m.first);
    SL_ASSIGN_OR_RETURN(const double value, f.NumberOf(m.second, path));
    if (!(value > 0) || std::isinf(value)) {
      return FieldError(t, path, absl::StrCat("must be positive and finite, got ", value));
    }
    out[static_cast<int>(*dtype)] = value * scale;
  }
  return f.Finish();
}

// {"bf16": 989.4, ...}: the dtypes with a figure, each divided by `scale`.
std::string PerDTypeJson(const std::array<double, kAllDTypes.size()>& values, double scale) {
  std::vector<std::string> items;
  for (const DType dtype : kAllDTypes) {
    const double v = values[static_cast<int>(dtype)];
    if (v > 0) items.push_back(absl::StrCat("\"", DTypeName(dtype), "\": ", JsonNumber(v / scale)));
  }
  return absl::StrCat("{", absl::StrJoin(items, ", "), "}");
}
}  // namespace

absl::StatusOr<Topology> ParseTopology(absl::string_view json) {
  absl::StatusOr<JsonValue> parsed = ParseJson(json);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("topology: ", parsed.status().message()));
  }
  const JsonValue& root = *parsed;
  Topology t;
  t.collectives = DefaultCollectiveAlgorithms();
  SL_ASSIGN_OR_RETURN(Fields top, Fields::Of(t, root, ""));
  SL_ASSIGN_OR_RETURN(t.name, top.String("name", /*required=*/true));
  SL_ASSIGN_OR_RETURN(t.description, top.String("description", /*required=*/false));
  SL_ASSIGN_OR_RETURN(t.nodes, top.Int("nodes"));
  SL_ASSIGN_OR_RETURN(t.devices_per_node, top.Int("devices_per_node"));
  SL_ASSIGN_OR_RETURN(const double gib, top.Number("device_memory_GiB"));
  if (!(gib > 0) || gib * kGiB >= 1.8e19) {
    return FieldError(t, "device_memory_GiB", absl::StrCat("must be positive, got ", gib));
  }
  t.device_memory_bytes = static_cast<uint64_t>(std::llround(gib * kGiB));
  SL_ASSIGN_OR_RETURN(const JsonValue* compute, top.Required("compute_TFLOPs"));
  if (compute->kind() == JsonValue::Kind::kObject) {
    SL_RETURN_IF_ERROR(ParsePerDType(t, top, "compute_TFLOPs", t.compute_flops_by_dtype, kTera));
  } else {
    SL_ASSIGN_OR_RETURN(const double tflops, top.NumberOf(*compute, "compute_TFLOPs"));
    t.compute_flops_per_s = tflops * kTera;
  }
  if (top.Find("peak_TFLOPs") != nullptr) {
    SL_RETURN_IF_ERROR(ParsePerDType(t, top, "peak_TFLOPs", t.peak_flops_per_s, kTera));
  }
  SL_ASSIGN_OR_RETURN(t.peak_source, top.String("peak_source", /*required=*/false));
  if (const JsonValue* eff = top.Find("compute_efficiency"); eff != nullptr) {
    SL_ASSIGN_OR_RETURN(Fields f, Fields::Of(t, *eff, "compute_efficiency"));
    ComputeEfficiency& e = t.compute_efficiency;
    if (f.Find("matmul") != nullptr) {
      SL_RETURN_IF_ERROR(ParsePerDType(t, f, "matmul", e.matmul, 1));
    }
    if (const JsonValue* a = f.Find("attention_TFLOPs"); a != nullptr) {
      SL_ASSIGN_OR_RETURN(Fields per, Fields::Of(t, *a, f.Path("attention_TFLOPs")));
      for (const JsonValue::Member& m : a->members()) {
        const std::string path = per.Path(m.first);
        absl::StatusOr<DType> dtype = ParseDType(m.first);
        if (!dtype.ok()) return FieldError(t, path, "is not a dtype (bf16, f16, f32, ...)");
        per.Find(m.first);
        if (m.second.kind() != JsonValue::Kind::kArray) {
          return FieldError(t, path,
                            absl::StrCat("must be an array, got ", JsonKindName(m.second.kind())));
        }
        for (size_t i = 0; i < m.second.items().size(); ++i) {
          SL_ASSIGN_OR_RETURN(Fields point,
                              Fields::Of(t, m.second.items()[i], absl::StrCat(path, "[", i, "]")));
          ComputeEfficiency::AttentionPoint p;
          SL_ASSIGN_OR_RETURN(p.seq_len, point.Number("seq_len"));
          SL_ASSIGN_OR_RETURN(const double tflops, point.Number("TFLOPs"));
          p.flops_per_s = tflops * kTera;
          SL_RETURN_IF_ERROR(point.Finish());
          e.attention[static_cast<int>(*dtype)].push_back(p);
        }
      }
      SL_RETURN_IF_ERROR(per.Finish());
    }
    SL_ASSIGN_OR_RETURN(e.source, f.String("source", /*required=*/true));
    SL_RETURN_IF_ERROR(f.Finish());
  }

  SL_ASSIGN_OR_RETURN(const JsonValue* intra, top.Required("intra_node"));
  SL_ASSIGN_OR_RETURN(Fields in, Fields::Of(t, *intra, "intra_node"));
  SL_RETURN_IF_ERROR(ParseLink(t, in, "bandwidth_GBps", t.intra_node));
  SL_RETURN_IF_ERROR(in.Finish());

  const JsonValue* inter = top.Find("inter_node");
  if (inter == nullptr && t.nodes > 1) return FieldError(t, "inter_node", "is missing (nodes > 1)");
  if (inter != nullptr) {
    SL_ASSIGN_OR_RETURN(Fields net, Fields::Of(t, *inter, "inter_node"));
    SL_ASSIGN_OR_RETURN(t.nics_per_node, net.Int("nics_per_node"));
    SL_RETURN_IF_ERROR(ParseLink(t, net, "nic_bandwidth_GBps", t.inter_node));
    SL_RETURN_IF_ERROR(net.Finish());
  }
  if (const JsonValue* coll = top.Find("collectives"); coll != nullptr) {
    SL_RETURN_IF_ERROR(ParseCollectives(t, *coll));
  }
  SL_ASSIGN_OR_RETURN(const double host_link, top.OptionalNumber("host_link_GBps", 0.0));
  t.host_link_bytes_per_s = host_link * kGB;
  SL_ASSIGN_OR_RETURN(t.host_cores, top.OptionalNumber("host_cores", 0.0));
  SL_ASSIGN_OR_RETURN(t.host_lockstep, top.OptionalBool("host_lockstep", false));
  if (const JsonValue* mem = top.Find("memory_ops"); mem != nullptr) {
    SL_ASSIGN_OR_RETURN(Fields m, Fields::Of(t, *mem, "memory_ops"));
    MemoryOpsModel& o = t.memory_ops;
    SL_ASSIGN_OR_RETURN(const double copy, m.OptionalNumber("copy_GBps", o.copy_bytes_per_s / kGB));
    SL_ASSIGN_OR_RETURN(const double cast, m.OptionalNumber("cast_GBps", o.cast_bytes_per_s / kGB));
    SL_ASSIGN_OR_RETURN(const double reduce,
                        m.OptionalNumber("reduce_GBps", o.reduce_bytes_per_s / kGB));
    SL_ASSIGN_OR_RETURN(const double fill, m.OptionalNumber("fill_GBps", o.fill_bytes_per_s / kGB));
    SL_ASSIGN_OR_RETURN(const double overhead,
                        m.OptionalNumber("op_overhead_us", o.op_overhead_s / kUs));
    o.copy_bytes_per_s = copy * kGB;
    o.cast_bytes_per_s = cast * kGB;
    o.reduce_bytes_per_s = reduce * kGB;
    o.fill_bytes_per_s = fill * kGB;
    o.op_overhead_s = overhead * kUs;
    SL_RETURN_IF_ERROR(m.Finish());
  }
  SL_RETURN_IF_ERROR(top.Finish());
  SL_RETURN_IF_ERROR(ValidateTopology(t));
  return t;
}

absl::StatusOr<Topology> LoadTopology(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open topology file '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::UnavailableError(absl::StrCat("cannot read '", path, "'"));
  absl::StatusOr<Topology> t = ParseTopology(text.str());
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

std::string TopologyToJson(const Topology& t) {
  auto link = [](const LinkModel& l, std::string head, absl::string_view bw_key) {
    std::string out =
        absl::StrCat("{", head, "\"", bw_key, "\": ", JsonNumber(l.bandwidth_bytes_per_s / kGB),
                     ", \"latency_us\": ", JsonNumber(l.latency_s / kUs));
    if (!l.efficiency.empty()) {
      absl::StrAppend(&out, ",\n    \"efficiency\": [");
      for (size_t i = 0; i < l.efficiency.size(); ++i) {
        absl::StrAppend(&out, i == 0 ? "\n" : ",\n",
                        "      {\"bytes\": ", JsonNumber(l.efficiency[i].bytes),
                        ", \"efficiency\": ", JsonNumber(l.efficiency[i].efficiency), "}");
      }
      absl::StrAppend(&out, "\n    ]");
    }
    return absl::StrCat(out, "}");
  };
  std::string out = absl::StrCat(
      "{\n  \"name\": ", JsonQuote(t.name), ",\n  \"description\": ", JsonQuote(t.description),
      ",\n  \"nodes\": ", t.nodes, ",\n  \"devices_per_node\": ", t.devices_per_node,
      ",\n  \"device_memory_GiB\": ", JsonNumber(static_cast<double>(t.device_memory_bytes) / kGiB),
      ",\n  \"compute_TFLOPs\": ",
      t.compute_flops_per_s > 0 ? JsonNumber(t.compute_flops_per_s / kTera)
                                : PerDTypeJson(t.compute_flops_by_dtype, kTera));
  if (PerDTypeJson(t.peak_flops_per_s, kTera) != "{}") {
    absl::StrAppend(&out, ",\n  \"peak_TFLOPs\": ", PerDTypeJson(t.peak_flops_per_s, kTera));
  }
  if (!t.peak_source.empty()) {
    absl::StrAppend(&out, ",\n  \"peak_source\": ", JsonQuote(t.peak_source));
  }
  const ComputeEfficiency& e = t.compute_efficiency;
  if (e != ComputeEfficiency{}) {
    std::vector<std::string> curves;
    for (const DType dtype : kAllDTypes) {
      const auto& curve = e.attention[static_cast<int>(dtype)];
      if (curve.empty()) continue;
      std::vector<std::string> points;
      for (const ComputeEfficiency::AttentionPoint& p : curve) {
        points.push_back(absl::StrCat("{\"seq_len\": ", JsonNumber(p.seq_len),
                                      ", \"TFLOPs\": ", JsonNumber(p.flops_per_s / kTera), "}"));
      }
      curves.push_back(
          absl::StrCat("\"", DTypeName(dtype), "\": [", absl::StrJoin(points, ", "), "]"));
    }
    absl::StrAppend(&out, ",\n  \"compute_efficiency\": {\"matmul\": ", PerDTypeJson(e.matmul, 1),
                    ",\n    \"attention_TFLOPs\": {", absl::StrJoin(curves, ", "),
                    "},\n    \"source\": ", JsonQuote(e.source), "}");
  }
  absl::StrAppend(&out, ",\n  \"intra_node\": ", link(t.intra_node, "", "bandwidth_GBps"));
  if (t.nodes > 1 || t.nics_per_node > 0) {
    absl::StrAppend(&out, ",\n  \"inter_node\": ",
                    link(t.inter_node, absl::StrCat("\"nics_per_node\": ", t.nics_per_node, ", "),
                         "nic_bandwidth_GBps"));
  }
  if (t.host_link_bytes_per_s > 0) {
    absl::StrAppend(&out, ",\n  \"host_link_GBps\": ", JsonNumber(t.host_link_bytes_per_s / kGB));
  }
  if (t.host_cores > 0) absl::StrAppend(&out, ",\n  \"host_cores\": ", JsonNumber(t.host_cores));
  if (t.host_lockstep) absl::StrAppend(&out, ",\n  \"host_lockstep\": true");
  const MemoryOpsModel& mem = t.memory_ops;
  absl::StrAppend(&out,
                  ",\n  \"memory_ops\": {\"copy_GBps\": ", JsonNumber(mem.copy_bytes_per_s / kGB),
                  ", \"cast_GBps\": ", JsonNumber(mem.cast_bytes_per_s / kGB),
                  ", \"reduce_GBps\": ", JsonNumber(mem.reduce_bytes_per_s / kGB),
                  ", \"fill_GBps\": ", JsonNumber(mem.fill_bytes_per_s / kGB),
                  ", \"op_overhead_us\": ", JsonNumber(mem.op_overhead_s / kUs), "}");
  absl::StrAppend(&out, ",\n  \"collectives\": {");
  for (size_t i = 0; i < kKinds.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "\n" : ",\n", "    \"", CollectiveName(kKinds[i]), "\": {");
    const std::vector<AlgorithmModel>& models = t.algorithms(kKinds[i]);
    for (size_t j = 0; j < models.size(); ++j) {
      const AlgorithmModel& m = models[j];
      std::vector<std::string> params;
      if (m.bandwidth_factor != 1) {
        params.push_back(absl::StrCat("\"bandwidth_factor\": ", JsonNumber(m.bandwidth_factor)));
      }
      if (m.latency_s != 0) {
        params.push_back(absl::StrCat("\"latency_us\": ", JsonNumber(m.latency_s / kUs)));
      }
      absl::StrAppend(&out, j == 0 ? "" : ", ", "\"", CollectiveAlgorithmName(m.algorithm), "\": {",
                      absl::StrJoin(params, ", "), "}");
    }
    absl::StrAppend(&out, "}");
  }
  absl::StrAppend(&out, "\n  }\n}\n");
  return out;
}

}  // namespace shardline
