// Model descriptions: validation, the JSON form and the transformer presets
// (scheduler/tune/model.h has the formulas).

#include "scheduler/tune/model.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {
namespace {

uint64_t Numel(const TensorSpec& spec) {
  uint64_t n = 1;
  for (int64_t d : spec.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// --- JSON reading ---------------------------------------------------------------------------

absl::Status Bad(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("model description: ", where, ": ", what));
}

// The members of an object, refusing any not in `known`.
absl::Status CheckMembers(const JsonValue& v, absl::string_view where,
                          std::initializer_list<absl::string_view> known) {
  if (v.kind() != JsonValue::Kind::kObject) {
    return Bad(where, absl::StrCat("expected an object, got ", JsonKindName(v.kind())));
  }
  for (const auto& [key, value] : v.members()) {
    bool found = false;
    for (absl::string_view k : known) found = found || k == key;
    if (!found) {
      return Bad(where, absl::StrCat("unknown member \"", key,
                                     "\" (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<const JsonValue*> Member(const JsonValue& obj, absl::string_view where,
                                        absl::string_view key, JsonValue::Kind kind,
                                        bool required) {
  const JsonValue* v = obj.Find(key);
  if (v == nullptr) {
    if (required) return Bad(where, absl::StrCat("missing member \"", key, "\""));
    return nullptr;
  }
  if (v->kind() != kind) {
    return Bad(where, absl::StrCat("\"", key, "\" must be a ", JsonKindName(kind), ", not a ",
                                   JsonKindName(v->kind())));
  }
  return v;
}

absl::Status ReadCount(const JsonValue& obj, absl::string_view where, absl::string_view key,
                       bool required, uint64_t* out) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v,
                      Member(obj, where, key, JsonValue::Kind::kInteger, required));
  if (v == nullptr) return absl::OkStatus();
  if (v->integer() < 0) {
    return Bad(where, absl::StrCat("\"", key, "\" must not be negative, got ", v->integer()));
  }
  *out = static_cast<uint64_t>(v->integer());
  return absl::OkStatus();
}

// A ComputeWork object: {"matmul_flops", "attention_flops", "causal", "attention_seq_len",
// "elementwise_bytes"}, each optional.
absl::Status ReadWork(const JsonValue& obj, absl::string_view where, absl::string_view key,
                      ComputeWork* out) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Member(obj, where, key, JsonValue::Kind::kObject, true));
  const std::string at = absl::StrCat(where, ".", key);
  SL_RETURN_IF_ERROR(CheckMembers(
      *v, at,
      {"matmul_flops", "attention_flops", "causal", "attention_seq_len", "elementwise_bytes"}));
  uint64_t matmul = 0, attention = 0, seq_len = 0, bytes = 0;
  SL_RETURN_IF_ERROR(ReadCount(*v, at, "matmul_flops", false, &matmul));
  SL_RETURN_IF_ERROR(ReadCount(*v, at, "attention_flops", false, &attention));
  SL_RETURN_IF_ERROR(ReadCount(*v, at, "attention_seq_len", false, &seq_len));
  SL_RETURN_IF_ERROR(ReadCount(*v, at, "elementwise_bytes", false, &bytes));
  SL_ASSIGN_OR_RETURN(const JsonValue* causal,
                      Member(*v, at, "causal", JsonValue::Kind::kBool, false));
  *out = {.matmul_flops = static_cast<double>(matmul),
          .attention_flops = static_cast<double>(attention),
          .causal = causal != nullptr && causal->boolean(),
          .attention_seq_len = static_cast<double>(seq_len),
          .elementwise_bytes = static_cast<double>(bytes)};
  return absl::OkStatus();
}

std::string WorkJson(const ComputeWork& w) {
  return absl::StrCat("{\"matmul_flops\": ", static_cast<uint64_t>(w.matmul_flops),
                      ", \"attention_flops\": ", static_cast<uint64_t>(w.attention_flops),
                      ", \"causal\": ", w.causal ? "true" : "false",
                      ", \"attention_seq_len\": ", static_cast<uint64_t>(w.attention_seq_len),
                      ", \"elementwise_bytes\": ", static_cast<uint64_t>(w.elementwise_bytes), "}");
}

absl::Status ReadPrecision(const JsonValue& v, absl::string_view where, MixedPrecisionPolicy* out) {
  const std::string at = absl::StrCat(where, ".precision");
  SL_RETURN_IF_ERROR(CheckMembers(
      v, at, {"param_dtype", "reduce_dtype", "master_dtype", "keep_low_precision_grads"}));
  const std::pair<absl::string_view, DType*> fields[] = {{"param_dtype", &out->param_dtype},
                                                         {"reduce_dtype", &out->reduce_dtype},
                                                         {"master_dtype", &out->master_dtype}};
  for (const auto& [key, dst] : fields) {
    SL_ASSIGN_OR_RETURN(const JsonValue* s,
                        Member(v, at, key, JsonValue::Kind::kString, /*required=*/false));
    if (s == nullptr) continue;
    absl::StatusOr<DType> d = ParseDType(s->string());
    if (!d.ok()) return Bad(at, absl::StrCat("\"", key, "\": ", d.status().message()));
    *dst = *d;
  }
  SL_ASSIGN_OR_RETURN(const JsonValue* keep,
                      Member(v, at, "keep_low_precision_grads", JsonValue::Kind::kBool, false));
  if (keep != nullptr) out->keep_low_precision_grads = keep->boolean();
  absl::Status valid = out->Validate();
  if (!valid.ok()) return Bad(at, valid.message());
  return absl::OkStatus();
}

absl::StatusOr<TensorSpec> ReadTensor(const JsonValue& v, absl::string_view where) {
  SL_RETURN_IF_ERROR(CheckMembers(v, where, {"name", "shape", "tied_to"}));
  TensorSpec spec;
  SL_ASSIGN_OR_RETURN(const JsonValue* name,
                      Member(v, where, "name", JsonValue::Kind::kString, true));
  spec.name = name->string();
  SL_ASSIGN_OR_RETURN(const JsonValue* shape,
                      Member(v, where, "shape", JsonValue::Kind::kArray, true));
  for (const JsonValue& d : shape->items()) {
    if (d.kind() != JsonValue::Kind::kInteger || d.integer() < 0) {
      return Bad(where, "\"shape\" must be an array of non-negative integers");
    }
    spec.shape.push_back(d.integer());
  }
  SL_ASSIGN_OR_RETURN(const JsonValue* tied,
                      Member(v, where, "tied_to", JsonValue::Kind::kString, false));
  if (tied != nullptr) spec.tied_to = tied->string();
  return spec;
}

std::string PrecisionJson(const MixedPrecisionPolicy& p) {
  return absl::StrCat(
      "{\"param_dtype\": ", JsonQuote(DTypeName(p.param_dtype)),
      ", \"reduce_dtype\": ", JsonQuote(DTypeName(p.reduce_dtype)),
      ", \"master_dtype\": ", JsonQuote(DTypeName(p.master_dtype)),
      ", \"keep_low_precision_grads\": ", p.keep_low_precision_grads ? "true" : "false", "}");
}

// --- Transformer arithmetic -----------------------------------------------------------------

absl::Status CheckPositive(absl::string_view what, int64_t v, const TransformerConfig& c) {
  if (v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("transformer '", c.name, "': ", what, " must be positive, got ", v));
  }
  return absl::OkStatus();
}

std::vector<TensorSpec> NormTensors(const TransformerConfig& c, absl::string_view prefix) {
  std::vector<TensorSpec> t = {{.name = absl::StrCat(prefix, ".weight"), .shape = {c.hidden}}};
  if (c.layer_norm) t.push_back({.name = absl::StrCat(prefix, ".bias"), .shape = {c.hidden}});
  return t;
}

void Linear(const TransformerConfig& c, std::vector<TensorSpec>& out, absl::string_view name,
            int64_t in, int64_t outdim) {
  out.push_back({.name = absl::StrCat(name, ".weight"), .shape = {outdim, in}});
  if (c.biases) out.push_back({.name = absl::StrCat(name, ".bias"), .shape = {outdim}});
}

}  // namespace

