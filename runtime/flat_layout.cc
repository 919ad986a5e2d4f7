#include "runtime/flat_layout.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/check.h"
#include "runtime/internal/flat_layout_internal.h"

namespace shardline {

std::string flat_layout_internal::QuoteName(absl::string_view name) {
  return absl::StrCat("'", absl::CHexEscape(name), "'");
}

namespace {

bool ValidDType(DType dtype) { return static_cast<size_t>(dtype) < kAllDTypes.size(); }

using flat_layout_internal::QuoteName;

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string SpecLabel(size_t index, absl::string_view name) {
  return absl::StrCat("spec ", index, " (", QuoteName(name), ")");
}

bool MulOverflows(size_t a, size_t b, size_t* out) { return __builtin_mul_overflow(a, b, out); }
bool AddOverflows(size_t a, size_t b, size_t* out) { return __builtin_add_overflow(a, b, out); }

// Rounds x up to a multiple of q (q >= 1); false on overflow.
bool RoundUp(size_t x, size_t q, size_t* out) {
  const size_t rem = x % q;
  if (rem == 0) {
    *out = x;
    return true;
  }
  return !AddOverflows(x, q - rem, out);
}

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const ShardSlice& slice) {
  return os << "{tensor " << slice.tensor << ", shard " << slice.shard << ", tensor ["
            << slice.tensor_offset << ", " << slice.tensor_offset + slice.length << ") at shard ["
            << slice.shard_offset << ", " << slice.shard_offset + slice.length << ")}";
}

FlatLayout::FlatLayout()
    : fingerprint_(0),
      shard_first_slice_(2, 0),
      tensor_first_slice_(1, 0),
      shard_first_padding_(2, 0) {
  fingerprint_ = Fnv1a64(Serialize());
}

absl::StatusOr<FlatLayout> FlatLayout::Create(absl::Span<const TensorSpec> specs,
                                              const FlatLayoutOptions& options) {
  // --- Options.
  if (options.num_shards < 1 || options.num_shards > kMaxFlatLayoutShards) {
    return absl::InvalidArgumentError(absl::StrCat("FlatLayout: num_shards ", options.num_shards,
                                                   " is outside [1, ", kMaxFlatLayoutShards, "]"));
  }
  if (!ValidDType(options.element_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FlatLayout: element_dtype ", static_cast<int>(options.element_dtype), " is not a dtype"));
  }
  const size_t esize = DTypeSize(options.element_dtype);
  const size_t align = options.alignment_bytes;
  if (align == 0 || (align & (align - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlatLayout: alignment_bytes ", align, " is not a power of two"));
  }
  if (align % esize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlatLayout: alignment_bytes ", align, " is not a whole number of ",
                     DTypeName(options.element_dtype), " elements (", esize, " bytes each)"));
  }
  if (options.block_elements < 1) {
    return absl::InvalidArgumentError("FlatLayout: block_elements 0 must be >= 1");
  }
  if (specs.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlatLayout: ", specs.size(), " specs exceed the limit of ", INT32_MAX));
  }

  FlatLayout layout;
  layout.options_ = options;
  layout.alignment_elements_ = align / esize;
  const size_t a = layout.alignment_elements_;
  const size_t S = static_cast<size_t>(options.num_shards);

  // --- Tensors: validate, resolve ties, place.
  layout.tensors_.clear();
  layout.tensors_.reserve(specs.size());
  layout.index_by_name_.clear();
  layout.index_by_name_.reserve(specs.size());
  size_t cursor = 0;
  size_t tensor_elements = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    if (spec.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout: spec ", i, " has an empty name"));
    }
    if (layout.index_by_name_.contains(spec.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name), " repeats the name of spec ",
                       layout.index_by_name_.at(spec.name),
                       " (names are unique; to share storage give a new name and tied_to = ",
                       QuoteName(spec.name), ")"));
    }
    if (spec.name.size() > kMaxFlatTensorNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout: spec ", i, " name has ",
                                                     spec.name.size(), " bytes, more than ",
                                                     kMaxFlatTensorNameBytes));
    }
    if (spec.shape.size() > kMaxFlatTensorRank) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name),
                                                     " has rank ", spec.shape.size(),
                                                     ", more than ", kMaxFlatTensorRank));
    }
    if (!ValidDType(spec.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name),
                                                     " has invalid dtype ",
                                                     static_cast<int>(spec.dtype)));
    }
    size_t numel = 1;
    for (size_t axis = 0; axis < spec.shape.size(); ++axis) {
      const int64_t dim = spec.shape[axis];
      if (dim < 0) {
        return absl::InvalidArgumentError(absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name),
                                                       " has negative dim ", dim, " at axis ", axis,
                                                       " of shape ", ShapeString(spec.shape)));
      }
      if (MulOverflows(numel, static_cast<size_t>(dim), &numel)) {
        return absl::InvalidArgumentError(absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name),
                                                       " shape ", ShapeString(spec.shape),
                                                       " has more elements than size_t holds"));
      }
    }
    // A zero dim after an overflowing prefix would hide the overflow; the loop above already
    // returned in that case, since it checks each partial product.

    FlatTensor t;
    t.spec = spec;
    t.numel = numel;
    const int index = static_cast<int>(i);
    if (!spec.tied_to.empty()) {
      auto it = layout.index_by_name_.find(spec.tied_to);
      if (it == layout.index_by_name_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("FlatLayout: ", SpecLabel(i, spec.name),
                                                       " is tied_to ", QuoteName(spec.tied_to),
                                                       ", which names no earlier spec"));
      }
      const FlatTensor& target = layout.tensors_[it->second];
      if (target.spec.shape != spec.shape || target.spec.dtype != spec.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FlatLayout: ", SpecLabel(i, spec.name), " ", ShapeString(spec.shape), " ",
            DTypeName(spec.dtype), " is tied_to ", SpecLabel(it->second, target.spec.name), " ",
            ShapeString(target.spec.shape), " ", DTypeName(target.spec.dtype),
            ": a tie needs the same shape and dtype"));
      }
      t.tied_to = it->second;
      t.storage = target.storage;
      t.offset = target.offset;
    } else {
      t.storage = index;
      size_t offset;
      size_t end;
      if (!RoundUp(cursor, a, &offset) || AddOverflows(offset, numel, &end)) {
        return absl::InvalidArgumentError(absl::StrCat("FlatLayout: placing ",
                                                       SpecLabel(i, spec.name), " with ", numel,
                                                       " elements overflows size_t"));
      }
      t.offset = offset;
      cursor = end;
      tensor_elements += numel;  // <= cursor, cannot overflow
    }
    layout.index_by_name_.emplace(spec.name, index);
    layout.tensors_.push_back(std::move(t));
  }
  layout.data_end_ = cursor;
  layout.tensor_elements_ = tensor_elements;

  // --- Shards: each a whole number of alignment units and of blocks.
  const size_t g = std::gcd(a, options.block_elements);
  size_t quantum;
  size_t shard = 0;
  size_t total = 0;
  size_t total_bytes = 0;
  if (MulOverflows(a / g, options.block_elements, &quantum) ||
      !RoundUp(cursor / S + (cursor % S != 0 ? 1 : 0), quantum, &shard) ||
      MulOverflows(shard, S, &total) || MulOverflows(total, esize, &total_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FlatLayout: padding ", cursor, " elements to ", S, " shards of whole blocks of ",
        options.block_elements, " and alignment units of ", a, " elements overflows size_t"));
  }
  layout.shard_elements_ = shard;

  // --- Slices, in unsharded-offset order; storage tensors are placed in index order, so this
  // order is by shard and by tensor at once.
  layout.slices_.clear();
  layout.tensor_first_slice_.assign(specs.size() + 1, 0);
  for (size_t i = 0; i < layout.tensors_.size(); ++i) {
    layout.tensor_first_slice_[i] = layout.slices_.size();
    const FlatTensor& t = layout.tensors_[i];
    if (t.is_tie() || t.numel == 0) continue;
    size_t pos = t.offset;
    const size_t end = t.end();
    while (pos < end) {
      const size_t s = pos / shard;
      const size_t shard_end = (s + 1) * shard;
      const size_t len = std::min(end, shard_end) - pos;
      layout.slices_.push_back(ShardSlice{static_cast<int32_t>(i), static_cast<int32_t>(s),
                                          pos - t.offset, pos - s * shard, len});
      pos += len;
    }
  }
  layout.tensor_first_slice_[specs.size()] = layout.slices_.size();
  layout.shard_first_slice_.assign(S + 1, layout.slices_.size());
  {
    size_t k = 0;
    for (size_t s = 0; s <= S; ++s) {
      while (k < layout.slices_.size() && static_cast<size_t>(layout.slices_[k].shard) < s) ++k;
      layout.shard_first_slice_[s] = k;
    }
  }

  // --- Padding: the complement of the slices in [0, total), split at shard boundaries.
  layout.padding_.clear();
  auto add_padding = [&](size_t begin, size_t end) {
    while (begin < end) {
      const size_t shard_end = (begin / shard + 1) * shard;
      const size_t stop = std::min(end, shard_end);
      layout.padding_.push_back(PaddingRange{begin, stop});
      begin = stop;
    }
  };
  size_t covered = 0;
  for (const ShardSlice& sl : layout.slices_) {
    const size_t begin = static_cast<size_t>(sl.shard) * shard + sl.shard_offset;
    add_padding(covered, begin);
    covered = begin + sl.length;
  }
  add_padding(covered, total);
  layout.shard_first_padding_.assign(S + 1, layout.padding_.size());
  {
    size_t k = 0;
    for (size_t s = 0; s <= S; ++s) {
      while (k < layout.padding_.size() && layout.padding_[k].begin < s * shard) ++k;
      layout.shard_first_padding_[s] = k;
    }
  }

  layout.fingerprint_ = Fnv1a64(layout.Serialize());
  return layout;
}

