// The checkpoint manifest: building it, writing and reading manifest.json, and checking it
// (scheduler/checkpoint/manifest.h).

#include "scheduler/checkpoint/manifest.h"

#include <cinttypes>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {

bool IsValidCheckpointStateName(absl::string_view name) {
  if (name.empty() || name.size() > 128) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string CheckpointShardFileName(int shard, int num_shards) {
  return absl::StrFormat("shard-%05d-of-%05d.bin", shard, num_shards);
}

absl::StatusOr<CheckpointManifest> MakeCheckpointManifest(
    const std::vector<CheckpointUnitContents>& units, int replicate_size, int shard_size,
    uint64_t block_bytes, std::string library_version) {
  if (block_bytes == 0) {
    return absl::InvalidArgumentError("MakeCheckpointManifest: checksum_block_bytes is 0");
  }
  if (shard_size < 1 || replicate_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCheckpointManifest: mesh ", replicate_size,
                                                   " x ", shard_size, " is not a mesh"));
  }
  CheckpointManifest m;
  m.library_version = std::move(library_version);
  m.world_size = replicate_size * shard_size;
  m.replicate_size = replicate_size;
  m.shard_size = shard_size;
  m.checksum_block_bytes = block_bytes;
  for (int s = 0; s < shard_size; ++s) {
    m.files.push_back({.name = CheckpointShardFileName(s, shard_size), .shard = s, .bytes = 0});
  }
  for (const CheckpointUnitContents& unit : units) {
    const FlatLayout& layout = unit.layout;
    if (layout.num_shards() != shard_size) {
      return absl::InvalidArgumentError(absl::StrCat("MakeCheckpointManifest: unit '", unit.name,
                                                     "' has ", layout.num_shards(),
                                                     " shards, the mesh ", shard_size));
    }
    CheckpointUnitRecord record;
    record.name = unit.name;
    record.tensors = layout.specs();
    record.options = layout.options();
    for (const FlatTensor& t : layout.tensors()) record.tensor_offsets.push_back(t.offset);
    record.shard_elements = layout.shard_elements();
    record.layout = layout;
    for (const CheckpointUnitContents::State& state : unit.states) {
      CheckpointStateRecord st{.name = state.name, .dtype = state.dtype};
      const uint64_t size = DTypeSize(state.dtype);
      for (const ShardSlice& slice : layout.slices()) {
        CheckpointFileRecord& file = m.files[slice.shard];
        CheckpointPiece piece{.tensor = slice.tensor,
                              .shard = slice.shard,
                              .tensor_offset = slice.tensor_offset,
                              .elements = slice.length,
                              .shard_offset = slice.shard_offset,
                              .file = slice.shard,
                              .file_offset = file.bytes,
                              .bytes = slice.length * size};
        if (slice.length > std::numeric_limits<uint64_t>::max() / size ||
            file.bytes > std::numeric_limits<uint64_t>::max() - piece.bytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("MakeCheckpointManifest: file ", file.name, " would exceed 2^64 bytes"));
        }
        piece.crc32c.assign(CheckpointBlockCount(piece.bytes, block_bytes), 0);
        file.bytes += piece.bytes;
        st.pieces.push_back(std::move(piece));
      }
      record.states.push_back(std::move(st));
    }
    m.units.push_back(std::move(record));
  }
  return m;
}

namespace {

// numel(shape) * size, or InvalidArgument naming the state.
absl::StatusOr<uint64_t> ReplicatedBytes(const CheckpointReplicatedRecord& r) {
  uint64_t n = DTypeSize(r.dtype);
  for (const int64_t d : r.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("replicated state '", r.name, "': dimension ", d, " is negative"));
    }
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError(
          absl::StrCat("replicated state '", r.name, "': its size exceeds 2^64 bytes"));
    }
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

}  // namespace

