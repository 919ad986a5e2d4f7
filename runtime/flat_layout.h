// File: runtime/flat_layout.h
// -----------------------------------------------------------------------------
// FlatLayout: where each parameter of a unit lives in the unit's one flat buffer, and which
// slice of that buffer each shard (rank) owns. It is the data structure under FSDP1's
// FlatParameter and ZeRO-3's partitions, and it is pure arithmetic: no memory, no communication.
//
// Units. A flat buffer holds elements of ONE dtype, the layout's `element_dtype` (the master
// dtype for the sharded copy, the param dtype for the unsharded copy). Each tensor occupies
// numel consecutive elements of that dtype, whatever its own `TensorSpec::dtype` (its original
// dtype, kept for checkpoints and views: a bf16 parameter in an f32 buffer is numel f32
// elements). Every offset and length in this file counts ELEMENTS of `element_dtype`, never bytes.
//
// The layout, for options {num_shards = S, alignment_bytes = A, block_elements = B}:
//   * a = A / DTypeSize(element_dtype) elements (A must be a power of two and a multiple of the
//     element size, so a is a whole power of two);
//   * tensors are placed in spec order, each at the next offset that is a multiple of a; a
//     tied tensor (TensorSpec::tied_to) takes no space of its own and shares its target's
//     elements;
//   * shard_elements() is the smallest multiple of lcm(a, B) with S * shard_elements() >= the
//     end of the last tensor; total_elements() = S * shard_elements(). So every shard begins on
//     an alignment boundary of the unsharded buffer, and every shard is a whole number of blocks;
//   * shard s owns the contiguous slice [s * shard_elements(), (s + 1) * shard_elements()).
// Elements that belong to no tensor (alignment gaps, tail) are padding. They carry no data and
// users zero-fill them (ZeroShardPadding); PaddingRanges() and TensorAtOffset() say where they are.
//
// Ties: the same storage under two names (tied embeddings) is explicit. The second spec gets
// its own name and `tied_to = "<first name>"`; the target must appear EARLIER in the list and
// have the same shape and dtype (a tie to a tie resolves to the first tensor). Registering one
// name twice is an error, never an implicit tie.
//
// Views. Every (tensor, shard) intersection is precomputed by Create as a ShardSlice. The
// slices of shard s (ShardSlices) and of tensor t (TensorSlices) are spans into one array, so
// the per-step cost of a view is an index lookup. Slices exist only for tensors that own
// storage and have numel > 0; a tie's TensorSlices are its target's.
//
// Value type: copyable, comparable (==: same specs and options, hence same layout), printable
// (ToString / operator<<: a table), serialisable (Serialize / Deserialize: versioned
// little-endian binary), with a 64-bit Fingerprint() (FNV-1a of the serialised bytes) for
// the cross-rank "did we all build the same layout" check; CompareLayouts says what differs.
//
//   SL_ASSIGN_OR_RETURN(FlatLayout layout,
//                       FlatLayout::Create(specs, {.num_shards = world, .element_dtype = kF32}));
//   for (const ShardSlice& s : layout.ShardSlices(rank)) optimizer.Step(s.tensor, ...);

#ifndef SHARDLINE_RUNTIME_FLAT_LAYOUT_H_
#define SHARDLINE_RUNTIME_FLAT_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"

namespace shardline {

// One parameter as the framework registers it.
struct TensorSpec {
  std::string name;            // non-empty, unique within a layout
  std::vector<int64_t> shape;  // dims >= 0; {} is a scalar (numel 1); a zero dim gives numel 0
  DType dtype = DType::kF32;   // the tensor's own dtype (metadata; see "Units" above)
  std::string tied_to;         // empty, or the name of an earlier spec whose storage this shares

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// Largest accepted shard count (the layout keeps O(num_shards) index arrays).
inline constexpr int kMaxFlatLayoutShards = 1 << 20;
// Largest accepted tensor name (bytes) and rank; they bound the serialised form.
inline constexpr size_t kMaxFlatTensorNameBytes = 1 << 16;
inline constexpr size_t kMaxFlatTensorRank = 64;

struct FlatLayoutOptions {
  int num_shards = 1;                 // 1 ..= kMaxFlatLayoutShards
  DType element_dtype = DType::kF32;  // dtype of the flat buffer's elements
  size_t alignment_bytes = 16;        // per-tensor start alignment; power of two, multiple of
                                      // DTypeSize(element_dtype)
  size_t block_elements = 1;          // >= 1; each shard is a whole number of blocks