std::vector<TensorSpec> FlatLayout::specs() const {
  std::vector<TensorSpec> out;
  out.reserve(tensors_.size());
  for (const FlatTensor& t : tensors_) out.push_back(t.spec);
  return out;
}

std::optional<int> FlatLayout::FindTensor(absl::string_view name) const {
  auto it = index_by_name_.find(name);
  if (it == index_by_name_.end()) return std::nullopt;
  return it->second;
}

int FlatLayout::TensorAtOffset(size_t offset) const {
  if (offset >= total_elements()) return -1;
  const int s = static_cast<int>(offset / shard_elements_);
  const size_t local = offset - ShardBegin(s);
  absl::Span<const ShardSlice> in_shard = ShardSlices(s);
  auto it =
      std::upper_bound(in_shard.begin(), in_shard.end(), local,
                       [](size_t value, const ShardSlice& sl) { return value < sl.shard_offset; });
  if (it == in_shard.begin()) return -1;
  --it;
  return local < it->shard_offset + it->length ? it->tensor : -1;
}

absl::Span<const ShardSlice> FlatLayout::ShardSlices(int shard) const {
  SL_CHECK(shard >= 0 && shard < num_shards()) << "shard " << shard << " of " << num_shards();
  const size_t first = shard_first_slice_[shard];
  return absl::MakeConstSpan(slices_.data() + first, shard_first_slice_[shard + 1] - first);
}