absl::Status SetCheckpointReplicatedStates(CheckpointManifest* m,
                                           std::vector<CheckpointReplicatedRecord> states) {
  uint64_t offset = 0;
  absl::flat_hash_set<std::string> names;
  for (CheckpointReplicatedRecord& r : states) {
    if (!IsValidCheckpointStateName(r.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replicated state '", r.name, "': a name is 1-128 characters of [A-Za-z0-9._-]"));
    }
    if (!names.insert(r.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("replicated state '", r.name, "' appears twice"));
    }
    SL_ASSIGN_OR_RETURN(r.bytes, ReplicatedBytes(r));
    if (offset > std::numeric_limits<uint64_t>::max() - r.bytes) {
      return absl::InvalidArgumentError("the replicated states exceed 2^64 bytes");
    }
    r.file_offset = offset;
    r.crc32c = 0;
    offset += r.bytes;
  }
  m->replicated = std::move(states);
  m->replicated_bytes = offset;
  return absl::OkStatus();
}

// ---- Writing ---------------------------------------------------------------------------------

std::string CheckpointManifestToJson(const CheckpointManifest& m) {
  std::string out;
  absl::StrAppend(
      &out, "{\n  \"format\": ", JsonQuote(kCheckpointFormat),
      ",\n  \"format_version\": ", m.format_version,
      ",\n  \"library_version\": ", JsonQuote(m.library_version),
      ",\n  \"world_size\": ", m.world_size, ",\n  \"mesh\": {\"replicate\": ", m.replicate_size,
      ", \"shard\": ", m.shard_size, "}",
      ",\n  \"checksum\": \"crc32c\",\n  \"checksum_block_bytes\": ", m.checksum_block_bytes,
      ",\n  \"files\": [");
  for (size_t f = 0; f < m.files.size(); ++f) {
    const CheckpointFileRecord& file = m.files[f];
    absl::StrAppend(&out, f == 0 ? "\n" : ",\n", "    {\"name\": ", JsonQuote(file.name),
                    ", \"shard\": ", file.shard, ", \"bytes\": ", file.bytes, "}");
  }
  absl::StrAppend(&out, m.files.empty() ? "]" : "\n  ]", ",\n  \"units\": [");
  for (size_t u = 0; u < m.units.size(); ++u) {
    const CheckpointUnitRecord& unit = m.units[u];
    const FlatLayoutOptions& o = unit.options;
    absl::StrAppend(
        &out, u == 0 ? "\n" : ",\n", "    {\n      \"name\": ", JsonQuote(unit.name),
        ",\n      \"layout\": {\"element_dtype\": ", JsonQuote(DTypeName(o.element_dtype)),
        ", \"num_shards\": ", o.num_shards, ", \"alignment_bytes\": ", o.alignment_bytes,
        ", \"block_elements\": ", o.block_elements, ", \"shard_elements\": ", unit.shard_elements,
        ",\n        \"tensors\": [");
    for (size_t t = 0; t < unit.tensors.size(); ++t) {
      const TensorSpec& spec = unit.tensors[t];
      absl::StrAppend(&out, t == 0 ? "\n" : ",\n", "          {\"name\": ", JsonQuote(spec.name),
                      ", \"shape\": [", absl::StrJoin(spec.shape, ", "),
                      "], \"dtype\": ", JsonQuote(DTypeName(spec.dtype)),
                      ", \"tied_to\": ", JsonQuote(spec.tied_to),
                      ", \"offset\": ", unit.tensor_offsets[t], "}");
    }
    absl::StrAppend(&out, unit.tensors.empty() ? "]}" : "\n        ]}", ",\n      \"states\": [");
    for (size_t k = 0; k < unit.states.size(); ++k) {
      const CheckpointStateRecord& st = unit.states[k];
      absl::StrAppend(&out, k == 0 ? "\n" : ",\n", "        {\"name\": ", JsonQuote(st.name),
                      ", \"dtype\": ", JsonQuote(DTypeName(st.dtype)), ", \"pieces\": [");
      for (size_t p = 0; p < st.pieces.size(); ++p) {
        const CheckpointPiece& piece = st.pieces[p];
        absl::StrAppend(&out, p == 0 ? "\n" : ",\n",
                        "          {\"tensor\": ", JsonQuote(unit.tensors[piece.tensor].name),
                        ", \"shard\": ", piece.shard, ", \"tensor_offset\": ", piece.tensor_offset,
                        ", \"elements\": ", piece.elements,
                        ", \"shard_offset\": ", piece.shard_offset,
                        ", \"file\": ", JsonQuote(m.files[piece.file].name),
                        ", \"file_offset\": ", piece.file_offset, ", \"bytes\": ", piece.bytes,
                        ", \"crc32c\": [",
                        absl::StrJoin(piece.crc32c, ", ",
                                      [](std::string* o, uint32_t c) {
                                        absl::StrAppend(o, "\"", absl::StrFormat("%08x", c), "\"");
                                      }),
                        "]}");
      }
      absl::StrAppend(&out, st.pieces.empty() ? "]}" : "\n        ]}");
    }
    absl::StrAppend(&out, unit.states.empty() ? "]\n    }" : "\n      ]\n    }");
  }
  absl::StrAppend(&out, m.units.empty() ? "]" : "\n  ]");
  if (!m.replicated.empty()) {
    absl::StrAppend(&out,
                    ",\n  \"replicated\": {\"file\": ", JsonQuote(kCheckpointReplicatedFileName),
                    ", \"bytes\": ", m.replicated_bytes, ", \"states\": [");
    for (size_t i = 0; i < m.replicated.size(); ++i) {
      const CheckpointReplicatedRecord& r = m.replicated[i];
      absl::StrAppend(&out, i == 0 ? "\n" : ",\n", "    {\"name\": ", JsonQuote(r.name),
                      ", \"shape\": [", absl::StrJoin(r.shape, ", "),
                      "], \"dtype\": ", JsonQuote(DTypeName(r.dtype)),
                      ", \"file_offset\": ", r.file_offset, ", \"bytes\": ", r.bytes,
                      ", \"crc32c\": \"", absl::StrFormat("%08x", r.crc32c), "\"}");
    }
    absl::StrAppend(&out, "\n  ]}");
  }
  absl::StrAppend(&out, "\n}\n");
  return out;
}

// ---- Reading ---------------------------------------------------------------------------------

namespace {

absl::Status FieldError(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

absl::StatusOr<const JsonValue*> Member(const JsonValue& object, absl::string_view path,
                                        absl::string_view key) {
  const JsonValue* v = object.Find(key);
  if (v == nullptr) return FieldError(path, absl::StrCat("missing member \"", key, "\""));
  return v;
}

absl::Status ExpectKind(const JsonValue& v, JsonValue::Kind kind, absl::string_view path) {
  if (v.kind() != kind) {
    return FieldError(
        path, absl::StrCat("expected ", JsonKindName(kind), ", found ", JsonKindName(v.kind())));
  }
  return absl::OkStatus();
}

std::string Sub(absl::string_view path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}
std::string Index(absl::string_view path, size_t i) { return absl::StrCat(path, "[", i, "]"); }

absl::StatusOr<const JsonValue*> Typed(const JsonValue& object, absl::string_view path,
                                       absl::string_view key, JsonValue::Kind kind) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Member(object, path, key));
  SL_RETURN_IF_ERROR(ExpectKind(*v, kind, Sub(path, key)));
  return v;
}

absl::StatusOr<int64_t> Integer(const JsonValue& object, absl::string_view path,
                                absl::string_view key, int64_t min, int64_t max) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Typed(object, path, key, JsonValue::Kind::kInteger));
  if (v->integer() < min || v->integer() > max) {
    return FieldError(Sub(path, key),
                      absl::StrCat(v->integer(), " is outside [", min, ", ", max, "]"));
  }
  return v->integer();
}

