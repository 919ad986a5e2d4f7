// GCC's -O2 uses the "very-cheap" vectoriser cost model, which refuses any loop that needs a
// scalar epilogue, a runtime alias check or if-conversion — i.e. every loop here; the dynamic
// model (the -O3 default) vectorises them. -fno-trapping-math lets GCC if-convert the selects
// around floating-point operations in the f16 conversions (we never unmask FP exceptions).
// Neither option changes a single result bit: no reassociation, no contraction, same rounding.
// Must precede the includes so the inlined helpers are compiled under the same options.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic", "no-trapping-math")
#endif

#include "runtime/host_kernels.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/half.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// Loads and stores go through memcpy: any byte address is valid, and GCC turns a fixed-size
// memcpy into a plain (unaligned) load or store, which vectorises.
template <typename T>
inline T Load(const std::byte* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
inline void Store(std::byte* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// Storage type S (what memory holds) and compute type C (what arithmetic happens in).
template <DType D>
struct Elem;
template <typename T>
struct SameElem {
  using S = T;
  using C = T;
  static C ToC(S s) { return s; }
  static S FromC(C c) { return c; }
};
template <>
struct Elem<DType::kF32> : SameElem<float> {};
template <>
struct Elem<DType::kF64> : SameElem<double> {};
template <>
struct Elem<DType::kI8> : SameElem<int8_t> {};
template <>
struct Elem<DType::kU8> : SameElem<uint8_t> {};
template <>
struct Elem<DType::kI32> : SameElem<int32_t> {};
template <>
struct Elem<DType::kI64> : SameElem<int64_t> {};
template <>
struct Elem<DType::kF16> {
  using S = uint16_t;
  using C = float;
  static C ToC(S s) { return HalfBitsToFloat(s); }
  static S FromC(C c) { return FloatToHalfBits(c); }
};
template <>
struct Elem<DType::kBF16> {
  using S = uint16_t;
  using C = float;
  static C ToC(S s) { return Bf16BitsToFloat(s); }
  static S FromC(C c) { return FloatToBf16Bits(c); }
};

struct SumOp {
  template <typename C>
  static C Apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) {
      // Wraps modulo 2^bits instead of overflowing (undefined for signed types).
      using U = std::make_unsigned_t<C>;
      return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};
struct ProductOp {
  template <typename C>
  static C Apply(C a, C b) {
    if constexpr (std::is_integral_v<C>) {
      // Modulo 2^bits, as the sums. Unsigned types narrower than int promote to (signed) int
      // in a multiplication, which can overflow: multiply as unsigned int at least.
      using U = std::common_type_t<std::make_unsigned_t<C>, unsigned int>;
      return static_cast<C>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};
struct MinOp {
  template <typename C>
  static C Apply(C a, C b) {
    return a < b ? a : b;
  }
};
struct MaxOp {
  template <typename C>
  static C Apply(C a, C b) {
    return a > b ? a : b;
  }
};

// Calls f(std::integral_constant<DType, D>{}) for the runtime `dtype`; false if unknown.
template <typename F>
bool DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>{});
      return true;
    case DType::kF64:
      f(std::integral_constant<DType, DType::kF64>{});
      return true;
    case DType::kF16:
      f(std::integral_constant<DType, DType::kF16>{});
      return true;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>{});
      return true;
    case DType::kI8:
      f(std::integral_constant<DType, DType::kI8>{});
      return true;
    case DType::kU8:
      f(std::integral_constant<DType, DType::kU8>{});
      return true;
    case DType::kI32:
      f(std::integral_constant<DType, DType::kI32>{});
      return true;
    case DType::kI64:
      f(std::integral_constant<DType, DType::kI64>{});
      return true;
  }
  return false;
}

template <typename F>
bool DispatchOp(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      f(SumOp{});
      return true;
    case ReduceOp::kMin:
      f(MinOp{});
      return true;
    case ReduceOp::kMax:
      f(MaxOp{});
      return true;
    case ReduceOp::kProduct:
      f(ProductOp{});
      return true;
  }
  return false;
}

// ---- Cast ------------------------------------------------------------------------------------