absl::Span<const ShardSlice> FlatLayout::TensorSlices(int tensor) const {
  SL_CHECK(tensor >= 0 && tensor < num_tensors()) << "tensor " << tensor << " of " << num_tensors();
  const int t = tensors_[tensor].storage;
  const size_t first = tensor_first_slice_[t];
  return absl::MakeConstSpan(slices_.data() + first, tensor_first_slice_[t + 1] - first);
}

std::optional<ShardSlice> FlatLayout::Intersection(int tensor, int shard) const {
  absl::Span<const ShardSlice> slices = TensorSlices(tensor);
  // A tensor's slices are in shard order, at most one per shard.
  auto it = std::lower_bound(slices.begin(), slices.end(), shard,
                             [](const ShardSlice& sl, int s) { return sl.shard < s; });
  if (it == slices.end() || it->shard != shard) return std::nullopt;
  return *it;
}

absl::Span<const PaddingRange> FlatLayout::ShardPadding(int shard) const {
  SL_CHECK(shard >= 0 && shard < num_shards()) << "shard " << shard << " of " << num_shards();
  const size_t first = shard_first_padding_[shard];
  return absl::MakeConstSpan(padding_.data() + first, shard_first_padding_[shard + 1] - first);
}

void FlatLayout::ZeroShardPadding(int shard, void* shard_data) const {
  const size_t base = ShardBegin(shard);
  const size_t esize = element_size();
  char* bytes = static_cast<char*>(shard_data);
  for (const PaddingRange& p : ShardPadding(shard)) {
    std::memset(bytes + (p.begin - base) * esize, 0, (p.end - p.begin) * esize);
  }
}

