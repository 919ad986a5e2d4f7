#include "scheduler/mixed_precision.h"

#include "absl/strings/str_cat.h"

namespace shardline {
namespace {

absl::Status CheckFloating(absl::string_view field, DType dtype) {
  if (IsFloatingPoint(dtype)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("mixed precision policy: ", field, " is ",
                                                 DTypeName(dtype),
                                                 ", not a floating dtype (f32, f64, f16, bf16)"));
}

}  // namespace

absl::Status MixedPrecisionPolicy::Validate() const {
  if (absl::Status s = CheckFloating("param_dtype", param_dtype); !s.ok()) return s;
  if (absl::Status s = CheckFloating("reduce_dtype", reduce_dtype); !s.ok()) return s;
  return CheckFloating("master_dtype", master_dtype);
}

std::string MixedPrecisionPolicy::ToString() const {
  return absl::StrCat("param=", DTypeName(param_dtype), " reduce=", DTypeName(reduce_dtype),
                      " master=", DTypeName(master_dtype),
                      keep_low_precision_grads ? " keep_low_precision_grads" : "");
}

std::ostream& operator<<(std::ostream& os, const MixedPrecisionPolicy& policy) {
  return os << policy.ToString();
}

}  // namespace shardline