absl::StatusOr<std::string> String(const JsonValue& object, absl::string_view path,
                                   absl::string_view key) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Typed(object, path, key, JsonValue::Kind::kString));
  return v->string();
}

absl::StatusOr<DType> DTypeField(const JsonValue& object, absl::string_view path,
                                 absl::string_view key) {
  SL_ASSIGN_OR_RETURN(std::string name, String(object, path, key));
  for (DType d : kAllDTypes) {
    if (DTypeName(d) == name) return d;
  }
  return FieldError(Sub(path, key), absl::StrCat("\"", name, "\" is not a dtype name"));
}

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// A checksum: 8 lower-case hex digits.
absl::StatusOr<uint32_t> ParseCrc(const JsonValue& c, const std::string& path) {
  SL_RETURN_IF_ERROR(ExpectKind(c, JsonValue::Kind::kString, path));
  uint32_t value = 0;
  bool ok = c.string().size() == 8;
  for (char h : c.string()) {
    value <<= 4;
    if (h >= '0' && h <= '9') {
      value |= static_cast<uint32_t>(h - '0');
    } else if (h >= 'a' && h <= 'f') {
      value |= static_cast<uint32_t>(h - 'a' + 10);
    } else {
      ok = false;
    }
  }
  if (!ok)
    return FieldError(path, absl::StrCat("\"", c.string(), "\" is not 8 lower-case hex digits"));
  return value;
}