// One floating element from Src to Dst. Everything except f64 widens exactly to f32, so the only
// rounding is the final one; f64 sources round once, directly (see runtime/half.h).
template <DType Src, DType Dst>
inline typename Elem<Dst>::S ConvertOne(typename Elem<Src>::S v) {
  if constexpr (Src == DType::kF64) {
    if constexpr (Dst == DType::kF32) return static_cast<float>(v);
    if constexpr (Dst == DType::kF16) return DoubleToHalfBits(v);
    if constexpr (Dst == DType::kBF16) return DoubleToBf16Bits(v);
  } else {
    const float x = Elem<Src>::ToC(v);
    if constexpr (Dst == DType::kF64) {
      return static_cast<double>(x);
    } else {
      return Elem<Dst>::FromC(x);
    }
  }
}

template <DType Src, DType Dst>
void CastImpl(const std::byte* src, std::byte* dst, size_t count) {
  using SS = typename Elem<Src>::S;
  using DS = typename Elem<Dst>::S;
  for (size_t i = 0; i < count; ++i) Store<DS>(dst, i, ConvertOne<Src, Dst>(Load<SS>(src, i)));
}

// ---- Reduce ----------------------------------------------------------------------------------

template <DType D, typename Op>
void ReduceImpl(std::byte* inout, const std::byte* in, size_t count) {
  using E = Elem<D>;
  using S = typename E::S;
  for (size_t i = 0; i < count; ++i) {
    Store<S>(inout, i, E::FromC(Op::Apply(E::ToC(Load<S>(inout, i)), E::ToC(Load<S>(in, i)))));
  }
}

// Accumulates a chunk of every input in a compute-type buffer that stays in L1, then rounds and
// stores it once: one pass over each input, one rounding, and `out` may alias any input because
// a chunk is read completely before it is written.
template <DType D, typename Op>
void ReduceManyImpl(std::byte* out, const std::byte* const* inputs, int num_inputs, size_t count) {
  using E = Elem<D>;
  using S = typename E::S;
  using C = typename E::C;
  constexpr size_t kChunk = 1024;
  C acc[kChunk];
  for (size_t base = 0; base < count; base += kChunk) {
    const size_t len = std::min(kChunk, count - base);
    const size_t offset = base * sizeof(S);
    const std::byte* first = inputs[0] + offset;
    for (size_t j = 0; j < len; ++j) acc[j] = E::ToC(Load<S>(first, j));
    for (int k = 1; k < num_inputs; ++k) {
      const std::byte* p = inputs[k] + offset;
      for (size_t j = 0; j < len; ++j) acc[j] = Op::Apply(acc[j], E::ToC(Load<S>(p, j)));
    }
    std::byte* o = out + offset;
    for (size_t j = 0; j < len; ++j) Store<S>(o, j, E::FromC(acc[j]));
  }
}

#if defined(__x86_64__)
// ReduceManyImpl with non-temporal stores, one 64-byte line of output at a time: every input's
// line is accumulated (in registers), rounded and streamed out before the next line is read, so
// the streaming stores interleave with the loads. (Reducing a 4 KiB chunk first and streaming it
// out in a burst ran at half the speed of plain stores: the bursts stall on the write-combining
// buffers while no load is in flight.) The same arithmetic, element by element, as
// ReduceManyImpl; `out` may alias an input (each line is read before it is written). `out` must
// be 64-byte aligned; the caller does the rest.
template <DType D, typename Op>
void ReduceManyLinesImpl(std::byte* out, const std::byte* const* inputs, int num_inputs,
                         size_t lines) {
  using E = Elem<D>;
  using S = typename E::S;
  using C = typename E::C;
  constexpr size_t kLine = 64;
  constexpr size_t kPer = kLine / sizeof(S);
  for (size_t l = 0; l < lines; ++l) {
    const size_t offset = l * kLine;
    C acc[kPer];
    for (size_t j = 0; j < kPer; ++j) acc[j] = E::ToC(Load<S>(inputs[0] + offset, j));
    for (int k = 1; k < num_inputs; ++k) {
      const std::byte* p = inputs[k] + offset;
      for (size_t j = 0; j < kPer; ++j) acc[j] = Op::Apply(acc[j], E::ToC(Load<S>(p, j)));
    }
    alignas(16) S rounded[kPer];
    for (size_t j = 0; j < kPer; ++j) rounded[j] = E::FromC(acc[j]);
    auto* dst = reinterpret_cast<__m128i*>(out + offset);
    const auto* src = reinterpret_cast<const __m128i*>(rounded);
    _mm_stream_si128(dst, _mm_load_si128(src));
    _mm_stream_si128(dst + 1, _mm_load_si128(src + 1));
    _mm_stream_si128(dst + 2, _mm_load_si128(src + 2));
    _mm_stream_si128(dst + 3, _mm_load_si128(src + 3));
  }
  // Non-temporal stores are weakly ordered: visible before whatever says the output is done.
  _mm_sfence();
}
#endif