bool operator==(const FlatLayout& a, const FlatLayout& b) {
  if (a.options_ != b.options_ || a.tensors_.size() != b.tensors_.size()) return false;
  for (size_t i = 0; i < a.tensors_.size(); ++i) {
    if (a.tensors_[i].spec != b.tensors_[i].spec) return false;
  }
  return true;  // The rest is derived from specs and options.
}

absl::Status CompareLayouts(const FlatLayout& a, const FlatLayout& b, absl::string_view a_label,
                            absl::string_view b_label) {
  auto differ = [&](absl::string_view what, const auto& va, const auto& vb) {
    return absl::InvalidArgumentError(absl::StrCat("flat layouts differ in ", what, ": ", a_label,
                                                   " has ", va, ", ", b_label, " has ", vb));
  };
  const FlatLayoutOptions& oa = a.options();
  const FlatLayoutOptions& ob = b.options();
  if (oa.num_shards != ob.num_shards) return differ("num_shards", oa.num_shards, ob.num_shards);
  if (oa.element_dtype != ob.element_dtype) {
    return differ("element_dtype", DTypeName(oa.element_dtype), DTypeName(ob.element_dtype));
  }
  if (oa.alignment_bytes != ob.alignment_bytes) {
    return differ("alignment_bytes", oa.alignment_bytes, ob.alignment_bytes);
  }
  if (oa.block_elements != ob.block_elements) {
    return differ("block_elements", oa.block_elements, ob.block_elements);
  }
  const int n = std::min(a.num_tensors(), b.num_tensors());
  for (int i = 0; i < n; ++i) {
    const TensorSpec& sa = a.tensor(i).spec;
    const TensorSpec& sb = b.tensor(i).spec;
    const std::string where =
        absl::StrCat("tensor ", i, " (", QuoteName(sa.name), " vs ", QuoteName(sb.name), ") ");
    if (sa.name != sb.name)
      return differ(absl::StrCat(where, "name"), QuoteName(sa.name), QuoteName(sb.name));
    if (sa.shape != sb.shape) {
      return differ(absl::StrCat(where, "shape"), ShapeString(sa.shape), ShapeString(sb.shape));
    }
    if (sa.dtype != sb.dtype) {
      return differ(absl::StrCat(where, "dtype"), DTypeName(sa.dtype), DTypeName(sb.dtype));
    }
    if (sa.tied_to != sb.tied_to) {
      return differ(absl::StrCat(where, "tied_to"), QuoteName(sa.tied_to), QuoteName(sb.tied_to));
    }
  }
  if (a.num_tensors() != b.num_tensors()) {
    const FlatLayout& longer = a.num_tensors() > b.num_tensors() ? a : b;
    return absl::InvalidArgumentError(
        absl::StrCat("flat layouts differ in the tensor count: ", a_label, " has ", a.num_tensors(),
                     ", ", b_label, " has ", b.num_tensors(), "; first extra tensor is ", n, " (",
                     QuoteName(longer.tensor(n).spec.name), ")"));
  }
  return absl::OkStatus();
}

