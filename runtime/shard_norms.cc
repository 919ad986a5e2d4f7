#include "runtime/shard_norms.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "runtime/half.h"
#include "runtime/status.h"

namespace shardline {
namespace {

template <typename Load>
double SumSquares(const ShardSlice& sl, Load load) {
  double sum = 0.0;
  const size_t end = sl.shard_offset + sl.length;
  for (size_t k = sl.shard_offset; k < end; ++k) {
    const double x = load(k);
    sum += x * x;
  }
  return sum;
}

// Calls fn(load) with a loader for `dtype`, or returns InvalidArgument.
template <typename Fn>
absl::Status WithLoader(const void* data, DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kF32: {
      const float* p = static_cast<const float*>(data);
      fn([p](size_t k) { return static_cast<double>(p[k]); });
      return absl::OkStatus();
    }
    case DType::kF64: {
      const double* p = static_cast<const double*>(data);
      fn([p](size_t k) { return p[k]; });
      return absl::OkStatus();
    }
    case DType::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(data);
      fn([p](size_t k) { return static_cast<double>(HalfBitsToFloat(p[k])); });
      return absl::OkStatus();
    }
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(data);
      fn([p](size_t k) { return static_cast<double>(Bf16BitsToFloat(p[k])); });
      return absl::OkStatus();
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("flat layout norm: dtype ", DTypeName(dtype),
                                                 " is not supported (f32, f64, f16, bf16)"));
}

absl::Status CheckNormArgs(const FlatLayout& layout, int shard, const void* data,
                           absl::string_view fn) {
  if (shard < 0 || shard >= layout.num_shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": shard ", shard, " is outside [0, ", layout.num_shards(), ")"));
  }
  if (data == nullptr && !layout.ShardSlices(shard).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": shard_data is null"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<double> SumOfSquares(const void* data, size_t count, DType dtype) {
  if (count > 0 && data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("SumOfSquares: data is null (count ", count, ")"));
  }
  double total = 0.0;
  SL_RETURN_IF_ERROR(WithLoader(data, dtype, [&](auto load) {
    total = SumSquares(ShardSlice{.shard_offset = 0, .length = count}, load);
  }));
  return total;
}

absl::StatusOr<double> ShardSquaredNorm(const FlatLayout& layout, int shard, const void* shard_data,
                                        DType dtype) {
  SL_RETURN_IF_ERROR(CheckNormArgs(layout, shard, shard_data, "ShardSquaredNorm"));
  double total = 0.0;
  absl::Span<const ShardSlice> slices = layout.ShardSlices(shard);
  SL_RETURN_IF_ERROR(WithLoader(shard_data, dtype, [&](auto load) {
    for (const ShardSlice& sl : slices) total += SumSquares(sl, load);
  }));
  return total;
}

absl::Status AccumulateTensorSquaredNorms(const FlatLayout& layout, int shard,
                                          const void* shard_data, DType dtype,
                                          absl::Span<double> sums) {
  SL_RETURN_IF_ERROR(CheckNormArgs(layout, shard, shard_data, "AccumulateTensorSquaredNorms"));
  if (sums.size() != static_cast<size_t>(layout.num_tensors())) {
    return absl::InvalidArgumentError(absl::StrCat("AccumulateTensorSquaredNorms: sums has ",
                                                   sums.size(), " entries, the layout ",
                                                   layout.num_tensors(), " tensors"));
  }
  absl::Span<const ShardSlice> slices = layout.ShardSlices(shard);
  return WithLoader(shard_data, dtype, [&](auto load) {
    for (const ShardSlice& sl : slices) sums[sl.tensor] += SumSquares(sl, load);
  });
}

double GlobalL2Norm(absl::Span<const double> partial_sums_of_squares) {
  double total = 0.0;
  for (double x : partial_sums_of_squares) total += x;
  return std::sqrt(total);
}

}  // namespace shardline
