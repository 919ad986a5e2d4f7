// The CUDA element-wise kernels behind cuda_kernels.h. Deliberately free of abseil (see
// cuda_kernels_launch.h): arguments arrive validated, errors leave as cudaError_t values.
//
// Every kernel is a grid-stride loop over "packs" of N elements (one 16-byte vector load per
// operand when every pointer is aligned for it, N = 1 otherwise), then a scalar tail. Rounding
// goes through runtime/half.h, exactly as on the host.

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "runtime/cuda/cuda_kernels_launch.h"
#include "runtime/half.h"

namespace shardline::cuda_internal {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times over; the grid-stride loops cover the rest.
constexpr size_t kMaxBlocks = 4096;

int Blocks(size_t work) {
  const size_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? (blocks == 0 ? 1 : blocks) : kMaxBlocks);
}

template <int D>
struct Elem;
template <typename T>
struct SameElem {
  using S = T;
  using C = T;
  SL_HOST_DEVICE static C ToC(S s) { return s; }
  SL_HOST_DEVICE static S FromC(C c) { return c; }
};
template <>
struct Elem<kKF32> : SameElem<float> {};
template <>
struct Elem<kKF64> : SameElem<double> {};
template <>
struct Elem<kKI8> : SameElem<int8_t> {};
template <>
struct Elem<kKU8> : SameElem<uint8_t> {};
template <>
struct Elem<kKI32> : SameElem<int32_t> {};
template <>
struct Elem<kKI64> : SameElem<int64_t> {};
template <>
struct Elem<kKF16> {
  using S = uint16_t;
  using C = float;
  SL_HOST_DEVICE static C ToC(S s) { return HalfBitsToFloat(s); }
  SL_HOST_DEVICE static S FromC(C c) { return FloatToHalfBits(c); }
};
template <>
struct Elem<kKBF16> {
  using S = uint16_t;
  using C = float;
  SL_HOST_DEVICE static C ToC(S s) { return Bf16BitsToFloat(s); }
  SL_HOST_DEVICE static S FromC(C c) { return FloatToBf16Bits(c); }
};

template <typename C>
struct IsIntegral {
  static constexpr bool value = false;
};
template <>
struct IsIntegral<int8_t> {
  static constexpr bool value = true;
  using U = uint8_t;
  static constexpr int8_t kMin = -128;
  static constexpr int8_t kMax = 127;
};
template <>
struct IsIntegral<uint8_t> {
  static constexpr bool value = true;
  using U = uint8_t;
  static constexpr uint8_t kMin = 0;
  static constexpr uint8_t kMax = 255;
};
template <>
struct IsIntegral<int32_t> {
  static constexpr bool value = true;
  using U = uint32_t;
  static constexpr int32_t kMin = INT32_MIN;
  static constexpr int32_t kMax = INT32_MAX;
};
template <>
struct IsIntegral<int64_t> {
  static constexpr bool value = true;
  using U = uint64_t;
  static constexpr int64_t kMin = INT64_MIN;
  static constexpr int64_t kMax = INT64_MAX;
};

