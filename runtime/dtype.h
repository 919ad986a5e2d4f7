// File: runtime/dtype.h
// -----------------------------------------------------------------------------
// Element types of buffers and collectives, and reduction operators.
//
// Names follow the short spellings users type on command lines and in configs ("f32",
// "bf16"); ParseDType also accepts the long ones ("float32", "bfloat16", "half", ...).

#ifndef SHARDLINE_RUNTIME_DTYPE_H_
#define SHARDLINE_RUNTIME_DTYPE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace shardline {

enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64 };

inline constexpr std::array<DType, 8> kAllDTypes = {DType::kF32,  DType::kF64, DType::kF16,
                                                    DType::kBF16, DType::kI8,  DType::kU8,
                                                    DType::kI32,  DType::kI64};

// Bytes per element.
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI8:
    case DType::kU8:
      return 1;
  }
  return 0;
}

constexpr bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kF16 ||
         dtype == DType::kBF16;
}

// "f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64".
absl::string_view DTypeName(DType dtype);

// Accepts the short names above and "float"/"float32", "double"/"float64", "half"/"float16",
// "bfloat16", "int8", "uint8", "int"/"int32", "int64"; case-insensitive. Anything else is
// InvalidArgument naming the text and listing the accepted names.
absl::StatusOr<DType> ParseDType(absl::string_view text);

std::ostream& operator<<(std::ostream& os, DType dtype);

// Reductions of ReduceScatter / AllReduce and of the host and CUDA reduce kernels.
// kAvg is a sum followed by a division by the number of contributors. kProduct multiplies
// (integers modulo 2^bits, like their sums).
enum class ReduceOp : uint8_t { kSum, kAvg, kMin, kMax, kProduct };

inline constexpr std::array<ReduceOp, 5> kAllReduceOps = {
    ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};

// "sum", "avg", "min", "max", "product".
absl::string_view ReduceOpName(ReduceOp op);
// Accepts the names above, case-insensitive; "mean" is accepted for avg, "prod" for product.
absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view text);
std::ostream& operator<<(std::ostream& os, ReduceOp op);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_DTYPE_H_
