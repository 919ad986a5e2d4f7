#include "runtime/reshard_plan.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardline {
namespace {

std::string Describe(const TensorSpec& spec) {
  return absl::StrCat(
      "'", absl::CHexEscape(spec.name), "' [", absl::StrJoin(spec.shape, ", "), "] ",
      DTypeName(spec.dtype),
      spec.tied_to.empty() ? "" : absl::StrCat(" tied_to '", absl::CHexEscape(spec.tied_to), "'"));
}

absl::Status CheckSameTensors(const FlatLayout& from, const FlatLayout& to) {
  if (from.element_dtype() != to.element_dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PlanReshard: element dtypes differ (from ", DTypeName(from.element_dtype()), ", to ",
        DTypeName(to.element_dtype()), "); cast the shards, a reshard plan only copies"));
  }
  const int n = std::min(from.num_tensors(), to.num_tensors());
  for (int i = 0; i < n; ++i) {
    const TensorSpec& a = from.tensor(i).spec;
    const TensorSpec& b = to.tensor(i).spec;
    if (a.name != b.name || a.shape != b.shape || a.dtype != b.dtype || a.tied_to != b.tied_to) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PlanReshard: tensor ", i, " differs: from has ", Describe(a), ", to has ", Describe(b)));
    }
  }
  if (from.num_tensors() != to.num_tensors()) {
    const FlatLayout& longer = from.num_tensors() > to.num_tensors() ? from : to;
    return absl::InvalidArgumentError(absl::StrCat(
        "PlanReshard: from has ", from.num_tensors(), " tensors, to has ", to.num_tensors(),
        "; first unmatched tensor ", n, " is ", Describe(longer.tensor(n).spec)));
  }
  return absl::OkStatus();
}

void Append(std::vector<ReshardCopy>* copies, const ReshardCopy& c) {
  if (!copies->empty()) {
    ReshardCopy& last = copies->back();
    if (last.src_shard == c.src_shard && last.dst_shard == c.dst_shard &&
        last.src_offset + last.length == c.src_offset &&
        last.dst_offset + last.length == c.dst_offset) {
      last.length += c.length;
      return;
    }
  }
  copies->push_back(c);
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const ReshardCopy& copy) {
  return os << "{src " << copy.src_shard << "@" << copy.src_offset << " -> dst " << copy.dst_shard
            << "@" << copy.dst_offset << ", " << copy.length << " elements}";
}

size_t ReshardPlan::total_elements() const {
  size_t total = 0;
  for (const ReshardCopy& c : copies) total += c.length;
  return total;
}

absl::Span<const ReshardCopy> ReshardPlan::ForDestination(int dst) const {
  auto lo = std::lower_bound(copies.begin(), copies.end(), dst,
                             [](const ReshardCopy& c, int v) { return c.dst_shard < v; });
  auto hi = std::upper_bound(lo, copies.end(), dst,
                             [](int v, const ReshardCopy& c) { return v < c.dst_shard; });
  return absl::MakeConstSpan(copies.data() + (lo - copies.begin()), hi - lo);
}

absl::Span<const ReshardCopy> ReshardPlan::ForSource(int src) const {
  auto lo = std::lower_bound(copies.begin(), copies.end(), src,
                             [](const ReshardCopy& c, int v) { return c.src_shard < v; });
  auto hi = std::upper_bound(lo, copies.end(), src,
                             [](int v, const ReshardCopy& c) { return v < c.src_shard; });
  return absl::MakeConstSpan(copies.data() + (lo - copies.begin()), hi - lo);
}

absl::StatusOr<ReshardPlan> PlanReshard(const FlatLayout& from, const FlatLayout& to) {
  if (absl::Status s = CheckSameTensors(from, to); !s.ok()) return s;
  ReshardPlan plan;
  plan.element_dtype = from.element_dtype();
  plan.src_shards = from.num_shards();
  plan.src_shard_elements = from.shard_elements();
  plan.dst_shards = to.num_shards();
  plan.dst_shard_elements = to.shard_elements();
  // Per storage tensor, walk its slices in both layouts at once (both tile [0, numel) in
  // order); each overlap of a source slice with a destination slice is one copy.
  for (int t = 0; t < from.num_tensors(); ++t) {
    if (from.tensor(t).is_tie()) continue;
    absl::Span<const ShardSlice> a = from.TensorSlices(t);
    absl::Span<const ShardSlice> b = to.TensorSlices(t);
    size_t i = 0, j = 0;
    size_t pos = 0;  // in the tensor's index space
    while (i < a.size() && j < b.size()) {
      const ShardSlice& sa = a[i];
      const ShardSlice& sb = b[j];
      const size_t end_a = sa.tensor_offset + sa.length;
      const size_t end_b = sb.tensor_offset + sb.length;
      const size_t stop = std::min(end_a, end_b);
      Append(&plan.copies,
             ReshardCopy{sa.shard, sb.shard, sa.shard_offset + (pos - sa.tensor_offset),
                         sb.shard_offset + (pos - sb.tensor_offset), stop - pos});
      pos = stop;
      if (end_a == stop) ++i;
      if (end_b == stop) ++j;
    }
  }
  return plan;
}

absl::Status ExecuteReshardPlan(const ReshardPlan& plan, absl::Span<const void* const> src,
                                absl::Span<void* const> dst) {
  if (src.size() != static_cast<size_t>(plan.src_shards) ||
      dst.size() != static_cast<size_t>(plan.dst_shards)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ExecuteReshardPlan: got ", src.size(), " source and ", dst.size(),
        " destination shard pointers, the plan has ", plan.src_shards, " and ", plan.dst_shards));
  }
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == nullptr && plan.src_shard_elements > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecuteReshardPlan: source shard ", i, " pointer is null"));
    }
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    if (dst[i] == nullptr && plan.dst_shard_elements > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecuteReshardPlan: destination shard ", i, " pointer is null"));
    }
  }
  for (const ReshardCopy& c : plan.copies) {
    const bool ok = c.src_shard >= 0 && c.src_shard < plan.src_shards && c.dst_shard >= 0 &&
                    c.dst_shard < plan.dst_shards && c.src_offset <= plan.src_shard_elements &&
                    c.length <= plan.src_shard_elements - c.src_offset &&
                    c.dst_offset <= plan.dst_shard_elements &&
                    c.length <= plan.dst_shard_elements - c.dst_offset;
    if (!ok) {
      std::ostringstream copy;
      copy << c;
      return absl::InvalidArgumentError(
          absl::StrCat("ExecuteReshardPlan: copy ", copy.str(), " lies outside ", plan.src_shards,
                       " x ", plan.src_shard_elements, " source or ", plan.dst_shards, " x ",
                       plan.dst_shard_elements, " destination elements"));
    }
  }
  const size_t esize = plan.element_size();
  for (const ReshardCopy& c : plan.copies) {
    if (c.length == 0) continue;
    std::memcpy(static_cast<char*>(dst[c.dst_shard]) + c.dst_offset * esize,
                static_cast<const char*>(src[c.src_shard]) + c.src_offset * esize,
                c.length * esize);
  }
  return absl::OkStatus();
}

}  // namespace shardline
