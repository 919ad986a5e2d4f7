// Why a GPU test cannot run here: the text a test skips with when there is no usable CUDA device,
// or empty when cuda:0 exists. Include only in CUDA builds (SHARDLINE_WITH_CUDA).
#ifndef SHARDLINE_TESTS_COMMON_CUDA_DEVICE_H_
#define SHARDLINE_TESTS_COMMON_CUDA_DEVICE_H_

#include <cuda_runtime.h>

#include <string>

namespace shardline::testing {

inline std::string NoCudaDevice() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device: cudaGetDeviceCount failed with ") + cudaGetErrorName(error);
  }
  if (count == 0) return "no CUDA device: cudaGetDeviceCount returned 0";
  return "";
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_CUDA_DEVICE_H_
