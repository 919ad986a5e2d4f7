// Tests of runtime/cuda/cuda_kernels.h: the device kernels must match the host kernels of
// runtime/host_kernels.h bit for bit (host_kernels_test checks those against an independent
// reference). Needs a CUDA device; skips, saying why, when there is none or when shardline was
// built without CUDA.

#include "gtest/gtest.h"

#if defined(SHARDLINE_WITH_CUDA)

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/host_kernels.h"
#include "runtime/shard_norms.h"

namespace shardline {
namespace {

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount failed: " << cudaGetErrorString(e);
    }
    if (n == 0) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned 0";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device copy of `bytes` at element offset `offset_bytes` into a fresh allocation (so the
  // kernel sees a pointer that is, or is not, 16-byte aligned).
  struct DeviceBuffer {
    DeviceBuffer() = default;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void* base = nullptr;
    std::byte* data = nullptr;
    ~DeviceBuffer() {
      if (base != nullptr) cudaFree(base);
    }
  };
  void Upload(DeviceBuffer& d, const std::vector<std::byte>& host, size_t offset_bytes) {
    ASSERT_EQ(cudaMalloc(&d.base, host.size() + offset_bytes + 16), cudaSuccess);
    d.data = static_cast<std::byte*>(d.base) + offset_bytes;
    if (!host.empty()) {
      ASSERT_EQ(cudaMemcpy(d.data, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<std::byte> Download(const DeviceBuffer& d, size_t bytes) {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<std::byte> out(bytes);
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), d.data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }

  cudaStream_t stream_ = nullptr;
};

// Random bytes are valid values of every dtype (16-bit floats include NaN patterns; the kernels
// must agree on those too, since both quiet NaNs the same way). Floats are kept finite so that
// min/max NaN behaviour, which is operand-order dependent, does not enter.
std::vector<std::byte> RandomValues(size_t count, DType dtype, std::mt19937_64& rng) {
  std::vector<std::byte> v(count * DTypeSize(dtype));
  std::uniform_real_distribution<float> real(-100, 100);
  for (size_t i = 0; i < count; ++i) {
    const float x = real(rng);
    const uint64_t r = rng();
    std::byte* p = v.data() + i * DTypeSize(dtype);
    if (IsFloatingPoint(dtype)) {
      EXPECT_TRUE(Cast(&x, DType::kF32, p, dtype, 1).ok());
    } else {
      std::memcpy(p, &r, DTypeSize(dtype));
    }
  }
  return v;
}

const size_t kCounts[] = {0, 1, 7, 4097, 100003};

TEST_F(CudaKernelsTest, ReduceManyMatchesHost) {
  std::mt19937_64 rng(1);
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllReduceOps) {
      for (size_t count : kCounts) {
        for (int k : {1, 2, 5}) {
          for (size_t misalign : {size_t{0}, DTypeSize(dtype)}) {
            SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " count=", count,
                                      " k=", k, " misalign=", misalign));
            const size_t bytes = count * DTypeSize(dtype);
            std::vector<std::vector<std::byte>> host;
            std::vector<DeviceBuffer> dev(k);
            std::vector<const void*> host_ptrs, dev_ptrs;
            for (int j = 0; j < k; ++j) {
              host.push_back(RandomValues(count, dtype, rng));
              Upload(dev[j], host.back(), j == 0 ? misalign : 0);
            }
            for (int j = 0; j < k; ++j) {
              host_ptrs.push_back(host[j].data());
              dev_ptrs.push_back(dev[j].data);
            }
            std::vector<std::byte> want(bytes);
            ASSERT_TRUE(ReduceMany(want.data(), host_ptrs.data(), k, count, dtype, op).ok());
            DeviceBuffer out;
            Upload(out, std::vector<std::byte>(bytes), misalign);
            ASSERT_TRUE(
                CudaReduceMany(out.data, dev_ptrs.data(), k, count, dtype, op, stream_).ok());
            ASSERT_EQ(Download(out, bytes), want);
            if (k == 2) {  // CudaReduce in place
              ASSERT_TRUE(CudaReduce(dev[0].data, dev[1].data, count, dtype, op, stream_).ok());
              ASSERT_EQ(Download(dev[0], bytes), want);
            }
          }
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, CastMatchesHost) {
  std::mt19937_64 rng(2);
  const DType kFloats[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};
  for (DType from : kFloats) {
    for (DType to : kFloats) {
      for (size_t count : kCounts) {
        for (size_t misalign : {size_t{0}, DTypeSize(from)}) {
          SCOPED_TRACE(absl::StrCat(DTypeName(from), "->", DTypeName(to), " count=", count));
          // Raw random bits: every pattern class (NaN, Inf, subnormal) shows up.
          std::vector<std::byte> src(count * DTypeSize(from));
          for (auto& b : src) b = static_cast<std::byte>(rng());
          std::vector<std::byte> want(count * DTypeSize(to));
          ASSERT_TRUE(Cast(src.data(), from, want.data(), to, count).ok());
          DeviceBuffer dsrc, ddst;
          Upload(dsrc, src, misalign);
          Upload(ddst, std::vector<std::byte>(want.size()), 0);
          ASSERT_TRUE(CudaCast(dsrc.data, from, ddst.data, to, count, stream_).ok());
          ASSERT_EQ(Download(ddst, want.size()), want);
        }
      }
    }
  }
  // Every 16-bit pattern through every float type.
  std::vector<std::byte> all(2 * 65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t v = static_cast<uint16_t>(b);
    std::memcpy(all.data() + 2 * b, &v, 2);
  }
  for (DType from : {DType::kF16, DType::kBF16}) {
    for (DType to : kFloats) {
      std::vector<std::byte> want(65536 * DTypeSize(to));
      ASSERT_TRUE(Cast(all.data(), from, want.data(), to, 65536).ok());
      DeviceBuffer dsrc, ddst;
      Upload(dsrc, all, 0);
      Upload(ddst, std::vector<std::byte>(want.size()), 0);
      ASSERT_TRUE(CudaCast(dsrc.data, from, ddst.data, to, 65536, stream_).ok());
      ASSERT_EQ(Download(ddst, want.size()), want) << DTypeName(from) << "->" << DTypeName(to);
    }
  }
}

TEST_F(CudaKernelsTest, ScaleMatchesHost) {
  std::mt19937_64 rng(3);
  for (DType dtype : kAllDTypes) {
    for (double factor : {1.0 / 3, 0.125, 2.5, -0.5}) {
      for (size_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " factor=", factor, " count=", count));
        std::vector<std::byte> data = RandomValues(count, dtype, rng);
        if (dtype == DType::kI64) {
          for (size_t i = 0; i < count; ++i) {
            int64_t v;
            std::memcpy(&v, data.data() + 8 * i, 8);
            v >>= 20;
            std::memcpy(data.data() + 8 * i, &v, 8);
          }
        }
        DeviceBuffer d;
        Upload(d, data, 0);
        ASSERT_TRUE(Scale(data.data(), count, dtype, factor).ok());
        ASSERT_TRUE(CudaScale(d.data, count, dtype, factor, stream_).ok());
        ASSERT_EQ(Download(d, data.size()), data);
      }
    }
  }
}

// The device sum of squares against the host's double loop (same values; the device's tree
// order differs only in the last bits), accumulating into sums[0], and the same bits when run
// twice.
TEST_F(CudaKernelsTest, SumSquaresMatchesHost) {
  std::mt19937_64 rng(4);
  double* sums = nullptr;
  ASSERT_EQ(cudaMalloc(&sums, kCudaSumSquaresDoubles * sizeof(double)), cudaSuccess);
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16}) {
    for (size_t count : kCounts) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " count=", count));
      std::vector<std::byte> data = RandomValues(count, dtype, rng);
      absl::StatusOr<double> expected = SumOfSquares(data.data(), count, dtype);
      ASSERT_TRUE(expected.ok()) << expected.status();
      DeviceBuffer d;
      Upload(d, data, 0);
      double runs[2];
      for (double& run : runs) {
        const double start = 0.5;
        ASSERT_EQ(cudaMemcpy(sums, &start, sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_TRUE(CudaSumSquares(d.data, count, dtype, sums, stream_).ok());
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(&run, sums, sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
      }
      EXPECT_NEAR(runs[0], 0.5 + *expected, 1e-12 * (0.5 + *expected));
      EXPECT_EQ(runs[0], runs[1]) << "not deterministic";
    }
  }
  EXPECT_EQ(CudaSumSquares(sums, 1, DType::kI32, sums, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  cudaFree(sums);
}

TEST_F(CudaKernelsTest, RejectsBadArguments) {
  DeviceBuffer d;
  Upload(d, std::vector<std::byte>(64), 1);  // misaligned for f32
  EXPECT_EQ(CudaReduce(d.data, d.data, 4, DType::kF32, ReduceOp::kSum, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaCast(d.data, DType::kI32, d.data, DType::kF32, 1, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<const void*> many(kCudaMaxReduceInputs + 1, d.base);
  EXPECT_EQ(CudaReduceMany(d.base, many.data(), static_cast<int>(many.size()), 1, DType::kU8,
                           ReduceOp::kSum, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardline

#else  // !SHARDLINE_WITH_CUDA

TEST(CudaKernelsTest, NotCompiledIn) {
  GTEST_SKIP() << "shardline was built without CUDA (SHARDLINE_WITH_CUDA is off)";
}

#endif  // SHARDLINE_WITH_CUDA
