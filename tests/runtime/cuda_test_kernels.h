// File: tests/runtime/cuda_test_kernels.h
// -----------------------------------------------------------------------------
// Device work for the CUDA stream tests that stays in flight until the test releases it: a
// stand-in for a long kernel whose end the test controls, instead of a kernel tuned to run for
// "long enough". CUDA test builds only (tests/runtime/cuda_test_kernels.cu).

#ifndef SHARDLINE_TESTS_RUNTIME_CUDA_TEST_KERNELS_H_
#define SHARDLINE_TESTS_RUNTIME_CUDA_TEST_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace shardline::testing {

// Enqueues on `stream` one block that spins until *flag is non-zero (or `timeout_ns` of device
// time passed, so that a failing test cannot leave the GPU busy), then writes out[i] =
// SpinFillValue(i) for every i < count. `flag` must be device-mapped host memory (its device
// pointer, from cudaHostGetDevicePointer); `out` device memory. Returns cudaGetLastError().
cudaError_t LaunchSpinThenFill(const uint32_t* flag, uint64_t timeout_ns, uint32_t* out,
                               size_t count, cudaStream_t stream);

#ifdef __CUDACC__
#define SL_TEST_HOST_DEVICE __host__ __device__
#else
#define SL_TEST_HOST_DEVICE
#endif

// The value LaunchSpinThenFill writes at index i (a hash, so a misplaced element shows).
SL_TEST_HOST_DEVICE inline uint32_t SpinFillValue(size_t i) {
  uint64_t x = (static_cast<uint64_t>(i) + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  return static_cast<uint32_t>(x ^ (x >> 31));
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_CUDA_TEST_KERNELS_H_
