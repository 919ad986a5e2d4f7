// The safetensors reader and writer (scheduler/checkpoint/safetensors.h).

#include "scheduler/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {
namespace {

struct DTypeEntry {
  SafetensorsDType dtype;
  absl::string_view name;
  size_t size;
};
constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {SafetensorsDType::kBool, "BOOL", 1},
    {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},
    {SafetensorsDType::kF8E5M2, "F8_E5M2", 1},
    {SafetensorsDType::kF8E4M3, "F8_E4M3", 1},
    {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},
    {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},
    {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},
    {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},
    {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
}};

// a * b, or nullopt on overflow.
std::optional<uint64_t> MulChecked(uint64_t a, uint64_t b) {
  if (a != 0 && b > UINT64_MAX / a) return std::nullopt;
  return a * b;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status TensorError(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", what));
}

// One "<name>": {...} member of the header.
absl::StatusOr<SafetensorsTensor> ParseTensor(const std::string& name, const JsonValue& value) {
  if (name.empty()) return absl::InvalidArgumentError("a tensor has an empty name");
  if (value.kind() != JsonValue::Kind::kObject) {
    return TensorError(
        name, absl::StrCat("the entry is a JSON ", JsonKindName(value.kind()), ", not an object"));
  }
  SafetensorsTensor t;
  t.name = name;
  bool have_dtype = false, have_shape = false, have_offsets = false;
  for (const auto& [key, v] : value.members()) {
    if (key == "dtype") {
      if (v.kind() != JsonValue::Kind::kString) return TensorError(name, "dtype is not a string");
      absl::StatusOr<SafetensorsDType> dtype = ParseSafetensorsDType(v.string());
      if (!dtype.ok()) return TensorError(name, dtype.status().message());
      t.dtype = *dtype;
      have_dtype = true;
    } else if (key == "shape") {
      if (v.kind() != JsonValue::Kind::kArray) return TensorError(name, "shape is not an array");
      for (const JsonValue& d : v.items()) {
        if (d.kind() != JsonValue::Kind::kInteger || d.integer() < 0) {
          return TensorError(name, "shape holds something other than a non-negative integer");
        }
        t.shape.push_back(d.integer());
      }
      have_shape = true;
    } else if (key == "data_offsets") {
      if (v.kind() != JsonValue::Kind::kArray || v.items().size() != 2 ||
          v.items()[0].kind() != JsonValue::Kind::kInteger ||
          v.items()[1].kind() != JsonValue::Kind::kInteger || v.items()[0].integer() < 0 ||
          v.items()[1].integer() < 0) {
        return TensorError(name, "data_offsets is not [begin, end] of non-negative integers");
      }
      t.begin = static_cast<uint64_t>(v.items()[0].integer());
      t.end = static_cast<uint64_t>(v.items()[1].integer());
      have_offsets = true;
    } else {
      return TensorError(name, absl::StrCat("unknown member '", key,
                                            "' (a tensor has dtype, shape and data_offsets)"));
    }
  }
  if (!have_dtype || !have_shape || !have_offsets) {
    return TensorError(name, absl::StrCat("no ", !have_dtype   ? "dtype"
                                                 : !have_shape ? "shape"
                                                               : "data_offsets"));
  }
  if (t.end < t.begin) {
    return TensorError(
        name, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] end before they begin"));
  }
  std::optional<uint64_t> bytes = SafetensorsDTypeSize(t.dtype);
  for (const int64_t d : t.shape) {
    if (bytes.has_value()) bytes = MulChecked(*bytes, static_cast<uint64_t>(d));
  }
  if (!bytes.has_value()) {
    return TensorError(name, absl::StrCat("shape ", ShapeText(t.shape), " overflows"));
  }
  if (*bytes != t.bytes()) {
    return TensorError(
        name, absl::StrCat("shape ", ShapeText(t.shape), " ", SafetensorsDTypeName(t.dtype), " is ",
                           *bytes, " bytes, but data_offsets [", t.begin, ", ", t.end, "] hold ",
                           t.bytes()));
  }
  return t;
}

void IndexByName(SafetensorsHeader* header) {
  header->by_name.resize(header->tensors.size());
  for (size_t i = 0; i < header->by_name.size(); ++i) header->by_name[i] = i;
  std::sort(header->by_name.begin(), header->by_name.end(),
            [&](size_t a, size_t b) { return header->tensors[a].name < header->tensors[b].name; });
}

std::string ParentDir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string MakeNonce() {
  std::random_device device;
  uint64_t v = (static_cast<uint64_t>(device()) << 32) ^ device();
  v ^= static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return absl::StrFormat("%016x", v);
}

}  // namespace

