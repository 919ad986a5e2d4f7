// FlatLayout::Serialize and FlatLayout::Deserialize (runtime/flat_layout.h).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "runtime/flat_layout.h"
#include "runtime/internal/flat_layout_internal.h"

// Serialised form, version 1, all integers little-endian:
//   "SLFL" | u16 version | u8 element dtype | u8 reserved (0) | u32 num_shards
//   | u64 alignment_bytes | u64 block_elements | u64 shard_elements | u32 num_tensors
//   then per tensor: u32 name length | name bytes | u8 dtype | u8 rank | rank x i64 dims
//                    | u32 tied_to (index of an earlier tensor, 0xFFFFFFFF for none)
//                    | u64 offset
// shard_elements and the offsets are derived; Deserialize recomputes them and rejects a
// mismatch, so a layout written by a different placement rule is never silently misread.

namespace shardline {
namespace {

constexpr char kMagic[4] = {'S', 'L', 'F', 'L'};
constexpr uint16_t kVersion = 1;
constexpr uint32_t kNoTie = 0xFFFFFFFFu;
constexpr size_t kHeaderBytes = 4 + 2 + 1 + 1 + 4 + 8 + 8 + 8 + 4;
// name length, one name byte, dtype, rank, tied_to, offset.
constexpr size_t kMinTensorBytes = 4 + 1 + 1 + 1 + 4 + 8;

using flat_layout_internal::QuoteName;

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Bytes(absl::string_view b) { out_->append(b.data(), b.size()); }

