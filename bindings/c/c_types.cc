// File: bindings/c/c_types.cc
// -----------------------------------------------------------------------------
// The C header's values as C++ values: timeouts, data types and reduction ops.

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "runtime/config.h"
#include "runtime/dtype.h"

namespace shardline::c_api {

absl::Duration Timeout(double seconds) {
  if (seconds <= 0) {
    absl::StatusOr<absl::Duration> d = shardline::DefaultTimeout();
    return d.ok() ? *d : absl::Seconds(600);
  }
  return absl::Seconds(seconds);
}

bool ToDType(shardlineDataType_t in, DType* out) {
  switch (in) {
    case shardlineFloat32:
      *out = DType::kF32;
      return true;
    case shardlineFloat64:
      *out = DType::kF64;
      return true;
    case shardlineFloat16:
      *out = DType::kF16;
      return true;
    case shardlineBfloat16:
      *out = DType::kBF16;
      return true;
    case shardlineInt32:
      *out = DType::kI32;
      return true;
    case shardlineInt64:
      *out = DType::kI64;
      return true;
    case shardlineUint8:
      *out = DType::kU8;
      return true;
    case shardlineInt8:
      *out = DType::kI8;
      return true;
    default:
      break;
  }
  return false;
}

bool ToOp(shardlineRedOp_t in, ReduceOp* out) {
  switch (in) {
    case shardlineSum:
      *out = ReduceOp::kSum;
      return true;
    case shardlineAvg:
      *out = ReduceOp::kAvg;
      return true;
    case shardlineMin:
      *out = ReduceOp::kMin;
      return true;
    case shardlineMax:
      *out = ReduceOp::kMax;
      return true;
    case shardlineProduct:
      *out = ReduceOp::kProduct;
      return true;
    case shardlineRedOpEnumMax:
      break;
  }
  return false;
}

}  // namespace shardline::c_api