absl::string_view SafetensorsDTypeName(SafetensorsDType dtype) {
  return kDTypes[static_cast<size_t>(dtype)].name;
}

size_t SafetensorsDTypeSize(SafetensorsDType dtype) {
  return kDTypes[static_cast<size_t>(dtype)].size;
}

absl::StatusOr<SafetensorsDType> ParseSafetensorsDType(absl::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  std::vector<absl::string_view> names;
  for (const DTypeEntry& e : kDTypes) names.push_back(e.name);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "' (accepted: ", absl::StrJoin(names, " "), ")"));
}

SafetensorsDType ToSafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return SafetensorsDType::kF32;
    case DType::kF64:
      return SafetensorsDType::kF64;
    case DType::kF16:
      return SafetensorsDType::kF16;
    case DType::kBF16:
      return SafetensorsDType::kBF16;
    case DType::kI8:
      return SafetensorsDType::kI8;
    case DType::kU8:
      return SafetensorsDType::kU8;
    case DType::kI32:
      return SafetensorsDType::kI32;
    case DType::kI64:
      return SafetensorsDType::kI64;
  }
  return SafetensorsDType::kU8;
}

std::optional<DType> FromSafetensorsDType(SafetensorsDType dtype) {
  for (const DType d : kAllDTypes) {
    if (ToSafetensorsDType(d) == dtype) return d;
  }
  return std::nullopt;
}

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (const int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

const SafetensorsTensor* SafetensorsHeader::Find(absl::string_view name) const {
  auto it = std::lower_bound(by_name.begin(), by_name.end(), name,
                             [&](size_t i, absl::string_view n) { return tensors[i].name < n; });
  if (it == by_name.end() || tensors[*it].name != name) return nullptr;
  return &tensors[*it];
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t data_bytes) {
  absl::StatusOr<JsonValue> parsed = ParseJson(json);
  if (!parsed.ok()) return Annotate(parsed.status(), "header");
  if (parsed->kind() != JsonValue::Kind::kObject) {
    return absl::InvalidArgumentError(
        absl::StrCat("header: a JSON ", JsonKindName(parsed->kind()), ", not an object"));
  }
  SafetensorsHeader header;
  header.header_bytes = json.size();
  for (const auto& [name, value] : parsed->members()) {
    if (name == kSafetensorsMetadataKey) {
      if (value.kind() != JsonValue::Kind::kObject) {
        return absl::InvalidArgumentError("header: __metadata__ is not an object");
      }
      for (const auto& [key, v] : value.members()) {
        if (v.kind() != JsonValue::Kind::kString) {
          return absl::InvalidArgumentError(absl::StrCat("header: __metadata__ member '", key,
                                                         "' is a JSON ", JsonKindName(v.kind()),
                                                         ", not a string"));
        }
        header.metadata.emplace_back(key, v.string());
      }
      continue;
    }
    SL_ASSIGN_OR_RETURN(SafetensorsTensor t, ParseTensor(name, value));
    header.tensors.push_back(std::move(t));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              if (a.begin != b.begin) return a.begin < b.begin;
              if (a.end != b.end) return a.end < b.end;
              return a.name < b.name;
            });
  // Back to back from 0: a tensor that begins before the previous one ended overlaps it; one that
  // begins after leaves a hole.
  uint64_t cursor = 0;
  const SafetensorsTensor* previous = nullptr;
  for (const SafetensorsTensor& t : header.tensors) {
    if (t.end > data_bytes) {
      return absl::DataLossError(absl::StrCat(
          "tensor '", t.name, "' (data_offsets [", t.begin, ", ", t.end,
          "]) lies beyond the end of the data, which has ", data_bytes, " bytes (truncated)"));
    }
    if (t.begin < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' (data_offsets [", t.begin, ", ", t.end, "]) overlaps tensor '",
          previous->name, "' (data_offsets [", previous->begin, ", ", previous->end, "])"));
    }
    if (t.begin > cursor) {
      return absl::InvalidArgumentError(absl::StrCat("data bytes [", cursor, ", ", t.begin,
                                                     ") belong to no tensor (before tensor '",
                                                     t.name, "')"));
    }
    cursor = t.end;
    previous = &t;
  }
  if (cursor != data_bytes) {
    return absl::DataLossError(absl::StrCat("the data has ", data_bytes,
                                            " bytes, the tensors end at byte ", cursor,
                                            " (bytes were added after them)"));
  }
  header.data_bytes = data_bytes;
  IndexByName(&header);
  return header;
}