std::string FlatLayout::ToString() const {
  std::string out;
  int ties = 0;
  for (const FlatTensor& t : tensors_) ties += t.is_tie() ? 1 : 0;
  absl::StrAppendFormat(
      &out,
      "FlatLayout: %d tensors (%d tied), elements %s (%d B), alignment %d B = %d elements, "
      "block %d elements\n",
      tensors_.size(), ties, DTypeName(options_.element_dtype), element_size(),
      options_.alignment_bytes, alignment_elements_, options_.block_elements);
  absl::StrAppendFormat(&out,
                        "  %d shards x %d elements = %d elements (%d B); tensor data %d, "
                        "padding %d; fingerprint %016x\n",
                        num_shards(), shard_elements_, total_elements(), total_bytes(),
                        tensor_elements_, total_elements() - tensor_elements_, fingerprint_);

  // Tensor table, columns sized to their content.
  std::vector<std::string> names, shapes, where;
  size_t wn = 4, ws = 5;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const FlatTensor& t = tensors_[i];
    names.push_back(t.spec.name);
    shapes.push_back(ShapeString(t.spec.shape));
    if (t.is_tie()) {
      where.push_back(absl::StrCat("tied to ", tensors_[t.tied_to].spec.name));
    } else {
      std::vector<int> shards;
      for (const ShardSlice& sl : TensorSlices(static_cast<int>(i))) shards.push_back(sl.shard);
      where.push_back(shards.empty() ? "-" : absl::StrJoin(shards, ","));
    }
    wn = std::max(wn, names.back().size());
    ws = std::max(ws, shapes.back().size());
  }
  absl::StrAppendFormat(&out, "  %5s  %-*s  %-*s  %-5s  %10s  %10s  %s\n", "index", wn, "name", ws,
                        "shape", "dtype", "offset", "numel", "shards");
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const FlatTensor& t = tensors_[i];
    absl::StrAppendFormat(&out, "  %5d  %-*s  %-*s  %-5s  %10d  %10d  %s\n", i, wn, names[i], ws,
                          shapes[i], DTypeName(t.spec.dtype), t.offset, t.numel, where[i]);
  }
  absl::StrAppendFormat(&out, "  %5s  %-23s  %s\n", "shard", "elements", "contents");
  for (int s = 0; s < num_shards(); ++s) {
    std::vector<std::string> parts;
    for (const ShardSlice& sl : ShardSlices(s)) {
      parts.push_back(absl::StrFormat("%s[%d:%d)@%d", tensors_[sl.tensor].spec.name,
                                      sl.tensor_offset, sl.tensor_offset + sl.length,
                                      sl.shard_offset));
    }
    size_t pad = 0;
    for (const PaddingRange& p : ShardPadding(s)) pad += p.end - p.begin;
    if (pad > 0) parts.push_back(absl::StrCat("+", pad, " padding"));
    absl::StrAppendFormat(&out, "  %5d  %-23s  %s\n", s,
                          absl::StrFormat("[%d, %d)", ShardBegin(s), ShardEnd(s)),
                          parts.empty() ? "(empty)" : absl::StrJoin(parts, " "));
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const FlatLayout& layout) {
  return os << layout.ToString();
}

}  // namespace shardline
