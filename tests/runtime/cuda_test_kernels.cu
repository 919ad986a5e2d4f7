// The spin-then-fill kernel of tests/runtime/cuda_test_kernels.h.

#include "tests/runtime/cuda_test_kernels.h"

namespace shardline::testing {
namespace {

__device__ uint64_t GlobalTimerNs() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void SpinThenFillKernel(const volatile uint32_t* flag, uint64_t timeout_ns,
                                   uint32_t* out, size_t count) {
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    while (*flag == 0 && GlobalTimerNs() - start < timeout_ns) __nanosleep(1000);
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = SpinFillValue(i);
}

}  // namespace

cudaError_t LaunchSpinThenFill(const uint32_t* flag, uint64_t timeout_ns, uint32_t* out,
                               size_t count, cudaStream_t stream) {
  SpinThenFillKernel<<<1, 256, 0, stream>>>(flag, timeout_ns, out, count);
  return cudaGetLastError();
}

}  // namespace shardline::testing
