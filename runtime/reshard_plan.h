// File: runtime/reshard_plan.h
// -----------------------------------------------------------------------------
// Resharding math: the copies that move every tensor element of a unit from its shards under
// one FlatLayout to its shards under another (a different shard count, alignment or block
// size; the same tensors). It is what a checkpoint written at world size N uses to load at
// world size M. Pure arithmetic; ExecuteReshardPlan runs a plan on host memory.
//
// Guarantees of PlanReshard(from, to):
//   * every element of every storage tensor is copied exactly once, padding never;
//   * copies are sorted by destination (dst_shard, dst_offset) and, equivalently, by source
//     (src_shard, src_offset): both follow the tensors' order in the flat buffer;
//   * adjacent copies are merged when they are contiguous on both sides (same shards, each side
//     continuing where the previous copy ended), so an unchanged layout is one copy per shard
//     run, not one per tensor.
// Offsets and lengths count elements of the layouts' common element dtype.

#ifndef SHARDLINE_RUNTIME_RESHARD_PLAN_H_
#define SHARDLINE_RUNTIME_RESHARD_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"

namespace shardline {

// Copy `length` elements from [src_offset, src_offset + length) of source shard src_shard to
// [dst_offset, dst_offset + length) of destination shard dst_shard.
struct ReshardCopy {
  int32_t src_shard = 0;
  int32_t dst_shard = 0;
  size_t src_offset = 0;
  size_t dst_offset = 0;
  size_t length = 0;

  friend bool operator==(const ReshardCopy&, const ReshardCopy&) = default;
};
std::ostream& operator<<(std::ostream& os, const ReshardCopy& copy);

struct ReshardPlan {
  DType element_dtype = DType::kF32;
  int src_shards = 1;
  size_t src_shard_elements = 0;
  int dst_shards = 1;
  size_t dst_shard_elements = 0;
  std::vector<ReshardCopy> copies;

  size_t element_size() const { return DTypeSize(element_dtype); }
  // Sum of the copies' lengths: the tensor elements of the layouts.
  size_t total_elements() const;
  // The copies that write destination shard `dst` (what rank `dst` reads when it loads), and
  // the copies that read source shard `src`. Contiguous sub-ranges of `copies`; O(log n).
  absl::Span<const ReshardCopy> ForDestination(int dst) const;
  absl::Span<const ReshardCopy> ForSource(int src) const;
};

// The plan from `from` to `to`. InvalidArgument if the element dtypes differ (a cast is not a
// copy), or if the tensors differ in count or, for the first differing tensor (named by index
// and both names), in name, shape, dtype or tie.
absl::StatusOr<ReshardPlan> PlanReshard(const FlatLayout& from, const FlatLayout& to);

// Runs `plan` with memcpy: src[i] points at source shard i (src_shard_elements elements),
// dst[j] at destination shard j (dst_shard_elements elements); the two sets must not overlap.
// Destination padding is not written (zero it first, e.g. FlatLayout::ZeroShardPadding).
// InvalidArgument if the pointer counts differ from the plan's shard counts, a pointer is null
// for a non-empty shard, or a copy lies outside its shards (a hand-edited plan).
absl::Status ExecuteReshardPlan(const ReshardPlan& plan, absl::Span<const void* const> src,
                                absl::Span<void* const> dst);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_RESHARD_PLAN_H_