absl::StatusOr<std::pair<std::string, SafetensorsHeader>> MakeSafetensorsHeader(
    const std::vector<SafetensorsTensorInfo>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  SafetensorsHeader header;
  std::string json = "{";
  if (!metadata.empty()) {
    absl::StrAppend(&json, JsonQuote(kSafetensorsMetadataKey), ":{");
    for (size_t i = 0; i < metadata.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (metadata[j].first == metadata[i].first) {
          return absl::InvalidArgumentError(
              absl::StrCat("metadata key '", metadata[i].first, "' is given twice"));
        }
      }
      absl::StrAppend(&json, i == 0 ? "" : ",", JsonQuote(metadata[i].first), ":",
                      JsonQuote(metadata[i].second));
      header.metadata.push_back(metadata[i]);
    }
    json += "}";
  }
  uint64_t offset = 0;
  for (const SafetensorsTensorInfo& info : tensors) {
    if (info.name.empty()) return absl::InvalidArgumentError("a tensor has an empty name");
    if (info.name == kSafetensorsMetadataKey) {
      return TensorError(info.name, "the name is the header's metadata key");
    }
    std::optional<uint64_t> bytes = SafetensorsDTypeSize(info.dtype);
    for (const int64_t d : info.shape) {
      if (d < 0) return TensorError(info.name, absl::StrCat("shape ", ShapeText(info.shape)));
      if (bytes.has_value()) bytes = MulChecked(*bytes, static_cast<uint64_t>(d));
    }
    if (!bytes.has_value() || *bytes > UINT64_MAX - offset || offset + *bytes > INT64_MAX) {
      return TensorError(info.name, "the data's size overflows");
    }
    SafetensorsTensor t{.name = info.name,
                        .dtype = info.dtype,
                        .shape = info.shape,
                        .begin = offset,
                        .end = offset + *bytes};
    absl::StrAppend(&json, json.size() > 1 ? "," : "", JsonQuote(t.name), ":{\"dtype\":\"",
                    SafetensorsDTypeName(t.dtype), "\",\"shape\":", ShapeText(t.shape),
                    ",\"data_offsets\":[", t.begin, ",", t.end, "]}");
    offset = t.end;
    header.tensors.push_back(std::move(t));
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  header.header_bytes = json.size();
  header.data_bytes = offset;
  // Names unique (a duplicate would be a JSON object with a duplicate key).
  IndexByName(&header);
  for (size_t i = 1; i < header.by_name.size(); ++i) {
    const std::string& name = header.tensors[header.by_name[i]].name;
    if (name == header.tensors[header.by_name[i - 1]].name) {
      return TensorError(name, "the name is given twice");
    }
  }
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xFF);
  out += json;
  // Sorted by offset as a parsed header is (stable: equal offsets are empty tensors, by name).
  std::stable_sort(header.tensors.begin(), header.tensors.end(),
                   [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
                     if (a.begin != b.begin) return a.begin < b.begin;
                     if (a.end != b.end) return a.end < b.end;
                     return a.name < b.name;
                   });
  IndexByName(&header);
  return std::make_pair(std::move(out), std::move(header));
}

