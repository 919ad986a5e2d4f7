// File: testing/typed_values.h
// -----------------------------------------------------------------------------
// Test helpers: read and write one element of any DType as a double, a deterministic pattern of
// small integers (exact in every dtype, so sums of a few ranks are exact too), and the
// reference reductions the collectives are checked against — plain loops, independent of the
// kernels under test.

#ifndef SHARDLINE_TESTING_TYPED_VALUES_H_
#define SHARDLINE_TESTING_TYPED_VALUES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/dtype.h"
#include "runtime/half.h"

namespace shardline::testing {

inline double GetElement(DType dtype, const void* data, size_t i) {
  const auto* p = static_cast<const uint8_t*>(data) + i * DTypeSize(dtype);
  switch (dtype) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kF16:
    case DType::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, p, 2);
      return dtype == DType::kF16 ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
    }
    case DType::kI8:
      return static_cast<int8_t>(*p);
    case DType::kU8:
      return *p;
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kI64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
  }
  return 0;
}

inline void SetElement(DType dtype, void* data, size_t i, double value) {
  auto* p = static_cast<uint8_t*>(data) + i * DTypeSize(dtype);
  switch (dtype) {
    case DType::kF32: {
      float v = static_cast<float>(value);
      std::memcpy(p, &v, 4);
      return;
    }
    case DType::kF64:
      std::memcpy(p, &value, 8);
      return;
    case DType::kF16:
    case DType::kBF16: {
      const float f = static_cast<float>(value);
      uint16_t bits = dtype == DType::kF16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
      std::memcpy(p, &bits, 2);
      return;
    }
    case DType::kI8:
      *p = static_cast<uint8_t>(static_cast<int8_t>(value));
      return;
    case DType::kU8:
      *p = static_cast<uint8_t>(value);
      return;
    case DType::kI32: {
      int32_t v = static_cast<int32_t>(value);
      std::memcpy(p, &v, 4);
      return;
    }
    case DType::kI64: {
      int64_t v = static_cast<int64_t>(value);
      std::memcpy(p, &v, 8);
      return;
    }
  }
}

// Small integers in [-8, 8] ([0, 16] for u8) from a hash of (rank, index, salt): exact in every
// dtype, and without a period along the buffer, so a misplaced block or a shifted offset reads
// different values (a pattern periodic in the index could hide one).
inline double PatternValue(DType dtype, int rank, size_t i, int salt = 0) {
  uint64_t x = (static_cast<uint64_t>(static_cast<uint32_t>(rank)) << 48) ^
               (static_cast<uint64_t>(static_cast<uint32_t>(salt)) << 32) ^ i;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finalizer
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  const int v = static_cast<int>(x % 17);
  return dtype == DType::kU8 ? v : v - 8;
}

inline std::vector<uint8_t> PatternBuffer(DType dtype, int rank, size_t count, int salt = 0) {
  std::vector<uint8_t> buffer(count * DTypeSize(dtype));
  for (size_t i = 0; i < count; ++i)
    SetElement(dtype, buffer.data(), i, PatternValue(dtype, rank, i, salt));
  return buffer;
}

// One step of a reduction in double, as a plain reference (avg sums; divide afterwards).
inline double ReferenceOp(ReduceOp op, double acc, double v) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return acc + v;
    case ReduceOp::kMin:
      return std::min(acc, v);
    case ReduceOp::kMax:
      return std::max(acc, v);
    case ReduceOp::kProduct:
      return acc * v;
  }
  return acc;
}

// op over the ranks' pattern values of element i (avg: the exact mean, as a double).
inline double ReferenceReduce(DType dtype, ReduceOp op, int num_ranks, size_t i, int salt = 0) {
  double acc = PatternValue(dtype, 0, i, salt);
  for (int r = 1; r < num_ranks; ++r) {
    acc = ReferenceOp(op, acc, PatternValue(dtype, r, i, salt));
  }
  if (op == ReduceOp::kAvg) {
    acc /= num_ranks;
    if (!IsFloatingPoint(dtype)) acc = std::trunc(acc);
  }
  return acc;
}

// Whether `op` over `num_ranks` ranks' pattern values stays in `dtype`'s range: a product of more
// than 5 ranks' (8^6 > 65504) may overflow f16, where the order of the steps decides between
// inf and NaN (inf times 0). Everything else fits: 8 ranks' products reach 8^8 = 2^24 at most.
inline bool PatternReductionFits(DType dtype, ReduceOp op, int num_ranks) {
  return !(op == ReduceOp::kProduct && dtype == DType::kF16 && num_ranks > 5);
}

// How far a computed reduction may be from the exact one, `expected`, in `dtype`. Sums, min and
// max of the pattern are exact in every dtype, and so are products in f32, f64 and the integers;
// a 16-bit float rounds a product at every step of a reduction, relatively by 2^-8 (bf16) or
// 2^-11 (f16) each; an average rounds its division.
inline double Tolerance(DType dtype, ReduceOp op, double expected = 0) {
  if (op == ReduceOp::kProduct) {
    if (dtype == DType::kBF16) return std::abs(expected) * 8.0 / 256;
    if (dtype == DType::kF16) return std::abs(expected) * 8.0 / 2048;
    return 0;
  }
  if (op != ReduceOp::kAvg) return 0;
  switch (dtype) {
    case DType::kBF16:
      return 8.0 / 128;  // |avg| <= 8, 8 bits of mantissa
    case DType::kF16:
      return 8.0 / 1024;
    case DType::kF32:
      return 1e-5;
    case DType::kF64:
      return 1e-12;
    default:
      return 0;
  }
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTING_TYPED_VALUES_H_