struct SumOp {
  template <typename C>
  __device__ static C Apply(C a, C b) {
    if constexpr (IsIntegral<C>::value) {
      using U = typename IsIntegral<C>::U;
      return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};
struct ProductOp {
  template <typename C>
  __device__ static C Apply(C a, C b) {
    if constexpr (IsIntegral<C>::value) {
      // Modulo 2^bits; unsigned types narrower than int would promote to (signed) int.
      using U = typename IsIntegral<C>::U;
      using W = decltype(U{} * 1u);
      return static_cast<C>(static_cast<U>(static_cast<W>(a) * static_cast<W>(b)));
    } else {
      return a * b;
    }
  }
};
struct MinOp {
  template <typename C>
  __device__ static C Apply(C a, C b) {
    return a < b ? a : b;
  }
};
struct MaxOp {
  template <typename C>
  __device__ static C Apply(C a, C b) {
    return a > b ? a : b;
  }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N>
bool Aligned(const void* p, size_t elem_size) {
  return reinterpret_cast<uintptr_t>(p) % (elem_size * N) == 0;
}

// ---- Cast ------------------------------------------------------------------------------------

template <int Src, int Dst>
__device__ typename Elem<Dst>::S ConvertOne(typename Elem<Src>::S v) {
  if constexpr (Src == kKF64) {
    if constexpr (Dst == kKF32) return static_cast<float>(v);
    if constexpr (Dst == kKF16) return DoubleToHalfBits(v);
    if constexpr (Dst == kKBF16) return DoubleToBf16Bits(v);
  } else {
    const float x = Elem<Src>::ToC(v);
    if constexpr (Dst == kKF64) {
      return static_cast<double>(x);
    } else {
      return Elem<Dst>::FromC(x);
    }
  }
}

template <int Src, int Dst, int N>
__global__ void CastKernel(const typename Elem<Src>::S* __restrict__ src,
                           typename Elem<Dst>::S* __restrict__ dst, size_t count) {
  using SS = typename Elem<Src>::S;
  using DS = typename Elem<Dst>::S;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t packs = count / N;
  for (size_t p = tid; p < packs; p += stride) {
    const Pack<SS, N> in = reinterpret_cast<const Pack<SS, N>*>(src)[p];
    Pack<DS, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = ConvertOne<Src, Dst>(in.v[j]);
    reinterpret_cast<Pack<DS, N>*>(dst)[p] = out;
  }
  for (size_t i = packs * N + tid; i < count; i += stride) dst[i] = ConvertOne<Src, Dst>(src[i]);
}

template <int Src, int Dst>
int CastTyped(const void* src, void* dst, size_t count, cudaStream_t stream) {
  using SS = typename Elem<Src>::S;
  using DS = typename Elem<Dst>::S;
  constexpr int kN = 16 / (sizeof(SS) > sizeof(DS) ? sizeof(SS) : sizeof(DS));
  const auto* s = static_cast<const SS*>(src);
  auto* d = static_cast<DS*>(dst);
  if (Aligned<kN>(src, sizeof(SS)) && Aligned<kN>(dst, sizeof(DS))) {
    CastKernel<Src, Dst, kN><<<Blocks(count / kN), kThreads, 0, stream>>>(s, d, count);
  } else {
    CastKernel<Src, Dst, 1><<<Blocks(count), kThreads, 0, stream>>>(s, d, count);
  }
  return static_cast<int>(cudaGetLastError());
}

template <int Src>
int CastFrom(const void* src, void* dst, int dst_dtype, size_t count, cudaStream_t stream) {
  switch (dst_dtype) {
    case kKF32:
      if constexpr (Src != kKF32) return CastTyped<Src, kKF32>(src, dst, count, stream);
      break;
    case kKF64:
      if constexpr (Src != kKF64) return CastTyped<Src, kKF64>(src, dst, count, stream);
      break;
    case kKF16:
      if constexpr (Src != kKF16) return CastTyped<Src, kKF16>(src, dst, count, stream);
      break;
    case kKBF16:
      if constexpr (Src != kKBF16) return CastTyped<Src, kKBF16>(src, dst, count, stream);
      break;
    default:
      break;
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// ---- ReduceMany ------------------------------------------------------------------------------

struct InputPtrs {
  const void* p[kMaxReduceInputs];
};

template <int D, typename Op, int N>
__global__ void ReduceManyKernel(typename Elem<D>::S* out, InputPtrs inputs, int num_inputs,
                                 size_t count) {
  using E = Elem<D>;
  using S = typename E::S;
  using C = typename E::C;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t packs = count / N;
  for (size_t p = tid; p < packs; p += stride) {
    C acc[N];
    const Pack<S, N> first = static_cast<const Pack<S, N>*>(inputs.p[0])[p];
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] = E::ToC(first.v[j]);
    for (int k = 1; k < num_inputs; ++k) {
      const Pack<S, N> in = static_cast<const Pack<S, N>*>(inputs.p[k])[p];
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] = Op::Apply(acc[j], E::ToC(in.v[j]));
    }
    Pack<S, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = E::FromC(acc[j]);
    reinterpret_cast<Pack<S, N>*>(out)[p] = o;
  }
  for (size_t i = packs * N + tid; i < count; i += stride) {
    C acc = E::ToC(static_cast<const S*>(inputs.p[0])[i]);
    for (int k = 1; k < num_inputs; ++k) {
      acc = Op::Apply(acc, E::ToC(static_cast<const S*>(inputs.p[k])[i]));
    }
    out[i] = E::FromC(acc);
  }
}

template <int D, typename Op>
int ReduceManyTyped(void* out, const void* const* inputs, int num_inputs, size_t count,
                    cudaStream_t stream) {
  using S = typename Elem<D>::S;
  constexpr int kN = 16 / sizeof(S);
  InputPtrs ptrs{};
  bool aligned = Aligned<kN>(out, sizeof(S));
  for (int k = 0; k < num_inputs; ++k) {
    ptrs.p[k] = inputs[k];
    aligned = aligned && Aligned<kN>(inputs[k], sizeof(S));
  }
  auto* o = static_cast<S*>(out);
  if (aligned) {
    ReduceManyKernel<D, Op, kN>
        <<<Blocks(count / kN), kThreads, 0, stream>>>(o, ptrs, num_inputs, count);
  } else {
    ReduceManyKernel<D, Op, 1><<<Blocks(count), kThreads, 0, stream>>>(o, ptrs, num_inputs, count);
  }
  return static_cast<int>(cudaGetLastError());
}

template <int D>
int ReduceManyOp(void* out, const void* const* inputs, int num_inputs, size_t count, int op,
                 cudaStream_t stream) {
  switch (op) {
    case kKSum:
    case kKAvg:
      return ReduceManyTyped<D, SumOp>(out, inputs, num_inputs, count, stream);
    case kKMin:
      return ReduceManyTyped<D, MinOp>(out, inputs, num_inputs, count, stream);
    case kKMax:
      return ReduceManyTyped<D, MaxOp>(out, inputs, num_inputs, count, stream);
    case kKProduct:
      return ReduceManyTyped<D, ProductOp>(out, inputs, num_inputs, count, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

// ---- Scale -----------------------------------------------------------------------------------

template <int D>
__global__ void ScaleKernel(typename Elem<D>::S* data, size_t count, double factor,
                            int64_t divisor) {
  using E = Elem<D>;
  using S = typename E::S;
  using C = typename E::C;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  if constexpr (!IsIntegral<C>::value) {
    const C f = static_cast<C>(factor);
    for (size_t i = tid; i < count; i += stride) data[i] = E::FromC(E::ToC(data[i]) * f);
  } else {
    // Saturation bounds as doubles: for 64-bit types kMax rounds up to 2^63, and anything at or
    // above it saturates, as on the host.
    constexpr double kLo = static_cast<double>(IsIntegral<C>::kMin);
    constexpr double kHi = static_cast<double>(IsIntegral<C>::kMax);
    for (size_t i = tid; i < count; i += stride) {
      const S v = data[i];
      if (divisor > 0) {
        data[i] = static_cast<S>(static_cast<int64_t>(v) / divisor);
      } else {
        const double p = trunc(static_cast<double>(v) * factor);
        data[i] =
            p <= kLo ? IsIntegral<C>::kMin : (p >= kHi ? IsIntegral<C>::kMax : static_cast<S>(p));
      }
    }
  }
}

template <int D>
int ScaleTyped(void* inout, size_t count, double factor, int64_t divisor, cudaStream_t stream) {
  using S = typename Elem<D>::S;
  ScaleKernel<D>
      <<<Blocks(count), kThreads, 0, stream>>>(static_cast<S*>(inout), count, factor, divisor);
  return static_cast<int>(cudaGetLastError());
}

// ---- Sum of squares ----------------------------------------------------------------------------

// Tree sum of blockDim.x (a power of two) values in shared memory; thread 0 gets the total.
__device__ double BlockSum(double* shared, double mine) {
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  return shared[0];
}

template <int D>
__global__ void SumSquaresPartialKernel(const typename Elem<D>::S* data, size_t count,
                                        double* partials) {
  using E = Elem<D>;
  __shared__ double shared[kThreads];
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  double mine = 0.0;
  for (size_t i = tid; i < count; i += stride) {
    const double x = static_cast<double>(E::ToC(data[i]));
    mine += x * x;
  }
  const double total = BlockSum(shared, mine);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void SumSquaresFinishKernel(double* sums) {
  __shared__ double shared[kSumSquaresBlocks];
  const double total = BlockSum(shared, sums[1 + threadIdx.x]);
  if (threadIdx.x == 0) sums[0] += total;
}

template <int D>
int SumSquaresTyped(const void* data, size_t count, double* sums, cudaStream_t stream) {
  using S = typename Elem<D>::S;
  SumSquaresPartialKernel<D>
      <<<kSumSquaresBlocks, kThreads, 0, stream>>>(static_cast<const S*>(data), count, sums + 1);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  SumSquaresFinishKernel<<<1, kSumSquaresBlocks, 0, stream>>>(sums);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchSumSquares(const void* data, size_t count, int dtype, double* sums, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kKF32:
      return SumSquaresTyped<kKF32>(data, count, sums, s);
    case kKF64:
      return SumSquaresTyped<kKF64>(data, count, sums, s);
    case kKF16:
      return SumSquaresTyped<kKF16>(data, count, sums, s);
    case kKBF16:
      return SumSquaresTyped<kKBF16>(data, count, sums, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int LaunchCast(const void* src, int src_dtype, void* dst, int dst_dtype, size_t count,
               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (src_dtype) {
    case kKF32:
      return CastFrom<kKF32>(src, dst, dst_dtype, count, s);
    case kKF64:
      return CastFrom<kKF64>(src, dst, dst_dtype, count, s);
    case kKF16:
      return CastFrom<kKF16>(src, dst, dst_dtype, count, s);
    case kKBF16:
      return CastFrom<kKBF16>(src, dst, dst_dtype, count, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int LaunchReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count, int dtype,
                     int op, void* stream) {
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kKF32:
      return ReduceManyOp<kKF32>(out, inputs, num_inputs, count, op, s);
    case kKF64:
      return ReduceManyOp<kKF64>(out, inputs, num_inputs, count, op, s);
    case kKF16:
      return ReduceManyOp<kKF16>(out, inputs, num_inputs, count, op, s);
    case kKBF16:
      return ReduceManyOp<kKBF16>(out, inputs, num_inputs, count, op, s);
    case kKI8:
      return ReduceManyOp<kKI8>(out, inputs, num_inputs, count, op, s);
    case kKU8:
      return ReduceManyOp<kKU8>(out, inputs, num_inputs, count, op, s);
    case kKI32:
      return ReduceManyOp<kKI32>(out, inputs, num_inputs, count, op, s);
    case kKI64:
      return ReduceManyOp<kKI64>(out, inputs, num_inputs, count, op, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int LaunchScale(void* inout, size_t count, int dtype, double factor, int64_t divisor,
                void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kKF32:
      return ScaleTyped<kKF32>(inout, count, factor, divisor, s);
    case kKF64:
      return ScaleTyped<kKF64>(inout, count, factor, divisor, s);
    case kKF16:
      return ScaleTyped<kKF16>(inout, count, factor, divisor, s);
    case kKBF16:
      return ScaleTyped<kKBF16>(inout, count, factor, divisor, s);
    case kKI8:
      return ScaleTyped<kKI8>(inout, count, factor, divisor, s);
    case kKU8:
      return ScaleTyped<kKU8>(inout, count, factor, divisor, s);
    case kKI32:
      return ScaleTyped<kKI32>(inout, count, factor, divisor, s);
    case kKI64:
      return ScaleTyped<kKI64>(inout, count, factor, divisor, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace shardline::cuda_internal