// A shape: an array of at most kMaxFlatTensorRank integers.
absl::StatusOr<std::vector<int64_t>> ParseShape(const JsonValue& object, const std::string& path) {
  SL_ASSIGN_OR_RETURN(const JsonValue* shape,
                      Typed(object, path, "shape", JsonValue::Kind::kArray));
  if (shape->items().size() > kMaxFlatTensorRank) {
    return FieldError(Sub(path, "shape"), absl::StrCat("rank ", shape->items().size(), " exceeds ",
                                                       kMaxFlatTensorRank));
  }
  std::vector<int64_t> out;
  for (size_t d = 0; d < shape->items().size(); ++d) {
    const JsonValue& dim = shape->items()[d];
    SL_RETURN_IF_ERROR(ExpectKind(dim, JsonValue::Kind::kInteger, Index(Sub(path, "shape"), d)));
    out.push_back(dim.integer());
  }
  return out;
}

using NameIndex = absl::flat_hash_map<std::string, int>;

absl::StatusOr<CheckpointPiece> ParsePiece(const JsonValue& v, const std::string& path,
                                           const CheckpointUnitRecord& unit,
                                           const NameIndex& tensor_index,
                                           const NameIndex& file_index) {
  SL_RETURN_IF_ERROR(ExpectKind(v, JsonValue::Kind::kObject, path));
  CheckpointPiece piece;
  SL_ASSIGN_OR_RETURN(std::string tensor, String(v, path, "tensor"));
  const auto t = tensor_index.find(tensor);
  piece.tensor = t == tensor_index.end() ? -1 : t->second;
  if (piece.tensor < 0) {
    return FieldError(Sub(path, "tensor"),
                      absl::StrCat("\"", tensor, "\" is not a tensor of unit '", unit.name, "'"));
  }
  SL_ASSIGN_OR_RETURN(int64_t shard, Integer(v, path, "shard", 0, kMaxFlatLayoutShards - 1));
  piece.shard = static_cast<int>(shard);
  SL_ASSIGN_OR_RETURN(int64_t tensor_offset, Integer(v, path, "tensor_offset", 0, kMaxInt));
  SL_ASSIGN_OR_RETURN(int64_t elements, Integer(v, path, "elements", 0, kMaxInt));
  SL_ASSIGN_OR_RETURN(int64_t shard_offset, Integer(v, path, "shard_offset", 0, kMaxInt));
  SL_ASSIGN_OR_RETURN(std::string file, String(v, path, "file"));
  const auto f = file_index.find(file);
  piece.file = f == file_index.end() ? -1 : f->second;
  if (piece.file < 0) {
    return FieldError(Sub(path, "file"), absl::StrCat("\"", file, "\" is not in \"files\""));
  }
  SL_ASSIGN_OR_RETURN(int64_t file_offset, Integer(v, path, "file_offset", 0, kMaxInt));
  SL_ASSIGN_OR_RETURN(int64_t bytes, Integer(v, path, "bytes", 0, kMaxInt));
  piece.tensor_offset = static_cast<uint64_t>(tensor_offset);
  piece.elements = static_cast<uint64_t>(elements);
  piece.shard_offset = static_cast<uint64_t>(shard_offset);
  piece.file_offset = static_cast<uint64_t>(file_offset);
  piece.bytes = static_cast<uint64_t>(bytes);
  SL_ASSIGN_OR_RETURN(const JsonValue* crcs, Typed(v, path, "crc32c", JsonValue::Kind::kArray));
  for (size_t i = 0; i < crcs->items().size(); ++i) {
    SL_ASSIGN_OR_RETURN(uint32_t value, ParseCrc(crcs->items()[i], Index(Sub(path, "crc32c"), i)));
    piece.crc32c.push_back(value);
  }
  return piece;
}

