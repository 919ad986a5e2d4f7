// File: scheduler/mixed_precision.h
// -----------------------------------------------------------------------------
// The mixed-precision policy of one unit: which dtype each copy of its parameters and gradients
// is kept in, as PyTorch FSDP's MixedPrecision defines them.
//
//   master_dtype   the sharded parameters (the optimizer's copy) and, by default, the sharded
//                  gradient the optimizer reads. Usually f32.
//   param_dtype    the unsharded parameters: the all-gather moves this dtype and the framework
//                  computes in it; the unsharded gradient the framework writes is in it too.
//   reduce_dtype   the gradient reduction (reduce-scatter, and the all-reduce of hybrid
//                  sharding) runs in it; its result is accumulated into the sharded gradient.
//   keep_low_precision_grads
//                  false (default): the sharded gradient is kept in master_dtype (the reduced
//                  gradient is cast up before it is accumulated). true: it is kept in
//                  reduce_dtype, the dtype the reduction produced (PyTorch FSDP's meaning), for
//                  optimizers that run in low precision; no cast after the reduction.
//
// Typical policies (param/reduce/master): f32/f32/f32 (no mixed precision), bf16/f32/f32 (bf16
// compute, exact-ish reduction), bf16/bf16/f32 (halves the reduce-scatter traffic), f16/f32/f32.
// Any floating dtype (f32, f64, f16, bf16) is accepted in each role, as in FSDP; integer dtypes
// are not (a gradient of an integer tensor makes no sense).

#ifndef SHARDLINE_SCHEDULER_MIXED_PRECISION_H_
#define SHARDLINE_SCHEDULER_MIXED_PRECISION_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "runtime/dtype.h"

namespace shardline {

struct MixedPrecisionPolicy {
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  DType master_dtype = DType::kF32;
  bool keep_low_precision_grads = false;

  // OK if every dtype is a floating dtype; otherwise InvalidArgument naming the field and its
  // value, e.g. "mixed precision policy: reduce_dtype is i32, not a floating dtype (f32, f64,
  // f16, bf16)".
  absl::Status Validate() const;

  // The dtype of the sharded gradient: reduce_dtype with keep_low_precision_grads, else
  // master_dtype.
  DType sharded_grad_dtype() const {
    return keep_low_precision_grads ? reduce_dtype : master_dtype;
  }

  // "param=bf16 reduce=f32 master=f32", with " keep_low_precision_grads" appended when set.
  std::string ToString() const;

  friend bool operator==(const MixedPrecisionPolicy&, const MixedPrecisionPolicy&) = default;
};

std::ostream& operator<<(std::ostream& os, const MixedPrecisionPolicy& policy);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_MIXED_PRECISION_H_