uint64_t UnitDescription::ParameterCount() const {
  uint64_t n = 0;
  for (const TensorSpec& t : tensors) n += t.tied_to.empty() ? Numel(t) : 0;
  return n;
}

uint64_t ModelDescription::ParameterCount() const {
  uint64_t n = 0;
  for (const UnitDescription& u : units) n += u.ParameterCount();
  return n;
}

uint64_t ModelDescription::ForwardFlops() const {
  uint64_t f = 0;
  for (const UnitUse& use : forward) f += use.forward_flops;
  return f;
}

uint64_t ModelDescription::BackwardFlops() const {
  uint64_t f = 0;
  for (const UnitUse& use : forward) f += use.backward_flops;
  return f;
}

absl::Status ModelDescription::Validate() const {
  const std::string what = absl::StrCat("model '", name, "'");
  if (units.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": no units"));
  SL_RETURN_IF_ERROR(Annotate(precision.Validate(), what));
  absl::flat_hash_set<std::string> names;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitDescription& unit = units[u];
    const std::string at = absl::StrCat(what, ": unit ", u, " '", unit.name, "'");
    if (unit.name.empty()) return absl::InvalidArgumentError(absl::StrCat(at, ": empty name"));
    if (!names.insert(unit.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": duplicate name"));
    }
    if (unit.tensors.empty()) return absl::InvalidArgumentError(absl::StrCat(at, ": no tensors"));
    if (unit.has_precision) SL_RETURN_IF_ERROR(Annotate(unit.precision.Validate(), at));
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(unit.tensors, {});
    if (!layout.ok()) return Annotate(layout.status(), at);
  }
  if (forward.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty forward"));
  std::vector<bool> used(units.size(), false);
  for (size_t k = 0; k < forward.size(); ++k) {
    const int u = forward[k].unit;
    if (u < 0 || static_cast<size_t>(u) >= units.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": forward use ", k, " names unit ", u,
                                                     ", but there are ", units.size()));
    }
    used[u] = true;
    const UnitUse& use = forward[k];
    if (use.selective && (use.selective_activation_bytes > use.activation_bytes ||
                          use.selective_recompute_flops > use.forward_flops)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": forward use ", k, " keeps more with selective checkpointing (",
          use.selective_activation_bytes, " bytes) than without (", use.activation_bytes,
          "), or recomputes more (", use.selective_recompute_flops, " FLOPs) than its forward (",
          use.forward_flops, ")"));
    }
    // The work adds up to the FLOPs it describes (to the last FLOP: the counts are integers).
    auto flops_of = [](const ComputeWork& w) {
      return static_cast<uint64_t>(w.matmul_flops) + static_cast<uint64_t>(w.attention_flops);
    };
    if (use.has_work && (flops_of(use.forward_work) != use.forward_flops ||
                         (use.selective && flops_of(use.selective_recompute_work) !=
                                               use.selective_recompute_flops))) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": forward use ", k, ": the work's matmul and attention FLOPs (",
          flops_of(use.forward_work), ", recomputed ", flops_of(use.selective_recompute_work),
          ") must add up to forward_flops (", use.forward_flops,
          ") and selective_recompute_flops (", use.selective_recompute_flops, ")"));
    }
  }
  for (size_t u = 0; u < units.size(); ++u) {
    if (!used[u]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unit '", units[u].name, "' is never used in the forward"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelDescription> ParseModelJson(absl::string_view json) {
  absl::StatusOr<JsonValue> parsed = ParseJson(json);
  if (!parsed.ok()) return Bad("JSON", parsed.status().message());
  const JsonValue& root = *parsed;
  SL_RETURN_IF_ERROR(CheckMembers(root, "model",
                                  {"name", "precision", "optimizer_state_bytes_per_param",
                                   "tokens_per_micro_batch", "units", "forward"}));
  ModelDescription m;
  SL_ASSIGN_OR_RETURN(const JsonValue* name,
                      Member(root, "model", "name", JsonValue::Kind::kString, true));
  m.name = name->string();
  SL_ASSIGN_OR_RETURN(const JsonValue* precision,
                      Member(root, "model", "precision", JsonValue::Kind::kObject, false));
  if (precision != nullptr) SL_RETURN_IF_ERROR(ReadPrecision(*precision, "model", &m.precision));
  SL_RETURN_IF_ERROR(ReadCount(root, "model", "optimizer_state_bytes_per_param", false,
                               &m.optimizer_state_bytes_per_param));
  SL_RETURN_IF_ERROR(
      ReadCount(root, "model", "tokens_per_micro_batch", false, &m.tokens_per_micro_batch));

  SL_ASSIGN_OR_RETURN(const JsonValue* units,
                      Member(root, "model", "units", JsonValue::Kind::kArray, true));
  absl::flat_hash_map<std::string, int> index;
  for (size_t u = 0; u < units->items().size(); ++u) {
    const JsonValue& v = units->items()[u];
    const std::string at = absl::StrCat("units[", u, "]");
    SL_RETURN_IF_ERROR(CheckMembers(v, at, {"name", "tensors", "params", "precision"}));
    UnitDescription unit;
    SL_ASSIGN_OR_RETURN(const JsonValue* uname,
                        Member(v, at, "name", JsonValue::Kind::kString, true));
    unit.name = uname->string();
    SL_ASSIGN_OR_RETURN(const JsonValue* tensors,
                        Member(v, at, "tensors", JsonValue::Kind::kArray, false));
    uint64_t params = 0;
    SL_RETURN_IF_ERROR(ReadCount(v, at, "params", false, &params));
    if ((tensors != nullptr) == (v.Find("params") != nullptr)) {
      return Bad(at, "give exactly one of \"tensors\" and \"params\"");
    }
    if (tensors != nullptr) {
      for (size_t t = 0; t < tensors->items().size(); ++t) {
        SL_ASSIGN_OR_RETURN(TensorSpec spec,
                            ReadTensor(tensors->items()[t], absl::StrCat(at, ".tensors[", t, "]")));
        unit.tensors.push_back(std::move(spec));
      }
    } else {
      unit.tensors.push_back({.name = "params", .shape = {static_cast<int64_t>(params)}});
    }
    SL_ASSIGN_OR_RETURN(const JsonValue* p,
                        Member(v, at, "precision", JsonValue::Kind::kObject, false));
    if (p != nullptr) {
      unit.has_precision = true;
      unit.precision = m.precision;
      SL_RETURN_IF_ERROR(ReadPrecision(*p, at, &unit.precision));
    }
    if (!index.emplace(unit.name, static_cast<int>(u)).second) {
      return Bad(at, absl::StrCat("duplicate unit name \"", unit.name, "\""));
    }
    m.units.push_back(std::move(unit));
  }

  SL_ASSIGN_OR_RETURN(const JsonValue* forward,
                      Member(root, "model", "forward", JsonValue::Kind::kArray, true));
  for (size_t k = 0; k < forward->items().size(); ++k) {
    const JsonValue& v = forward->items()[k];
    const std::string at = absl::StrCat("forward[", k, "]");
    SL_RETURN_IF_ERROR(
        CheckMembers(v, at,
                     {"unit", "forward_flops", "backward_flops", "activation_bytes",
                      "checkpointed_activation_bytes", "selective_activation_bytes",
                      "selective_recompute_flops", "forward_work", "selective_recompute_work"}));
    UnitUse use;
    SL_ASSIGN_OR_RETURN(const JsonValue* unit,
                        Member(v, at, "unit", JsonValue::Kind::kString, true));
    auto it = index.find(unit->string());
    if (it == index.end()) return Bad(at, absl::StrCat("no unit named \"", unit->string(), "\""));
    use.unit = it->second;
    SL_RETURN_IF_ERROR(ReadCount(v, at, "forward_flops", false, &use.forward_flops));
    SL_RETURN_IF_ERROR(ReadCount(v, at, "backward_flops", false, &use.backward_flops));
    SL_RETURN_IF_ERROR(ReadCount(v, at, "activation_bytes", false, &use.activation_bytes));
    SL_RETURN_IF_ERROR(ReadCount(v, at, "checkpointed_activation_bytes", false,
                                 &use.checkpointed_activation_bytes));
    const bool kept = v.Find("selective_activation_bytes") != nullptr;
    if (kept != (v.Find("selective_recompute_flops") != nullptr)) {
      return Bad(at, "selective_activation_bytes and selective_recompute_flops go together");
    }
    if (kept) {
      use.selective = true;
      SL_RETURN_IF_ERROR(
          ReadCount(v, at, "selective_activation_bytes", false, &use.selective_activation_bytes));
      SL_RETURN_IF_ERROR(
          ReadCount(v, at, "selective_recompute_flops", false, &use.selective_recompute_flops));
    }
    if (v.Find("forward_work") != nullptr) {
      use.has_work = true;
      SL_RETURN_IF_ERROR(ReadWork(v, at, "forward_work", &use.forward_work));
      if (use.selective) {
        SL_RETURN_IF_ERROR(
            ReadWork(v, at, "selective_recompute_work", &use.selective_recompute_work));
      }
    } else if (v.Find("selective_recompute_work") != nullptr) {
      return Bad(at, "selective_recompute_work needs forward_work");
    }
    m.forward.push_back(use);
  }
  SL_RETURN_IF_ERROR(m.Validate());
  return m;
}

std::string ModelToJson(const ModelDescription& m) {
  std::string out = absl::StrCat(
      "{\n  \"name\": ", JsonQuote(m.name), ",\n  \"precision\": ", PrecisionJson(m.precision),
      ",\n  \"optimizer_state_bytes_per_param\": ", m.optimizer_state_bytes_per_param,
      ",\n  \"tokens_per_micro_batch\": ", m.tokens_per_micro_batch, ",\n  \"units\": [");
  for (size_t u = 0; u < m.units.size(); ++u) {
    const UnitDescription& unit = m.units[u];
    absl::StrAppend(&out, u == 0 ? "\n" : ",\n", "    {\"name\": ", JsonQuote(unit.name),
                    ", \"tensors\": [");
    for (size_t t = 0; t < unit.tensors.size(); ++t) {
      const TensorSpec& s = unit.tensors[t];
      absl::StrAppend(&out, t == 0 ? "" : ", ", "{\"name\": ", JsonQuote(s.name), ", \"shape\": [",
                      absl::StrJoin(s.shape, ", "), "]");
      if (!s.tied_to.empty()) absl::StrAppend(&out, ", \"tied_to\": ", JsonQuote(s.tied_to));
      absl::StrAppend(&out, "}");
    }
    absl::StrAppend(&out, "]");
    if (unit.has_precision) {
      absl::StrAppend(&out, ", \"precision\": ", PrecisionJson(unit.precision));
    }
    absl::StrAppend(&out, "}");
  }
  absl::StrAppend(&out, "\n  ],\n  \"forward\": [");
  for (size_t k = 0; k < m.forward.size(); ++k) {
    const UnitUse& use = m.forward[k];
    absl::StrAppend(
        &out, k == 0 ? "\n" : ",\n", "    {\"unit\": ", JsonQuote(m.units[use.unit].name),
        ", \"forward_flops\": ", use.forward_flops, ", \"backward_flops\": ", use.backward_flops,
        ", \"activation_bytes\": ", use.activation_bytes,
        ", \"checkpointed_activation_bytes\": ", use.checkpointed_activation_bytes);
    if (use.selective) {
      absl::StrAppend(&out, ", \"selective_activation_bytes\": ", use.selective_activation_bytes,
                      ", \"selective_recompute_flops\": ", use.selective_recompute_flops);
    }
    if (use.has_work) {
      absl::StrAppend(&out, ",\n     \"forward_work\": ", WorkJson(use.forward_work));
      if (use.selective) {
        absl::StrAppend(
            &out, ",\n     \"selective_recompute_work\": ", WorkJson(use.selective_recompute_work));
      }
    }
    absl::StrAppend(&out, "}");
  }
  absl::StrAppend(&out, "\n  ]\n}\n");
  return out;
}

absl::StatusOr<ModelDescription> TransformerModel(const TransformerConfig& c) {
  SL_RETURN_IF_ERROR(CheckPositive("layers", c.layers, c));
  SL_RETURN_IF_ERROR(CheckPositive("hidden", c.hidden, c));
  SL_RETURN_IF_ERROR(CheckPositive("ffn", c.ffn, c));
  SL_RETURN_IF_ERROR(CheckPositive("heads", c.heads, c));
  SL_RETURN_IF_ERROR(CheckPositive("vocab", c.vocab, c));
  SL_RETURN_IF_ERROR(CheckPositive("seq_len", c.seq_len, c));
  SL_RETURN_IF_ERROR(CheckPositive("micro_batch", c.micro_batch, c));
  const int kv = c.kv_heads == 0 ? c.heads : c.kv_heads;
  if (kv < 0 || c.learned_positions < 0) {
    return absl::InvalidArgumentError(absl::StrCat("transformer '", c.name,
                                                   "': kv_heads and learned_positions must not be "
                                                   "negative"));
  }
  if (c.hidden % c.heads != 0 || c.heads % kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("transformer '", c.name, "': heads (", c.heads,
                                                   ") must divide hidden (", c.hidden,
                                                   ") and kv_heads (", kv, ") must divide heads"));
  }
  SL_RETURN_IF_ERROR(Annotate(c.precision.Validate(), absl::StrCat("transformer '", c.name, "'")));
  const uint64_t h = c.hidden, f = c.ffn, a = c.heads, d = h / a, kvd = kv * d, V = c.vocab,
                 s = c.seq_len;
  const uint64_t t = s * static_cast<uint64_t>(c.micro_batch);
  const uint64_t p = DTypeSize(c.precision.param_dtype);

  ModelDescription m;
  m.name = c.name;
  m.precision = c.precision;
  m.optimizer_state_bytes_per_param = c.optimizer_state_bytes_per_param;
  m.tokens_per_micro_batch = t;

  // Embedding (with tied embeddings it also holds the final norm, used by its second use).
  UnitDescription embed{.name = "embed"};
  embed.tensors.push_back({.name = "tok_embeddings.weight",
                           .shape = {static_cast<int64_t>(V), static_cast<int64_t>(h)}});
  if (c.learned_positions > 0) {
    embed.tensors.push_back(
        {.name = "pos_embeddings.weight", .shape = {c.learned_positions, static_cast<int64_t>(h)}});
  }
  if (c.tied_embeddings) {
    for (TensorSpec& n : NormTensors(c, "norm")) embed.tensors.push_back(std::move(n));
  }
  m.units.push_back(std::move(embed));
  // The lookup reads and writes its rows (with learned positions a second lookup, and an add
  // reading two and writing one).
  const double embed_bytes = static_cast<double>(p * (c.learned_positions > 0 ? 7 : 2) * h * t);
  m.forward.push_back({.unit = 0,
                       .activation_bytes = p * h * t,
                       .checkpointed_activation_bytes = p * h * t,
                       .selective = true,
                       .selective_activation_bytes = p * h * t,
                       .has_work = true,
                       .forward_work = {.elementwise_bytes = embed_bytes},
                       .selective_recompute_work = {}});

  // Layers.
  const uint64_t dropout_mask = c.dropout ? h : 0;
  uint64_t attention = p * (4 * h + 2 * kvd) + dropout_mask;
  attention += c.fused_attention ? 4 * a : a * s * (p + (c.dropout ? 1 + p : 0));
  const uint64_t mlp = p * (2 * h + (c.gated_ffn ? 3 : 2) * f) + dropout_mask;
  const uint64_t layer_activations = (attention + mlp) * t;
  // Selective op checkpointing (model.h): what a block saves per token and recomputes.
  struct Matmul {
    uint64_t out, flops;  // output elements and FLOPs per token
  };
  std::vector<Matmul> matmuls = {
      {h, 2 * h * h}, {kvd, 2 * h * kvd}, {kvd, 2 * h * kvd}, {h, 2 * h * h}, {f, 2 * h * f}};
  if (c.gated_ffn) matmuls.push_back({f, 2 * h * f});
  matmuls.push_back({h, 2 * f * h});
  uint64_t sac_kept = p * h, sac_recompute = 0;
  for (size_t i = 0; i < matmuls.size(); ++i) {
    if (!c.biases && i % 2 == 0) {  // the 1st, 3rd, ... mm is saved (an addmm never is)
      sac_kept += p * matmuls[i].out;
    } else {
      sac_recompute += matmuls[i].flops;
    }
  }
  const uint64_t sac_recompute_matmul = sac_recompute;
  if (c.fused_attention) {
    sac_kept += p * h + 4 * a;
  } else {
    sac_recompute += 4 * s * h;
  }
  // The memory-bound ops of a layer's forward, elements read and written per token (model.h):
  // two norms (h in, h out each), rotary embedding of Q and K (Llama; in and out), the FFN's
  // activation (gated: two inputs of f, one output; else f in, f out), two residual adds (2h
  // in, h out each), dropout on the attention and FFN outputs (h in, h out each), and unfused
  // attention's softmax (a*s in and out).
  const uint64_t elementwise = 4 * h + (c.learned_positions > 0 ? 0 : 2 * (h + kvd)) +
                               (c.gated_ffn ? 3 : 2) * f + 6 * h + (c.dropout ? 4 * h : 0) +
                               (c.fused_attention ? 0 : 2 * a * s);
  const uint64_t layer_matmul = 2 * t * (2 * h * h + 2 * h * kvd + (c.gated_ffn ? 3 : 2) * h * f);
  const uint64_t layer_attention = 4 * t * s * h;
  const ComputeWork layer_work = {.matmul_flops = static_cast<double>(layer_matmul),
                                  .attention_flops = static_cast<double>(layer_attention),
                                  .causal = true,
                                  .attention_seq_len = static_cast<double>(s),
                                  .elementwise_bytes = static_cast<double>(p * elementwise * t)};
  // Op checkpointing recomputes every memory-bound op (none is on the save list) and the mm
  // outputs it did not save; the attention too where it is not the fused kernel.
  const ComputeWork sac_work = {
      .matmul_flops = static_cast<double>(sac_recompute_matmul * t),
      .attention_flops = c.fused_attention ? 0.0 : layer_work.attention_flops,
      .causal = true,
      .attention_seq_len = static_cast<double>(s),
      .elementwise_bytes = layer_work.elementwise_bytes};
  for (int l = 0; l < c.layers; ++l) {
    UnitDescription layer{.name = absl::StrCat("layer", l)};
    std::vector<TensorSpec>& ts = layer.tensors;
    for (TensorSpec& n : NormTensors(c, "attention_norm")) ts.push_back(std::move(n));
    const int64_t H = static_cast<int64_t>(h), F = static_cast<int64_t>(f),
                  KVD = static_cast<int64_t>(kvd);
    Linear(c, ts, "attention.wq", H, H);
    Linear(c, ts, "attention.wk", H, KVD);
    Linear(c, ts, "attention.wv", H, KVD);
    Linear(c, ts, "attention.wo", H, H);
    for (TensorSpec& n : NormTensors(c, "ffn_norm")) ts.push_back(std::move(n));
    Linear(c, ts, "feed_forward.w1", H, F);
    if (c.gated_ffn) Linear(c, ts, "feed_forward.w3", H, F);
    Linear(c, ts, "feed_forward.w2", F, H);
    const uint64_t fwd = layer_matmul + layer_attention;
    m.units.push_back(std::move(layer));
    m.forward.push_back({.unit = static_cast<int>(m.units.size()) - 1,
                         .forward_flops = fwd,
                         .backward_flops = 2 * fwd,
                         .activation_bytes = layer_activations,
                         .checkpointed_activation_bytes = p * h * t,
                         .selective = true,
                         .selective_activation_bytes = sac_kept * t,
                         .selective_recompute_flops = sac_recompute * t,
                         .has_work = true,
                         .forward_work = layer_work,
                         .selective_recompute_work = sac_work});
  }

  // Head: final norm and output projection (or the embedding again, tied).
  const uint64_t head_fwd = 2 * t * V * h;
  const uint64_t head_act = (2 * p * h + 4 * V) * t;
  UnitUse head{.forward_flops = head_fwd,
               .backward_flops = 2 * head_fwd,
               .activation_bytes = head_act,
               .checkpointed_activation_bytes = head_act,
               .selective = true,
               .selective_activation_bytes = head_act,
               .has_work = true,
               // The final norm (h in and out), and the loss's softmax over f32 logits.
               .forward_work = {.matmul_flops = static_cast<double>(head_fwd),
                                .elementwise_bytes = static_cast<double>((2 * p * h + 8 * V) * t)},
               .selective_recompute_work = {}};
  if (c.tied_embeddings) {
    head.unit = 0;
  } else {
    UnitDescription unit{.name = "head"};
    unit.tensors = NormTensors(c, "norm");
    unit.tensors.push_back(
        {.name = "output.weight", .shape = {static_cast<int64_t>(V), static_cast<int64_t>(h)}});
    m.units.push_back(std::move(unit));
    head.unit = static_cast<int>(m.units.size()) - 1;
  }
  m.forward.push_back(head);
  SL_RETURN_IF_ERROR(m.Validate());
  return m;
}