absl::StatusOr<CheckpointUnitRecord> ParseUnit(const JsonValue& v, const std::string& path,
                                               const NameIndex& file_index) {
  SL_RETURN_IF_ERROR(ExpectKind(v, JsonValue::Kind::kObject, path));
  CheckpointUnitRecord unit;
  SL_ASSIGN_OR_RETURN(unit.name, String(v, path, "name"));
  const std::string lpath = Sub(path, "layout");
  SL_ASSIGN_OR_RETURN(const JsonValue* layout, Typed(v, path, "layout", JsonValue::Kind::kObject));
  SL_ASSIGN_OR_RETURN(unit.options.element_dtype, DTypeField(*layout, lpath, "element_dtype"));
  SL_ASSIGN_OR_RETURN(int64_t num_shards,
                      Integer(*layout, lpath, "num_shards", 1, kMaxFlatLayoutShards));
  unit.options.num_shards = static_cast<int>(num_shards);
  SL_ASSIGN_OR_RETURN(int64_t alignment, Integer(*layout, lpath, "alignment_bytes", 1, kMaxInt));
  SL_ASSIGN_OR_RETURN(int64_t block, Integer(*layout, lpath, "block_elements", 1, kMaxInt));
  SL_ASSIGN_OR_RETURN(int64_t shard_elements,
                      Integer(*layout, lpath, "shard_elements", 0, kMaxInt));
  unit.options.alignment_bytes = static_cast<size_t>(alignment);
  unit.options.block_elements = static_cast<size_t>(block);
  unit.shard_elements = static_cast<uint64_t>(shard_elements);
  const std::string tpath = Sub(lpath, "tensors");
  SL_ASSIGN_OR_RETURN(const JsonValue* tensors,
                      Typed(*layout, lpath, "tensors", JsonValue::Kind::kArray));
  for (size_t t = 0; t < tensors->items().size(); ++t) {
    const JsonValue& tv = tensors->items()[t];
    const std::string p = Index(tpath, t);
    SL_RETURN_IF_ERROR(ExpectKind(tv, JsonValue::Kind::kObject, p));
    TensorSpec spec;
    SL_ASSIGN_OR_RETURN(spec.name, String(tv, p, "name"));
    SL_ASSIGN_OR_RETURN(spec.shape, ParseShape(tv, p));
    SL_ASSIGN_OR_RETURN(spec.dtype, DTypeField(tv, p, "dtype"));
    SL_ASSIGN_OR_RETURN(spec.tied_to, String(tv, p, "tied_to"));
    SL_ASSIGN_OR_RETURN(int64_t offset, Integer(tv, p, "offset", 0, kMaxInt));
    unit.tensors.push_back(std::move(spec));
    unit.tensor_offsets.push_back(static_cast<uint64_t>(offset));
  }
  NameIndex tensor_index;
  for (size_t t = 0; t < unit.tensors.size(); ++t) {
    tensor_index.emplace(unit.tensors[t].name, static_cast<int>(t));  // the first of duplicates
  }
  const std::string spath = Sub(path, "states");
  SL_ASSIGN_OR_RETURN(const JsonValue* states, Typed(v, path, "states", JsonValue::Kind::kArray));
  for (size_t k = 0; k < states->items().size(); ++k) {
    const JsonValue& sv = states->items()[k];
    const std::string p = Index(spath, k);
    SL_RETURN_IF_ERROR(ExpectKind(sv, JsonValue::Kind::kObject, p));
    CheckpointStateRecord st;
    SL_ASSIGN_OR_RETURN(st.name, String(sv, p, "name"));
    for (const CheckpointStateRecord& other : unit.states) {
      if (other.name == st.name) {
        return FieldError(Sub(p, "name"), absl::StrCat("state \"", st.name, "\" appears twice"));
      }
    }
    SL_ASSIGN_OR_RETURN(st.dtype, DTypeField(sv, p, "dtype"));
    SL_ASSIGN_OR_RETURN(const JsonValue* pieces, Typed(sv, p, "pieces", JsonValue::Kind::kArray));
    for (size_t i = 0; i < pieces->items().size(); ++i) {
      SL_ASSIGN_OR_RETURN(CheckpointPiece piece,
                          ParsePiece(pieces->items()[i], Index(Sub(p, "pieces"), i), unit,
                                     tensor_index, file_index));
      st.pieces.push_back(std::move(piece));
    }
    unit.states.push_back(std::move(st));
  }
  return unit;
}

}  // namespace

