// Microbenchmarks of the host element-wise kernels (runtime/host_kernels.h) against memcpy.
//
// The argument is the size in bytes of one source buffer (64 KiB ... 64 MiB). Throughput
// (bytes_per_second) counts every byte read plus every byte written by one call:
//   memcpy          n read + n written                 = 2n
//   Reduce          inout read + in read + inout write = 3n
//   ReduceMany      k inputs read + n written          = (k + 1)n (second argument: k), into a
//                   separate output; ReduceManyStreaming the same with non-temporal stores
//   Cast a -> b     n read + n * size(b)/size(a) written
// so the numbers compare directly with a memory-bandwidth figure (memcpy being the ceiling).
//
//   ./kernels_bench --benchmark_filter=Reduce

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "runtime/dtype.h"
#include "runtime/host_kernels.h"

namespace shardline {
namespace {

// Buffers filled with small finite values (bf16/f16 bit patterns of ~1.0) so that no denormal or
// NaN slow path distorts the timing.
std::vector<std::byte> Filled(size_t bytes, DType dtype) {
  std::vector<std::byte> v(bytes);
  const size_t count = bytes / DTypeSize(dtype);
  std::vector<float> ones(count, 1.0f);
  if (dtype == DType::kF32) {
    std::memcpy(v.data(), ones.data(), count * 4);
  } else {
    benchmark::DoNotOptimize(Cast(ones.data(), DType::kF32, v.data(), dtype, count));
  }
  return v;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<std::byte> src = Filled(bytes, DType::kF32), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
}

// What the ucx backend copies received blocks with (non-temporal stores from 256 KiB on).
void BM_CopyStreaming(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<std::byte> src = Filled(bytes, DType::kF32), dst(bytes);
  for (auto _ : state) {
    CopyStreaming(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
}

void BM_Reduce(benchmark::State& state, DType dtype) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / DTypeSize(dtype);
  std::vector<std::byte> a = Filled(bytes, dtype), b = Filled(bytes, dtype);
  for (auto _ : state) {
    // x + 1 repeatedly stays finite and normal over any benchmark's iteration count in f32;
    // in bf16 it saturates at 256 (x + 1 rounds back to x), still a normal number.
    const absl::Status s = Reduce(a.data(), b.data(), count, dtype, ReduceOp::kSum);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * bytes);
}

// A reduce-scatter's reduction: k inputs of `bytes` into a separate output, f32 sum.
void BM_ReduceMany(benchmark::State& state, bool streaming) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const int k = static_cast<int>(state.range(1));
  const size_t count = bytes / 4;
  std::vector<std::vector<std::byte>> in;
  std::vector<const void*> ptrs;
  for (int j = 0; j < k; ++j) in.push_back(Filled(bytes, DType::kF32));
  for (const auto& v : in) ptrs.push_back(v.data());
  std::vector<std::byte> out(bytes);
  for (auto _ : state) {
    const absl::Status s =
        streaming
            ? ReduceManyStreaming(out.data(), ptrs.data(), k, count, DType::kF32, ReduceOp::kSum)
            : ReduceMany(out.data(), ptrs.data(), k, count, DType::kF32, ReduceOp::kSum);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * (k + 1) * bytes);
}

void BM_Cast(benchmark::State& state, DType from, DType to) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / DTypeSize(from);
  std::vector<std::byte> src = Filled(bytes, from), dst(count * DTypeSize(to));
  for (auto _ : state) {
    const absl::Status s = Cast(src.data(), from, dst.data(), to, count);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(bytes + dst.size()));
}

void Sizes(benchmark::internal::Benchmark* b) {
  for (int64_t size : {int64_t{64} << 10, int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20}) {
    b->Arg(size);
  }
}

BENCHMARK(BM_Memcpy)->Apply(Sizes);
BENCHMARK(BM_CopyStreaming)->Apply(Sizes);
BENCHMARK_CAPTURE(BM_Reduce, f32_sum, DType::kF32)->Apply(Sizes);
BENCHMARK_CAPTURE(BM_Reduce, bf16_sum, DType::kBF16)->Apply(Sizes);
BENCHMARK_CAPTURE(BM_ReduceMany, plain, false)
    ->ArgsProduct({{int64_t{1} << 20, int64_t{16} << 20}, {2, 4}});
BENCHMARK_CAPTURE(BM_ReduceMany, streaming, true)
    ->ArgsProduct({{int64_t{1} << 20, int64_t{16} << 20}, {2, 4}});
BENCHMARK_CAPTURE(BM_Cast, f32_to_bf16, DType::kF32, DType::kBF16)->Apply(Sizes);
BENCHMARK_CAPTURE(BM_Cast, bf16_to_f32, DType::kBF16, DType::kF32)->Apply(Sizes);

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