// ---- SafetensorsFile -----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const std::string what = absl::StrCat("safetensors file '", path, "'");
  // O_NONBLOCK: a FIFO in the file's place would otherwise block the open until a writer came.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    return absl::Status(absl::ErrnoToStatusCode(e), absl::StrCat(what, ": ", std::strerror(e)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::Status(absl::ErrnoToStatusCode(e),
                        absl::StrCat(what, ": fstat: ", std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(what, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const char* base = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return absl::Status(absl::ErrnoToStatusCode(e),
                          absl::StrCat(what, ": mmap: ", std::strerror(e)));
    }
    base = static_cast<const char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
  auto unmap = [&] {
    if (base != nullptr) ::munmap(const_cast<char*>(base), size);
  };
  if (size < 8) {
    unmap();
    return absl::DataLossError(absl::StrCat(
        what, ": ", size, " bytes, shorter than the 8-byte header length (truncated)"));
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(base[i])) << (8 * i);
  if (n > kMaxSafetensorsHeaderBytes) {
    unmap();
    return absl::InvalidArgumentError(absl::StrCat(what, ": the header length is ", n,
                                                   " bytes, above the limit of ",
                                                   kMaxSafetensorsHeaderBytes));
  }
  if (n > size - 8) {
    unmap();
    return absl::DataLossError(absl::StrCat(what, ": the header length is ", n,
                                            " bytes, but the file has only ", size - 8,
                                            " after it (truncated)"));
  }
  absl::StatusOr<SafetensorsHeader> header =
      ParseSafetensorsHeader(absl::string_view(base + 8, n), size - 8 - n);
  if (!header.ok()) {
    unmap();
    return Annotate(header.status(), what);
  }
  return std::unique_ptr<SafetensorsFile>(
      new SafetensorsFile(path, base, size, *std::move(header)));
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<char*>(base_), size_);
}

absl::string_view SafetensorsFile::Data(const SafetensorsTensor& tensor) const {
  if (tensor.bytes() == 0) return absl::string_view();
  return absl::string_view(base_ + header_.data_offset() + tensor.begin, tensor.bytes());
}

// ---- SafetensorsWriter ---------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    FileSystem& fs, const std::string& path, const std::vector<SafetensorsTensorInfo>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  const std::string what = absl::StrCat("safetensors file '", path, "'");
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a file name"));
  }
  absl::StatusOr<std::pair<std::string, SafetensorsHeader>> header =
      MakeSafetensorsHeader(tensors, metadata);
  if (!header.ok()) return Annotate(header.status(), what);
  SL_ASSIGN_OR_RETURN(bool exists, fs.Exists(path));
  if (exists) {
    return absl::AlreadyExistsError(
        absl::StrCat(what, ": exists (an export never replaces a file; choose a new name)"));
  }
  const std::string temp = absl::StrCat(path, ".tmp-", MakeNonce());
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs.CreateFile(temp));
  SL_RETURN_IF_ERROR(file->Append(header->first.data(), header->first.size()));
  return std::unique_ptr<SafetensorsWriter>(
      new SafetensorsWriter(fs, path, temp, std::move(file), std::move(header->second)));
}

absl::Status SafetensorsWriter::Append(const void* data, size_t size) {
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors file '", path_, "': Append after Finish"));
  }
  if (size > header_.data_bytes - written_) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors file '", path_,
                                                   "': ", written_ + size,
                                                   " data bytes appended, the "
                                                   "header describes ",
                                                   header_.data_bytes));
  }
  if (size == 0) return absl::OkStatus();
  SL_RETURN_IF_ERROR(file_->Append(data, size));
  written_ += size;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors file '", path_, "': Finish called twice"));
  }
  if (written_ != header_.data_bytes) {
    std::string tensor;
    for (const SafetensorsTensor& t : header_.tensors) {
      if (t.end > written_) {
        tensor = absl::StrCat(" (tensor '", t.name, "' is incomplete)");
        break;
      }
    }
    return absl::FailedPreconditionError(absl::StrCat("safetensors file '", path_, "': ", written_,
                                                      " of ", header_.data_bytes,
                                                      " data bytes were appended", tensor));
  }
  finished_ = true;
  SL_RETURN_IF_ERROR(file_->Sync());
  SL_RETURN_IF_ERROR(file_->Close());
  SL_RETURN_IF_ERROR(fs_.Rename(temp_path_, path_));
  return fs_.SyncDir(ParentDir(path_));
}

}  // namespace shardline