absl::StatusOr<CheckpointManifest> ParseCheckpointManifest(absl::string_view json) {
  if (json.size() > kMaxCheckpointManifestBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest of ", json.size(), " bytes exceeds ", kMaxCheckpointManifestBytes));
  }
  SL_ASSIGN_OR_RETURN(JsonValue root, ParseJson(json));
  SL_RETURN_IF_ERROR(ExpectKind(root, JsonValue::Kind::kObject, "the manifest"));
  CheckpointManifest m;
  SL_ASSIGN_OR_RETURN(std::string format, String(root, "", "format"));
  if (format != kCheckpointFormat) {
    return FieldError("format",
                      absl::StrCat("\"", format, "\" is not \"", kCheckpointFormat, "\""));
  }
  SL_ASSIGN_OR_RETURN(int64_t version, Integer(root, "", "format_version", 0, kMaxInt));
  if (version != kCheckpointFormatVersion) {
    return FieldError("format_version",
                      absl::StrCat("version ", version, " is not supported (this build reads ",
                                   kCheckpointFormatVersion, ")"));
  }
  m.format_version = static_cast<int>(version);
  SL_ASSIGN_OR_RETURN(m.library_version, String(root, "", "library_version"));
  SL_ASSIGN_OR_RETURN(int64_t world, Integer(root, "", "world_size", 1, kMaxFlatLayoutShards));
  m.world_size = static_cast<int>(world);
  SL_ASSIGN_OR_RETURN(const JsonValue* mesh, Typed(root, "", "mesh", JsonValue::Kind::kObject));
  SL_ASSIGN_OR_RETURN(int64_t replicate, Integer(*mesh, "mesh", "replicate", 1, world));
  SL_ASSIGN_OR_RETURN(int64_t shard, Integer(*mesh, "mesh", "shard", 1, world));
  if (replicate * shard != world) {
    return FieldError("mesh", absl::StrCat(replicate, " x ", shard, " is not world_size ", world));
  }
  m.replicate_size = static_cast<int>(replicate);
  m.shard_size = static_cast<int>(shard);
  SL_ASSIGN_OR_RETURN(std::string checksum, String(root, "", "checksum"));
  if (checksum != "crc32c") {
    return FieldError("checksum", absl::StrCat("\"", checksum, "\" is not \"crc32c\""));
  }
  SL_ASSIGN_OR_RETURN(int64_t block, Integer(root, "", "checksum_block_bytes", 1, kMaxInt));
  m.checksum_block_bytes = static_cast<uint64_t>(block);
  SL_ASSIGN_OR_RETURN(const JsonValue* files, Typed(root, "", "files", JsonValue::Kind::kArray));
  for (size_t f = 0; f < files->items().size(); ++f) {
    const JsonValue& fv = files->items()[f];
    const std::string p = Index("files", f);
    SL_RETURN_IF_ERROR(ExpectKind(fv, JsonValue::Kind::kObject, p));
    CheckpointFileRecord file;
    SL_ASSIGN_OR_RETURN(file.name, String(fv, p, "name"));
    SL_ASSIGN_OR_RETURN(int64_t fshard, Integer(fv, p, "shard", 0, kMaxFlatLayoutShards - 1));
    SL_ASSIGN_OR_RETURN(int64_t bytes, Integer(fv, p, "bytes", 0, kMaxInt));
    file.shard = static_cast<int>(fshard);
    file.bytes = static_cast<uint64_t>(bytes);
    m.files.push_back(std::move(file));
  }
  NameIndex file_index;
  for (size_t f = 0; f < m.files.size(); ++f) {
    if (!file_index.emplace(m.files[f].name, static_cast<int>(f)).second) {
      return FieldError(Sub(Index("files", f), "name"),
                        absl::StrCat("file \"", m.files[f].name, "\" appears twice"));
    }
  }
  SL_ASSIGN_OR_RETURN(const JsonValue* units, Typed(root, "", "units", JsonValue::Kind::kArray));
  absl::flat_hash_set<std::string> unit_names;
  for (size_t u = 0; u < units->items().size(); ++u) {
    SL_ASSIGN_OR_RETURN(CheckpointUnitRecord unit,
                        ParseUnit(units->items()[u], Index("units", u), file_index));
    if (!unit_names.insert(unit.name).second) {
      return FieldError(Sub(Index("units", u), "name"),
                        absl::StrCat("unit \"", unit.name, "\" appears twice"));
    }
    m.units.push_back(std::move(unit));
  }
  // Optional: absent when the checkpoint has no replicated states.
  if (const JsonValue* rep = root.Find("replicated"); rep != nullptr) {
    SL_RETURN_IF_ERROR(ExpectKind(*rep, JsonValue::Kind::kObject, "replicated"));
    SL_ASSIGN_OR_RETURN(std::string file, String(*rep, "replicated", "file"));
    if (file != kCheckpointReplicatedFileName) {
      return FieldError("replicated.file", absl::StrCat("\"", file, "\" is not \"",
                                                        kCheckpointReplicatedFileName, "\""));
    }
    SL_ASSIGN_OR_RETURN(int64_t bytes, Integer(*rep, "replicated", "bytes", 0, kMaxInt));
    m.replicated_bytes = static_cast<uint64_t>(bytes);
    SL_ASSIGN_OR_RETURN(const JsonValue* states,
                        Typed(*rep, "replicated", "states", JsonValue::Kind::kArray));
    for (size_t i = 0; i < states->items().size(); ++i) {
      const JsonValue& sv = states->items()[i];
      const std::string p = Index("replicated.states", i);
      SL_RETURN_IF_ERROR(ExpectKind(sv, JsonValue::Kind::kObject, p));
      CheckpointReplicatedRecord r;
      SL_ASSIGN_OR_RETURN(r.name, String(sv, p, "name"));
      SL_ASSIGN_OR_RETURN(r.shape, ParseShape(sv, p));
      SL_ASSIGN_OR_RETURN(r.dtype, DTypeField(sv, p, "dtype"));
      SL_ASSIGN_OR_RETURN(int64_t offset, Integer(sv, p, "file_offset", 0, kMaxInt));
      SL_ASSIGN_OR_RETURN(int64_t rbytes, Integer(sv, p, "bytes", 0, kMaxInt));
      SL_ASSIGN_OR_RETURN(const JsonValue* crc, Member(sv, p, "crc32c"));
      SL_ASSIGN_OR_RETURN(r.crc32c, ParseCrc(*crc, Sub(p, "crc32c")));
      r.file_offset = static_cast<uint64_t>(offset);
      r.bytes = static_cast<uint64_t>(rbytes);
      m.replicated.push_back(std::move(r));
    }
  }
  return m;
}