// ---- Scale -----------------------------------------------------------------------------------

template <DType D>
void ScaleFloatImpl(std::byte* inout, size_t count, double factor) {
  using E = Elem<D>;
  using S = typename E::S;
  using C = typename E::C;
  const C f = static_cast<C>(factor);
  for (size_t i = 0; i < count; ++i) Store<S>(inout, i, E::FromC(E::ToC(Load<S>(inout, i)) * f));
}

template <DType D>
void ScaleDivideImpl(std::byte* inout, size_t count, int64_t divisor) {
  using S = typename Elem<D>::S;
  if constexpr (sizeof(S) < sizeof(int64_t)) {
    // 32-bit division when the divisor fits (it vectorises better than 64-bit division).
    if (divisor <= std::numeric_limits<S>::max()) {
      const int32_t d = static_cast<int32_t>(divisor);
      for (size_t i = 0; i < count; ++i) {
        Store<S>(inout, i, static_cast<S>(static_cast<int32_t>(Load<S>(inout, i)) / d));
      }
      return;
    }
  }
  for (size_t i = 0; i < count; ++i) {
    Store<S>(inout, i, static_cast<S>(static_cast<int64_t>(Load<S>(inout, i)) / divisor));
  }
}

template <DType D>
void ScaleIntegerMultiplyImpl(std::byte* inout, size_t count, double factor) {
  using S = typename Elem<D>::S;
  // Bounds as doubles: for 64-bit types max() is not representable; 2^63 is, and anything at or
  // above it saturates.
  const double lo = static_cast<double>(std::numeric_limits<S>::min());
  const double hi = static_cast<double>(std::numeric_limits<S>::max());
  for (size_t i = 0; i < count; ++i) {
    const double v = std::trunc(static_cast<double>(Load<S>(inout, i)) * factor);
    S r;
    if (v <= lo) {
      r = std::numeric_limits<S>::min();
    } else if (v >= hi) {
      r = std::numeric_limits<S>::max();
    } else {
      r = static_cast<S>(v);
    }
    Store<S>(inout, i, r);
  }
}

absl::Status NullError(absl::string_view fn, absl::string_view arg, size_t count) {
  return absl::InvalidArgumentError(
      absl::StrCat(fn, ": ", arg, " is null with count=", count, " > 0"));
}

}  // namespace

// The element loops below are compiled twice on x86-64 with GCC — for the baseline (SSE2) and
// for AVX2 — and the copy for this CPU is picked once at load time (an ifunc). Both give the same
// bits: every loop is element-wise, nothing is reassociated and no multiply-add is fused.
// flatten inlines the typed loops into each copy, so that they are compiled for its target.
// Sanitizer builds and clang keep one copy.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define SL_KERNEL_CLONES __attribute__((target_clones("avx2", "default"), flatten))
#else
#define SL_KERNEL_CLONES
#endif

