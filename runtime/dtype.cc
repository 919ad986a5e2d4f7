#include "runtime/dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace shardline {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "i8";
    case DType::kU8:
      return "u8";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(absl::string_view text) {
  struct Alias {
    absl::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"float", DType::kF32},     {"float32", DType::kF32}, {"double", DType::kF64},
      {"float64", DType::kF64},   {"half", DType::kF16},    {"float16", DType::kF16},
      {"bfloat16", DType::kBF16}, {"int8", DType::kI8},     {"uint8", DType::kU8},
      {"int", DType::kI32},       {"int32", DType::kI32},   {"int64", DType::kI64},
  };
  const std::string lower = absl::AsciiStrToLower(text);
  for (DType dtype : kAllDTypes) {
    if (lower == DTypeName(dtype)) return dtype;
  }
  for (const Alias& alias : kAliases) {
    if (lower == alias.name) return alias.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", text, "' (expected one of f32, f64, f16, bf16, i8, u8, i32, ",
                   "i64 or float32, float64, float16, bfloat16, int8, uint8, int32, int64)"));
}

std::ostream& operator<<(std::ostream& os, DType dtype) { return os << DTypeName(dtype); }

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
  }
  return "invalid";
}

absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  for (ReduceOp op : kAllReduceOps) {
    if (lower == ReduceOpName(op)) return op;
  }
  if (lower == "mean") return ReduceOp::kAvg;
  if (lower == "prod") return ReduceOp::kProduct;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown reduce op '", text, "' (expected sum, avg, min, max or product)"));
}

std::ostream& operator<<(std::ostream& os, ReduceOp op) { return os << ReduceOpName(op); }

}  // namespace shardline