absl::Status ValidateCheckpointManifest(CheckpointManifest& m) {
  if (static_cast<int>(m.files.size()) != m.shard_size) {
    return FieldError("files", absl::StrCat(m.files.size(), " files for ", m.shard_size,
                                            " shards (one per shard)"));
  }
  for (int s = 0; s < m.shard_size; ++s) {
    const CheckpointFileRecord& file = m.files[s];
    const std::string expected = CheckpointShardFileName(s, m.shard_size);
    if (file.shard != s || file.name != expected) {
      return FieldError(Index("files", s),
                        absl::StrCat("\"", file.name, "\" for shard ", file.shard, ", expected \"",
                                     expected, "\" for shard ", s));
    }
  }
  std::vector<uint64_t> file_bytes(m.files.size(), 0);
  for (size_t u = 0; u < m.units.size(); ++u) {
    CheckpointUnitRecord& unit = m.units[u];
    const std::string upath = absl::StrCat("unit '", unit.name, "'");
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(unit.tensors, unit.options);
    if (!layout.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(upath, ": its layout is invalid: ", layout.status().message()));
    }
    if (layout->num_shards() != m.shard_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(upath, ": ", layout->num_shards(), " shards, the mesh has ", m.shard_size));
    }
    if (layout->shard_elements() != unit.shard_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat(upath, ": shard_elements ", unit.shard_elements, " differs from the ",
                       layout->shard_elements(), " of its tensors and options"));
    }
    for (int t = 0; t < layout->num_tensors(); ++t) {
      if (layout->tensor(t).offset != unit.tensor_offsets[t]) {
        return absl::InvalidArgumentError(absl::StrCat(
            upath, " tensor '", unit.tensors[t].name, "': offset ", unit.tensor_offsets[t],
            " differs from the ", layout->tensor(t).offset, " of its tensors and options"));
      }
    }
    unit.layout = *std::move(layout);
    const absl::Span<const ShardSlice> slices = unit.layout.slices();
    for (const CheckpointStateRecord& st : unit.states) {
      const std::string spath = absl::StrCat(upath, " state '", st.name, "'");
      if (st.pieces.size() != slices.size()) {
        return absl::InvalidArgumentError(absl::StrCat(spath, ": ", st.pieces.size(),
                                                       " pieces, its layout has ", slices.size(),
                                                       " (tensor, shard) slices"));
      }
      const uint64_t size = DTypeSize(st.dtype);
      for (size_t i = 0; i < slices.size(); ++i) {
        const ShardSlice& slice = slices[i];
        const CheckpointPiece& piece = st.pieces[i];
        const std::string ppath =
            absl::StrCat(spath, " piece ", i, " (tensor '", unit.tensors[slice.tensor].name,
                         "', shard ", slice.shard, ")");
        std::string diff;
        auto check = [&](absl::string_view field, uint64_t stated, uint64_t derived) {
          if (diff.empty() && stated != derived) {
            diff = absl::StrCat(field, " is ", stated, ", the layout gives ", derived);
          }
        };
        if (piece.tensor != slice.tensor) {
          diff = absl::StrCat("tensor is '", unit.tensors[piece.tensor].name, "'");
        }
        check("shard", piece.shard, slice.shard);
        check("tensor_offset", piece.tensor_offset, slice.tensor_offset);
        check("elements", piece.elements, slice.length);
        check("shard_offset", piece.shard_offset, slice.shard_offset);
        check("file (index)", piece.file, slice.shard);
        check("file_offset", piece.file_offset, file_bytes[slice.shard]);
        check("bytes", piece.bytes, slice.length * size);
        check("checksum count", piece.crc32c.size(),
              CheckpointBlockCount(slice.length * size, m.checksum_block_bytes));
        if (!diff.empty()) return absl::InvalidArgumentError(absl::StrCat(ppath, ": ", diff));
        file_bytes[slice.shard] += piece.bytes;
      }
    }
  }
  for (size_t f = 0; f < m.files.size(); ++f) {
    if (m.files[f].bytes != file_bytes[f]) {
      return FieldError(Index("files", f),
                        absl::StrCat("\"", m.files[f].name, "\" has bytes ", m.files[f].bytes,
                                     ", its pieces add up to ", file_bytes[f]));
    }
  }
  // The replicated states: recompute offsets and sizes from names, shapes and dtypes.
  CheckpointManifest derived;
  std::vector<CheckpointReplicatedRecord> stated = m.replicated;
  SL_RETURN_IF_ERROR(SetCheckpointReplicatedStates(&derived, stated));
  for (size_t i = 0; i < stated.size(); ++i) {
    const CheckpointReplicatedRecord& a = stated[i];
    const CheckpointReplicatedRecord& b = derived.replicated[i];
    if (a.file_offset != b.file_offset || a.bytes != b.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replicated state '", a.name, "': file_offset ", a.file_offset, " and bytes ", a.bytes,
          ", its shape and dtype give ", b.file_offset, " and ", b.bytes));
    }
  }
  if (derived.replicated_bytes != m.replicated_bytes) {
    return FieldError(
        "replicated.bytes",
        absl::StrCat(m.replicated_bytes, ", its states add up to ", derived.replicated_bytes));
  }
  return absl::OkStatus();
}