namespace kernels_internal {

SL_KERNEL_CLONES void RunCast(const std::byte* s, DType src_dtype, std::byte* d, DType dst_dtype,
                              size_t count) {
  DispatchDType(src_dtype, [&](auto src_tag) {
    DispatchDType(dst_dtype, [&](auto dst_tag) {
      constexpr DType kSrc = decltype(src_tag)::value;
      constexpr DType kDst = decltype(dst_tag)::value;
      if constexpr (IsFloatingPoint(kSrc) && IsFloatingPoint(kDst) && kSrc != kDst) {
        CastImpl<kSrc, kDst>(s, d, count);
      }
    });
  });
}

SL_KERNEL_CLONES void RunReduce(std::byte* io, const std::byte* p, size_t count, DType dtype,
                                ReduceOp op) {
  DispatchDType(dtype, [&](auto tag) {
    DispatchOp(
        op, [&](auto op_tag) { ReduceImpl<decltype(tag)::value, decltype(op_tag)>(io, p, count); });
  });
}

SL_KERNEL_CLONES void RunReduceMany(std::byte* o, const std::byte* const* in, int num_inputs,
                                    size_t count, DType dtype, ReduceOp op) {
  DispatchDType(dtype, [&](auto tag) {
    DispatchOp(op, [&](auto op_tag) {
      ReduceManyImpl<decltype(tag)::value, decltype(op_tag)>(o, in, num_inputs, count);
    });
  });
}

#if defined(__x86_64__)
SL_KERNEL_CLONES void RunReduceManyLines(std::byte* o, const std::byte* const* in, int num_inputs,
                                         size_t lines, DType dtype, ReduceOp op) {
  DispatchDType(dtype, [&](auto tag) {
    DispatchOp(op, [&](auto op_tag) {
      ReduceManyLinesImpl<decltype(tag)::value, decltype(op_tag)>(o, in, num_inputs, lines);
    });
  });
}
#endif

SL_KERNEL_CLONES void RunScale(std::byte* io, size_t count, DType dtype, double factor,
                               int64_t divisor) {
  DispatchDType(dtype, [&](auto tag) {
    constexpr DType kD = decltype(tag)::value;
    if constexpr (IsFloatingPoint(kD)) {
      ScaleFloatImpl<kD>(io, count, factor);
    } else if (divisor > 0) {
      ScaleDivideImpl<kD>(io, count, divisor);
    } else {
      ScaleIntegerMultiplyImpl<kD>(io, count, factor);
    }
  });
}

}  // namespace kernels_internal

absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count) {
  if (!IsFloatingPoint(src_dtype) || !IsFloatingPoint(dst_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Cast: unsupported dtype pair ", DTypeName(src_dtype), " -> ",
                     DTypeName(dst_dtype), " (only f32, f64, f16, bf16 are supported)"));
  }
  if (count == 0) return absl::OkStatus();
  if (src == nullptr) return NullError("Cast", "src", count);
  if (dst == nullptr) return NullError("Cast", "dst", count);
  if (src_dtype == dst_dtype) {
    if (src != dst) std::memcpy(dst, src, count * DTypeSize(src_dtype));
    return absl::OkStatus();
  }
  kernels_internal::RunCast(static_cast<const std::byte*>(src), src_dtype,
                            static_cast<std::byte*>(dst), dst_dtype, count);
  return absl::OkStatus();
}

absl::Status Reduce(void* inout, const void* in, size_t count, DType dtype, ReduceOp op) {
  bool known_op = DispatchOp(op, [](auto) {});
  if (!known_op) {
    return absl::InvalidArgumentError(
        absl::StrCat("Reduce: invalid reduce op ", static_cast<int>(op)));
  }
  bool known_dtype = DispatchDType(dtype, [](auto) {});
  if (!known_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("Reduce: invalid dtype ", static_cast<int>(dtype)));
  }
  if (count == 0) return absl::OkStatus();
  if (inout == nullptr) return NullError("Reduce", "inout", count);
  if (in == nullptr) return NullError("Reduce", "in", count);
  kernels_internal::RunReduce(static_cast<std::byte*>(inout), static_cast<const std::byte*>(in),
                              count, dtype, op);
  return absl::OkStatus();
}

namespace {

// Room for `n` input pointers, per thread (kept: a reduce-scatter calls this per chunk).
std::vector<const std::byte*>& ScratchPointers(int n) {
  thread_local std::vector<const std::byte*> pointers;
  pointers.resize(n);
  return pointers;
}

// ReduceMany's and ReduceManyStreaming's argument checks (`fn` names the caller).
absl::Status CheckReduceMany(absl::string_view fn, const void* out, const void* const* inputs,
                             int num_inputs, size_t count, DType dtype, ReduceOp op) {
  if (num_inputs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": num_inputs must be >= 1, got ", num_inputs));
  }
  if (!DispatchOp(op, [](auto) {})) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": invalid reduce op ", static_cast<int>(op)));
  }
  if (!DispatchDType(dtype, [](auto) {})) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": invalid dtype ", static_cast<int>(dtype)));
  }
  if (count == 0) return absl::OkStatus();
  if (out == nullptr) return NullError(fn, "out", count);
  if (inputs == nullptr) return NullError(fn, "inputs", count);
  for (int k = 0; k < num_inputs; ++k) {
    if (inputs[k] == nullptr) return NullError(fn, absl::StrCat("inputs[", k, "]"), count);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count,
                        DType dtype, ReduceOp op) {
  SL_RETURN_IF_ERROR(CheckReduceMany("ReduceMany", out, inputs, num_inputs, count, dtype, op));
  if (count == 0) return absl::OkStatus();
  kernels_internal::RunReduceMany(static_cast<std::byte*>(out),
                                  reinterpret_cast<const std::byte* const*>(inputs), num_inputs,
                                  count, dtype, op);
  return absl::OkStatus();
}