  friend bool operator==(const FlatLayoutOptions&, const FlatLayoutOptions&) = default;
};

// A tensor as placed in the layout. Index = position in the spec list.
struct FlatTensor {
  TensorSpec spec;
  int tied_to = -1;   // index of the spec named by spec.tied_to, or -1
  int storage = 0;    // index of the tensor whose elements this one uses: itself unless tied
                      // (always a tensor with storage == its own index)
  size_t numel = 0;   // product of the shape
  size_t offset = 0;  // first element in the unsharded flat buffer (the target's for a tie)

  size_t end() const { return offset + numel; }
  bool is_tie() const { return tied_to >= 0; }
};

// The intersection of one tensor with one shard: elements [tensor_offset, tensor_offset +
// length) of the tensor's flattened (row-major) index space live at [shard_offset, shard_offset
// + length) of the shard, i.e. at element ShardBegin(shard) + shard_offset of the unsharded
// buffer. length > 0 always.
struct ShardSlice {
  int32_t tensor = 0;  // index of a tensor that owns storage
  int32_t shard = 0;
  size_t tensor_offset = 0;
  size_t shard_offset = 0;
  size_t length = 0;

  friend bool operator==(const ShardSlice&, const ShardSlice&) = default;
};
std::ostream& operator<<(std::ostream& os, const ShardSlice& slice);

// A run of padding elements, [begin, end) in the unsharded buffer; never crosses a shard
// boundary (a gap that spans two shards is reported as two ranges).
struct PaddingRange {
  size_t begin = 0;
  size_t end = 0;

  friend bool operator==(const PaddingRange&, const PaddingRange&) = default;
};

class FlatLayout {
 public:
  // The layout of no tensors with default options (one shard of zero elements).
  FlatLayout();

  // Builds the layout. InvalidArgument, naming the spec (index and name) and the value, for:
  // empty name, duplicate name, name longer than kMaxFlatTensorNameBytes, rank above
  // kMaxFlatTensorRank, invalid dtype, negative dim, a shape whose product overflows size_t, a tie
  // to an unknown or later name or to a tensor of another shape or dtype, num_shards outside [1,
  // kMaxFlatLayoutShards], alignment_bytes not a power of two or not a multiple of the element
  // size, block_elements < 1, more than INT32_MAX specs, or a total size that overflows size_t.
  static absl::StatusOr<FlatLayout> Create(absl::Span<const TensorSpec> specs,
                                           const FlatLayoutOptions& options);

  // --- Geometry ---------------------------------------------------------------------------
  const FlatLayoutOptions& options() const { return options_; }
  int num_shards() const { return options_.num_shards; }
  DType element_dtype() const { return options_.element_dtype; }
  size_t element_size() const { return DTypeSize(options_.element_dtype); }
  size_t alignment_elements() const { return alignment_elements_; }
  size_t shard_elements() const { return shard_elements_; }
  size_t total_elements() const { return shard_elements_ * options_.num_shards; }
  size_t shard_bytes() const { return shard_elements_ * element_size(); }
  size_t total_bytes() const { return total_elements() * element_size(); }
  // End of the last tensor (total_elements() minus the tail padding).
  size_t data_end() const { return data_end_; }
  // Elements that belong to tensors with storage (ties counted once).
  size_t tensor_elements() const { return tensor_elements_; }
  size_t ShardBegin(int shard) const { return shard_elements_ * static_cast<size_t>(shard); }
  size_t ShardEnd(int shard) const { return ShardBegin(shard) + shard_elements_; }

