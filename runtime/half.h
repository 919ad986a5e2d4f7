// File: runtime/half.h
// -----------------------------------------------------------------------------
// Scalar conversions between float/double and the 16-bit floating formats, with exact IEEE 754
// semantics and no dependency on compiler _Float16 / __bf16 or on cuda_fp16.h, so the host
// kernels, the CUDA kernels and the tests all round the same way, bit for bit.
//
//   bf16: 1 sign, 8 exponent, 7 mantissa bits (the top half of an f32).
//   f16:  1 sign, 5 exponent, 10 mantissa bits (IEEE binary16).
//
// Every narrowing conversion rounds to nearest, ties to even. NaN stays NaN with its sign; the
// result is a quiet NaN (the top payload bits are kept where they fit). ±Inf and ±0 are
// preserved. Finite values too large for the format become ±Inf (for f16: |x| >= 65520, the
// midpoint between the largest finite value 65504 and 2^16). f16 subnormals are produced and
// read exactly. Widening conversions (to float) are exact; a signalling NaN comes back quiet.
//
// The double → 16-bit conversions round once, directly from the double (not via an f32
// rounded to nearest, which would round twice): the double is first narrowed to f32 with
// round-to-odd, which keeps enough information for the second rounding to be exact.
//
// The narrowing conversions assume the default floating-point environment (round to nearest;
// flush-to-zero / denormals-are-zero off). Everything is constexpr and usable from host and
// CUDA device code (__host__ __device__ when compiled by nvcc).

#ifndef SHARDLINE_RUNTIME_HALF_H_
#define SHARDLINE_RUNTIME_HALF_H_

#include <cstdint>

#if defined(__CUDACC__)
#define SL_HOST_DEVICE __host__ __device__
#else
#define SL_HOST_DEVICE
#endif

namespace shardline {

// Bit-level views. std::bit_cast is not a device function under nvcc; the builtin is, but GCC's
// vectoriser rejects it, so outside constant evaluation the copy goes through memcpy (which
// compiles to a register move).
SL_HOST_DEVICE constexpr uint32_t FloatToBits(float f) {
  if (__builtin_is_constant_evaluated()) return __builtin_bit_cast(uint32_t, f);
  uint32_t u = 0;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
}
SL_HOST_DEVICE constexpr float BitsToFloat(uint32_t u) {
  if (__builtin_is_constant_evaluated()) return __builtin_bit_cast(float, u);
  float f = 0;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- bf16 ------------------------------------------------------------------------------------

// Both conversions are selects over values computed unconditionally (no early return), so that
// loops over them vectorise: the bf16 reductions of the collectives run through them.
SL_HOST_DEVICE constexpr uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatToBits(f);
  // NaN: keep sign and payload top, quiet.
  const uint32_t nan = (u >> 16) | 0x0040u;
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest, ties to even; a
  // carry out of the mantissa correctly bumps the exponent (up to Inf for the largest values).
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

SL_HOST_DEVICE constexpr float Bf16BitsToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  // Quiet a signalling NaN.
  return BitsToFloat(u | ((u & 0x7fffffffu) > 0x7f800000u ? 0x00400000u : 0u));
}

// ---- f16 -------------------------------------------------------------------------------------

// The branches below are written as selects over values computed unconditionally: GCC does not
// speculate floating-point operations (-ftrapping-math), and a select lets it vectorise loops.
SL_HOST_DEVICE constexpr uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // |f| >= 2^16: Inf, or NaN (quiet, keeping the payload's top bits).
  const uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u;
  // |f| < 2^-14, f16 subnormal or zero: adding 0.5 puts the f16 subnormal grid (spacing 2^-24)
  // onto the f32 mantissa's last bit, so the FPU's own round-to-nearest-even does the rounding;
  // the sum (>= 0.5) is normal, and its mantissa is the f16 bit pattern (0x400 when it rounds
  // up to the smallest normal, which is the right encoding too).
  const uint32_t subnormal = FloatToBits(BitsToFloat(a) + 0.5f) - 0x3f000000u;
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest
  // even. A carry into exponent 31 yields 0x7c00, i.e. Inf, exactly when |f| >= 65520.
  const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t h = a >= 0x47800000u ? special : (a < 0x38800000u ? subnormal : normal);
  return static_cast<uint16_t>(h | sign);
}

SL_HOST_DEVICE constexpr float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // Zero or subnormal: mant * 2^-24, exact in f32.
  const uint32_t subnormal = FloatToBits(static_cast<float>(mant) * 0x1p-24f);
  // Inf or NaN (quieted).
  const uint32_t special = 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  return BitsToFloat(sign | (exp == 0 ? subnormal : (exp == 31 ? special : normal)));
}

// ---- double ----------------------------------------------------------------------------------

// `d` narrowed to f32 with round-to-odd: truncate toward zero, then set the last mantissa bit if
// anything was dropped. Rounding this f32 to a format with at most 22 mantissa bits gives the
// correctly rounded value of `d`. Values beyond FLT_MAX become FLT_MAX (odd), which then round to
// Inf in the 16-bit formats; NaN stays NaN.
SL_HOST_DEVICE constexpr float DoubleToFloatRoundToOdd(double d) {
  const float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  // Rounded away from zero: step one ulp back toward zero (bit patterns order by magnitude).
  // NaN compares false everywhere and comes out as a NaN with its last mantissa bit set.
  const bool away = d < 0 ? back < d : back > d;
  const uint32_t truncated = FloatToBits(f) - (away ? 1u : 0u);
  const bool inexact = static_cast<double>(BitsToFloat(truncated)) != d;
  return BitsToFloat(truncated | (inexact ? 1u : 0u));
}

SL_HOST_DEVICE constexpr uint16_t DoubleToBf16Bits(double d) {
  return FloatToBf16Bits(DoubleToFloatRoundToOdd(d));
}
SL_HOST_DEVICE constexpr uint16_t DoubleToHalfBits(double d) {
  return FloatToHalfBits(DoubleToFloatRoundToOdd(d));
}

// ---- wrapper types ---------------------------------------------------------------------------

// Storage-only 16-bit floats: they carry bits, arithmetic happens in float.
struct bf16 {
  uint16_t bits = 0;
  SL_HOST_DEVICE static constexpr bf16 FromFloat(float f) { return bf16{FloatToBf16Bits(f)}; }
  SL_HOST_DEVICE constexpr float ToFloat() const { return Bf16BitsToFloat(bits); }
};

struct f16 {
  uint16_t bits = 0;
  SL_HOST_DEVICE static constexpr f16 FromFloat(float f) { return f16{FloatToHalfBits(f)}; }
  SL_HOST_DEVICE constexpr float ToFloat() const { return HalfBitsToFloat(bits); }
};

static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_HALF_H_