bool IsCheckpointTemporaryDir(absl::string_view dir) {
  while (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  constexpr absl::string_view kTag = ".tmp-";
  constexpr size_t kNonceDigits = 16;
  if (dir.size() < kTag.size() + kNonceDigits) return false;
  const absl::string_view nonce = dir.substr(dir.size() - kNonceDigits);
  if (dir.substr(dir.size() - kNonceDigits - kTag.size(), kTag.size()) != kTag) return false;
  for (const char c : nonce) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::StatusOr<std::string> ReadCheckpointManifestText(FileSystem& fs, absl::string_view dir) {
  const std::string d(dir);
  SL_ASSIGN_OR_RETURN(bool exists, fs.Exists(d));
  if (!exists) {
    return absl::NotFoundError(absl::StrCat("checkpoint '", dir, "' does not exist"));
  }
  SL_ASSIGN_OR_RETURN(bool is_dir, fs.IsDirectory(d));
  if (!is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", dir, "' is a file, not a checkpoint directory"));
  }
  if (IsCheckpointTemporaryDir(dir)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incomplete checkpoint '", dir,
        "': a save's temporary directory (the save did not finish; it may be deleted)"));
  }
  const std::string path = absl::StrCat(dir, "/", kCheckpointManifestName);
  SL_ASSIGN_OR_RETURN(bool has_manifest, fs.Exists(path));
  if (!has_manifest) {
    return absl::FailedPreconditionError(
        absl::StrCat("incomplete checkpoint '", dir, "': it has no ", kCheckpointManifestName,
                     " (a save that did not finish; its data files may be partial)"));
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs.OpenFile(path));
  if (file->size() > kMaxCheckpointManifestBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is ", file->size(), " bytes, more than ", kMaxCheckpointManifestBytes));
  }
  std::string text(file->size(), '\0');
  SL_RETURN_IF_ERROR(file->ReadAt(0, text.size(), text.data()));
  return text;
}

absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(FileSystem& fs, absl::string_view dir) {
  SL_ASSIGN_OR_RETURN(std::string text, ReadCheckpointManifestText(fs, dir));
  absl::StatusOr<CheckpointManifest> m = ParseCheckpointManifest(text);
  if (m.ok()) {
    absl::Status valid = ValidateCheckpointManifest(*m);
    if (!valid.ok()) m = valid;
  }
  if (!m.ok()) {
    return Annotate(m.status(), absl::StrCat("checkpoint '", dir, "': ", kCheckpointManifestName));
  }
  return m;
}

}  // namespace shardline
