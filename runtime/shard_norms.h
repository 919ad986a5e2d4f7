// File: runtime/shard_norms.h
// -----------------------------------------------------------------------------
// Gradient-clipping norms over one shard of a FlatLayout: each rank sums the squares of the
// tensor elements it owns, the ranks all-reduce those partial sums, and GlobalL2Norm (or a
// per-tensor square root) turns them into the norm. Pure arithmetic over host memory: no
// communication.
//
// `shard_data` holds shard_elements() elements of `dtype` laid out as the layout's shard
// `shard` (dtype may differ from element_dtype: the same element offsets, another buffer).
// Padding is skipped. Sums are accumulated in double in slice order, so they are deterministic.
// Supported dtypes: f32, f64, f16, bf16; the integer dtypes are InvalidArgument, as are a shard
// out of range and null data for a shard with tensor elements.
//
//   SL_ASSIGN_OR_RETURN(double mine, ShardSquaredNorm(layout, rank, grad_shard, DType::kF32));
//   // all-reduce (sum) `mine` over the ranks, then:
//   const double norm = GlobalL2Norm({summed});

#ifndef SHARDLINE_RUNTIME_SHARD_NORMS_H_
#define SHARDLINE_RUNTIME_SHARD_NORMS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"

namespace shardline {

// Sum of squares of data[0..count), accumulated in double in index order (deterministic). The
// host side of EnqueueSumSquares (runtime/stream_ops.h). Same dtypes as below; count 0 is 0.
absl::StatusOr<double> SumOfSquares(const void* data, size_t count, DType dtype);

// Sum of squares of every tensor element of the shard.
absl::StatusOr<double> ShardSquaredNorm(const FlatLayout& layout, int shard, const void* shard_data,
                                        DType dtype);

// Adds each tensor's sum of squares over the shard to sums[tensor] (sums has num_tensors()
// entries; ties get nothing, their storage tensor gets the sum). Summing these vectors over all
// shards (an all-reduce) gives each tensor's squared norm: per-parameter clipping.
absl::Status AccumulateTensorSquaredNorms(const FlatLayout& layout, int shard,
                                          const void* shard_data, DType dtype,
                                          absl::Span<double> sums);

// sqrt of the sum of per-shard partial sums of squares: the global L2 norm.
double GlobalL2Norm(absl::Span<const double> partial_sums_of_squares);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_SHARD_NORMS_H_