  // --- Tensors ------------------------------------------------------------------------------
  int num_tensors() const { return static_cast<int>(tensors_.size()); }
  absl::Span<const FlatTensor> tensors() const { return tensors_; }
  const FlatTensor& tensor(int index) const { return tensors_[index]; }
  // The specs in registration order (what Create was given).
  std::vector<TensorSpec> specs() const;
  // Index of the tensor named `name`, or nullopt. A tie's name resolves to the tie's own
  // index; tensor(i).storage gives the tensor that owns the elements.
  std::optional<int> FindTensor(absl::string_view name) const;
  // The storage-owning tensor whose elements include unsharded element `offset`, or -1 if the
  // element is padding or offset >= total_elements(). O(log slices of the shard).
  int TensorAtOffset(size_t offset) const;

  // --- Views (precomputed; O(1)) --------------------------------------------------------------
  // Every slice, sorted by unsharded element offset (so by shard, and by tensor).
  absl::Span<const ShardSlice> slices() const { return slices_; }
  // The slices of shard s, by shard_offset. Requires 0 <= s < num_shards() (SL_CHECK).
  absl::Span<const ShardSlice> ShardSlices(int shard) const;
  // The slices of tensor t (its storage tensor's for a tie), by tensor_offset; they tile
  // [0, numel) exactly. Empty for numel 0. Requires 0 <= t < num_tensors() (SL_CHECK).
  absl::Span<const ShardSlice> TensorSlices(int tensor) const;
  // The intersection of tensor t with shard s, if not empty. O(log shards the tensor spans).
  std::optional<ShardSlice> Intersection(int tensor, int shard) const;
  // Padding runs, sorted; each lies in one shard.
  absl::Span<const PaddingRange> PaddingRanges() const { return padding_; }
  // The padding runs of shard s.
  absl::Span<const PaddingRange> ShardPadding(int shard) const;
  // Writes zero bytes over every padding element of shard s, given the shard's data (an array
  // of shard_elements() elements of element_dtype). Tensor elements are not touched.
  void ZeroShardPadding(int shard, void* shard_data) const;

  // --- Identity -----------------------------------------------------------------------------
  // Versioned little-endian binary form (see flat_layout_serialize.cc for the format). Deserialize
  // rejects truncated, trailing, garbage or inconsistent input with InvalidArgument; it never
  // crashes, and its allocations are bounded by the input size and kMaxFlatLayoutShards.
  std::string Serialize() const;
  static absl::StatusOr<FlatLayout> Deserialize(absl::string_view bytes);
  // FNV-1a 64 of Serialize(); computed once by Create.
  uint64_t Fingerprint() const { return fingerprint_; }

  // A table: options and geometry, one row per tensor, one row per shard.
  std::string ToString() const;

  friend bool operator==(const FlatLayout& a, const FlatLayout& b);

 private:
  FlatLayoutOptions options_;
  size_t alignment_elements_ = 1;
  size_t shard_elements_ = 0;
  size_t data_end_ = 0;
  size_t tensor_elements_ = 0;
  uint64_t fingerprint_ = 0;
  std::vector<FlatTensor> tensors_;
  absl::flat_hash_map<std::string, int> index_by_name_;
  std::vector<ShardSlice> slices_;
  // slices_[shard_first_slice_[s], shard_first_slice_[s + 1]) are shard s's; size S + 1.
  std::vector<size_t> shard_first_slice_;
  // slices_[tensor_first_slice_[t], tensor_first_slice_[t + 1]) are storage tensor t's (a
  // tie's range is empty; TensorSlices redirects to its storage); size T + 1.
  std::vector<size_t> tensor_first_slice_;
  std::vector<PaddingRange> padding_;
  std::vector<size_t> shard_first_padding_;  // size S + 1
};

inline bool operator!=(const FlatLayout& a, const FlatLayout& b) { return !(a == b); }
std::ostream& operator<<(std::ostream& os, const FlatLayout& layout);

// OK if `a` and `b` are the same layout; otherwise InvalidArgument naming the first
// difference: an option (num_shards, element_dtype, alignment_bytes, block_elements), or the
// first differing tensor (index, both names) and field (name, shape, dtype, tied_to), or the
// tensor count. `a_label`/`b_label` name the two sides in the message ("local", "rank 0").
absl::Status CompareLayouts(const FlatLayout& a, const FlatLayout& b,
                            absl::string_view a_label = "a", absl::string_view b_label = "b");

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_FLAT_LAYOUT_H_