absl::Status ReduceManyStreaming(void* out, const void* const* inputs, int num_inputs, size_t count,
                                 DType dtype, ReduceOp op) {
  SL_RETURN_IF_ERROR(
      CheckReduceMany("ReduceManyStreaming", out, inputs, num_inputs, count, dtype, op));
  if (count == 0) return absl::OkStatus();
  auto* o = static_cast<std::byte*>(out);
  auto* in = reinterpret_cast<const std::byte* const*>(inputs);
  const size_t size = DTypeSize(dtype);
#if defined(__x86_64__)
  // Whole elements up to the first 64-byte boundary of the output, whole lines with streaming
  // stores, then the rest; an output that no whole number of elements brings to a boundary (an
  // odd address for 2-byte elements, say) takes plain stores throughout.
  const size_t head_bytes = (64 - (reinterpret_cast<uintptr_t>(o) & 63)) & 63;
  if (count * size >= kStreamingCopyMinBytes && head_bytes % size == 0) {
    const size_t head = head_bytes / size;
    const size_t lines = (count - head) * size / 64;
    const size_t tail = count - head - lines * 64 / size;
    std::vector<const std::byte*>& moved = ScratchPointers(num_inputs);
    kernels_internal::RunReduceMany(o, in, num_inputs, head, dtype, op);
    for (int k = 0; k < num_inputs; ++k) moved[k] = in[k] + head_bytes;
    kernels_internal::RunReduceManyLines(o + head_bytes, moved.data(), num_inputs, lines, dtype,
                                         op);
    const size_t done = head_bytes + lines * 64;
    for (int k = 0; k < num_inputs; ++k) moved[k] = in[k] + done;
    kernels_internal::RunReduceMany(o + done, moved.data(), num_inputs, tail, dtype, op);
    return absl::OkStatus();
  }
#endif
  kernels_internal::RunReduceMany(o, in, num_inputs, count, dtype, op);
  return absl::OkStatus();
}

absl::Status Scale(void* inout, size_t count, DType dtype, double factor) {
  if (!std::isfinite(factor)) {
    return absl::InvalidArgumentError(absl::StrCat("Scale: factor must be finite, got ", factor));
  }
  if (!DispatchDType(dtype, [](auto) {})) {
    return absl::InvalidArgumentError(
        absl::StrCat("Scale: invalid dtype ", static_cast<int>(dtype)));
  }
  if (count == 0) return absl::OkStatus();
  if (inout == nullptr) return NullError("Scale", "inout", count);
  auto* io = static_cast<std::byte*>(inout);
  // Integer division when factor is 1/n: avg of integers divides exactly as C++ does.
  const int64_t divisor = ExactDivisor(factor);
  kernels_internal::RunScale(io, count, dtype, factor, divisor);
  return absl::OkStatus();
}

int64_t ExactDivisor(double factor) {
  if (!(factor > 0)) return 0;
  const double reciprocal = 1.0 / factor;
  const double n = std::round(reciprocal);
  if (n >= 1 && n < 0x1p62 && std::fabs(reciprocal - n) <= 1e-9 * n) {
    return static_cast<int64_t>(n);
  }
  return 0;
}

void CopyStreaming(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  if (bytes >= kStreamingCopyMinBytes) {
    auto* d = static_cast<uint8_t*>(dst);
    auto* s = static_cast<const uint8_t*>(src);
    // Non-temporal stores need 16-byte aligned destinations: copy the head normally.
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    const size_t body = bytes & ~size_t{63};
    for (size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + body, s + body, bytes - body);
    // Non-temporal stores are weakly ordered: make them visible before whatever tells another
    // thread or process that the copy is done (a fin message, a completion flag).
    _mm_sfence();
    return;
  }
#endif
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace shardline