TransformerConfig Llama3_8B(PresetShape shape) {
  return {.name = "llama3-8b",
          .layers = 32,
          .hidden = 4096,
          .ffn = 14336,
          .heads = 32,
          .kv_heads = 8,
          .vocab = 128256,
          .seq_len = shape.seq_len,
          .micro_batch = shape.micro_batch};
}

TransformerConfig Llama3_70B(PresetShape shape) {
  return {.name = "llama3-70b",
          .layers = 80,
          .hidden = 8192,
          .ffn = 28672,
          .heads = 64,
          .kv_heads = 8,
          .vocab = 128256,
          .seq_len = shape.seq_len,
          .micro_batch = shape.micro_batch};
}

TransformerConfig Llama3_405B(PresetShape shape) {
  return {.name = "llama3-405b",
          .layers = 126,
          .hidden = 16384,
          .ffn = 53248,
          .heads = 128,
          .kv_heads = 8,
          .vocab = 128256,
          .seq_len = shape.seq_len,
          .micro_batch = shape.micro_batch};
}

TransformerConfig Gpt3_175B(PresetShape shape) {
  return {.name = "gpt3-175b",
          .layers = 96,
          .hidden = 12288,
          .ffn = 4 * 12288,
          .heads = 96,
          .kv_heads = 96,
          .vocab = 50257,
          .seq_len = shape.seq_len,
          .micro_batch = shape.micro_batch,
          .gated_ffn = false,
          .layer_norm = true,
          .biases = true,
          .tied_embeddings = true,
          .learned_positions = 2048,
          .dropout = true,
          .fused_attention = false};
}

absl::StatusOr<TransformerConfig> PresetByName(absl::string_view name, PresetShape shape) {
  if (name == "llama3-8b") return Llama3_8B(shape);
  if (name == "llama3-70b") return Llama3_70B(shape);
  if (name == "llama3-405b") return Llama3_405B(shape);
  if (name == "gpt3-175b") return Gpt3_175B(shape);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model preset \"", name,
                   "\" (known: llama3-8b, llama3-70b, llama3-405b, gpt3-175b)"));
}

}  // namespace shardline