 private:
  void Le(uint64_t v, int n) {
    char buf[8];
    for (int i = 0; i < n; ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    out_->append(buf, n);
  }
  std::string* out_;
};

// Reads little-endian fields; every read fails (returns false) instead of running past the end.
class ByteReader {
 public:
  explicit ByteReader(absl::string_view in) : in_(in) {}
  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  bool U8(uint8_t* v) {
    uint64_t x;
    if (!Le(1, &x)) return false;
    *v = static_cast<uint8_t>(x);
    return true;
  }
  bool U16(uint16_t* v) {
    uint64_t x;
    if (!Le(2, &x)) return false;
    *v = static_cast<uint16_t>(x);
    return true;
  }
  bool U32(uint32_t* v) {
    uint64_t x;
    if (!Le(4, &x)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool U64(uint64_t* v) { return Le(8, v); }
  bool Bytes(size_t n, absl::string_view* out) {
    if (remaining() < n) return false;
    *out = in_.substr(pos_, n);
    pos_ += n;
    return true;
  }

 private:
  bool Le(int n, uint64_t* v) {
    if (remaining() < static_cast<size_t>(n)) return false;
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) {
      x |= static_cast<uint64_t>(static_cast<unsigned char>(in_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    *v = x;
    return true;
  }
  absl::string_view in_;
  size_t pos_ = 0;
};

absl::Status Truncated(const ByteReader& reader, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("FlatLayout::Deserialize: input truncated at byte ", reader.position(),
                   " while reading ", what));
}

}  // namespace

std::string FlatLayout::Serialize() const {
  std::string out;
  size_t size = kHeaderBytes;
  for (const FlatTensor& t : tensors_) {
    size += kMinTensorBytes - 1 + t.spec.name.size() + 8 * t.spec.shape.size();
  }
  out.reserve(size);
  ByteWriter w(&out);
  w.Bytes(absl::string_view(kMagic, 4));
  w.U16(kVersion);
  w.U8(static_cast<uint8_t>(options_.element_dtype));
  w.U8(0);
  w.U32(static_cast<uint32_t>(options_.num_shards));
  w.U64(options_.alignment_bytes);
  w.U64(options_.block_elements);
  w.U64(shard_elements_);
  w.U32(static_cast<uint32_t>(tensors_.size()));
  for (const FlatTensor& t : tensors_) {
    w.U32(static_cast<uint32_t>(t.spec.name.size()));
    w.Bytes(t.spec.name);
    w.U8(static_cast<uint8_t>(t.spec.dtype));
    w.U8(static_cast<uint8_t>(t.spec.shape.size()));
    for (int64_t d : t.spec.shape) w.U64(static_cast<uint64_t>(d));
    w.U32(t.is_tie() ? static_cast<uint32_t>(t.tied_to) : kNoTie);
    w.U64(t.offset);
  }
  return out;
}

absl::StatusOr<FlatLayout> FlatLayout::Deserialize(absl::string_view bytes) {
  ByteReader r(bytes);
  absl::string_view magic;
  if (!r.Bytes(4, &magic)) return Truncated(r, "the magic");
  if (magic != absl::string_view(kMagic, 4)) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: bad magic '",
                                                   absl::CHexEscape(magic), "' (expected 'SLFL')"));
  }
  uint16_t version;
  if (!r.U16(&version)) return Truncated(r, "the version");
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: unsupported version ",
                                                   version, " (this build reads ", kVersion, ")"));
  }
  uint8_t element_dtype, reserved;
  uint32_t num_shards, num_tensors;
  uint64_t alignment, block, shard_elements;
  if (!r.U8(&element_dtype) || !r.U8(&reserved) || !r.U32(&num_shards) || !r.U64(&alignment) ||
      !r.U64(&block) || !r.U64(&shard_elements) || !r.U32(&num_tensors)) {
    return Truncated(r, "the header");
  }
  if (element_dtype >= kAllDTypes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: element dtype code ",
                                                   element_dtype, " is not a dtype"));
  }
  if (reserved != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlatLayout::Deserialize: reserved header byte is ", reserved, ", not 0"));
  }
  if (num_shards > static_cast<uint32_t>(kMaxFlatLayoutShards)) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: num_shards ",
                                                   num_shards, " exceeds ", kMaxFlatLayoutShards));
  }
  // Bound the allocation by what the input can hold before trusting the count.
  if (num_tensors > r.remaining() / kMinTensorBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FlatLayout::Deserialize: ", num_tensors, " tensors cannot fit in the remaining ",
        r.remaining(), " bytes (truncated or garbage input)"));
  }
  FlatLayoutOptions options;
  options.num_shards = static_cast<int>(num_shards);
  options.element_dtype = static_cast<DType>(element_dtype);
  options.alignment_bytes = alignment;
  options.block_elements = block;

  std::vector<TensorSpec> specs(num_tensors);
  std::vector<uint64_t> offsets(num_tensors);
  for (uint32_t i = 0; i < num_tensors; ++i) {
    TensorSpec& spec = specs[i];
    uint32_t name_len;
    absl::string_view name;
    if (!r.U32(&name_len)) return Truncated(r, absl::StrCat("the name length of tensor ", i));
    if (name_len > kMaxFlatTensorNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: tensor ", i,
                                                     " name length ", name_len, " exceeds ",
                                                     kMaxFlatTensorNameBytes));
    }
    if (!r.Bytes(name_len, &name)) return Truncated(r, absl::StrCat("the name of tensor ", i));
    spec.name = std::string(name);
    uint8_t dtype, rank;
    if (!r.U8(&dtype) || !r.U8(&rank)) return Truncated(r, absl::StrCat("tensor ", i));
    if (dtype >= kAllDTypes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: tensor ", i, " (",
                                                     QuoteName(name), ") dtype code ", dtype,
                                                     " is not a dtype"));
    }
    if (rank > kMaxFlatTensorRank) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: tensor ", i, " (",
                                                     QuoteName(name), ") rank ", rank, " exceeds ",
                                                     kMaxFlatTensorRank));
    }
    spec.dtype = static_cast<DType>(dtype);
    spec.shape.resize(rank);
    for (uint8_t d = 0; d < rank; ++d) {
      uint64_t dim;
      if (!r.U64(&dim)) return Truncated(r, absl::StrCat("the shape of tensor ", i));
      spec.shape[d] = static_cast<int64_t>(dim);
    }
    uint32_t tie;
    if (!r.U32(&tie) || !r.U64(&offsets[i])) return Truncated(r, absl::StrCat("tensor ", i));
    if (tie != kNoTie) {
      if (tie >= i) {
        return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: tensor ", i, " (",
                                                       QuoteName(name), ") is tied to tensor ", tie,
                                                       ", which is not an earlier tensor"));
      }
      spec.tied_to = specs[tie].name;
    }
  }
  if (r.remaining() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout::Deserialize: ", r.remaining(),
                                                   " trailing bytes after the last tensor"));
  }
  absl::StatusOr<FlatLayout> layout = Create(specs, options);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlatLayout::Deserialize: ", layout.status().message()));
  }
  if (layout->shard_elements() != shard_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FlatLayout::Deserialize: stored shard_elements ", shard_elements, " differs from the ",
        layout->shard_elements(), " this build computes (written by another placement rule?)"));
  }
  for (uint32_t i = 0; i < num_tensors; ++i) {
    if (layout->tensor(i).offset != offsets[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FlatLayout::Deserialize: tensor ", i, " (", QuoteName(specs[i].name), ") stored offset ",
          offsets[i], " differs from the ", layout->tensor(i).offset,
          " this build computes (written by another placement rule?)"));
    }
  }
  return layout;
}

}  // namespace shardline
