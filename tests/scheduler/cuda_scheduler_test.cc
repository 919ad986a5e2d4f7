// The scheduler on a GPU: a one-rank NCCL world, the framework's compute on an asynchronous
// CUDA stream, every buffer in device memory. Three SGD steps over units of odd sizes, with the
// parameters each forward reads, the reduced gradients (clipped by their global norm on the
// device in two of the steps) and the updated master shards checked element by element against a
// host reference, in f32 and with bf16 parameters (f32 and bf16 reductions). The optimizer writes
// the master shards on the compute stream behind a long copy, so a gather that did not wait for
// it would read the previous step's values. The first step's cross-rank order check runs through
// device memory. With CPU offload the master shards and sharded gradients live in pinned host
// memory: the gather stream copies the master shard to the device after that optimizer write, and
// the reduced shard comes back to host memory. Skips without a GPU or without CUDA.

#include <gtest/gtest.h>

#ifdef SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/nccl/nccl_communicator.h"
#include "collectives/store/memory_store.h"
#include "runtime/cuda/cuda_stream.h"
#include "runtime/half.h"
#include "scheduler/scheduler.h"
#include "tests/common/cuda_device.h"

namespace shardline {
namespace {

float Hashed(uint32_t salt, size_t i) {
  uint64_t x = (uint64_t{salt} << 40 ^ i) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) /
         static_cast<float>(1 << 23);  // in [-1, 1)
}

// Page-locked host memory: the stream's copies to and from it are really asynchronous.
class Pinned {
 public:
  explicit Pinned(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) {
      EXPECT_EQ(cudaMallocHost(&data_, bytes), cudaSuccess);
    }
  }
  ~Pinned() {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Whether CUDA sees `p` as host memory (pinned or plain), not device or managed memory.
bool InHostMemory(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) return false;
  return attributes.type == cudaMemoryTypeHost || attributes.type == cudaMemoryTypeUnregistered;
}

// What the framework's kernels would read or write, as f32 values of the view's dtype.
float Load(DType dtype, const void* data, size_t i) {
  if (dtype == DType::kBF16) return Bf16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
  return static_cast<const float*>(data)[i];
}
void Store(DType dtype, void* data, size_t i, float v) {
  if (dtype == DType::kBF16) {
    static_cast<uint16_t*>(data)[i] = FloatToBf16Bits(v);
  } else {
    static_cast<float*>(data)[i] = v;
  }
}
// A value as the dtype holds it.
float Round(DType dtype, float v) {
  return dtype == DType::kBF16 ? Bf16BitsToFloat(FloatToBf16Bits(v)) : v;
}

struct Precision {
  DType param;
  DType reduce;
  bool offload = false;  // SchedulerOptions::cpu_offload
};

class CudaSchedulerTest : public ::testing::TestWithParam<Precision> {
 protected:
  void SetUp() override {
    if (const std::string why = ::shardline::testing::NoCudaDevice(); !why.empty()) {
      GTEST_SKIP() << why;
    }
  }
};

TEST_P(CudaSchedulerTest, TrainsOnAnAsynchronousComputeStream) {
  const Precision precision = GetParam();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<std::shared_ptr<Communicator>> world = CreateNcclCommunicator(
      {.store = std::make_shared<MemoryStore>(), .device = 0, .timeout = absl::Seconds(60)});
  ASSERT_TRUE(world.ok()) << world.status();
  absl::StatusOr<std::unique_ptr<Stream>> compute = CreateCudaStream(0, {.name = "compute"});
  ASSERT_TRUE(compute.ok()) << compute.status();
  const auto raw = static_cast<cudaStream_t>((*compute)->native_handle());
  absl::StatusOr<std::unique_ptr<Scheduler>> fsdp = Scheduler::Create(
      *world, **compute, {.name = "gpu", .budget_bytes = 1 << 20, .cpu_offload = precision.offload},
      deadline);
  ASSERT_TRUE(fsdp.ok()) << fsdp.status();

  // Four units of odd sizes; unit 1 holds two tensors.
  const std::vector<std::vector<std::vector<int64_t>>> shapes = {
      {{37, 5}}, {{129}, {3, 3, 3}}, {{1}}, {{61, 7}}};
  const size_t units = shapes.size();
  std::vector<std::vector<std::vector<float>>> master(units);  // the host reference, f32
  for (size_t u = 0; u < units; ++u) {
    UnitSpec spec{.name = absl::StrCat("unit", u)};
    spec.policy.precision = {.param_dtype = precision.param, .reduce_dtype = precision.reduce};
    std::vector<const void*> values;
    for (size_t t = 0; t < shapes[u].size(); ++t) {
      spec.tensors.push_back({.name = absl::StrCat("t", t), .shape = shapes[u][t]});
      size_t numel = 1;
      for (int64_t d : shapes[u][t]) numel *= static_cast<size_t>(d);
      master[u].emplace_back(numel);
      for (size_t i = 0; i < numel; ++i) master[u][t][i] = Hashed(100 + u * 10 + t, i);
    }
    for (const auto& tensor : master[u]) values.push_back(tensor.data());
    absl::StatusOr<int> id = (*fsdp)->RegisterUnit(std::move(spec));
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(*id, static_cast<int>(u));
    ASSERT_TRUE((*fsdp)->unit(*id).SetShardFromTensors(values).ok());
  }

  // Host staging, one block per tensor: what forward read, the gradient backward writes.
  const size_t esize = DTypeSize(precision.param);
  std::vector<std::vector<std::unique_ptr<Pinned>>> seen(units), grad(units);
  for (size_t u = 0; u < units; ++u) {
    for (const auto& tensor : master[u]) {
      seen[u].push_back(std::make_unique<Pinned>(tensor.size() * esize));
      grad[u].push_back(std::make_unique<Pinned>(tensor.size() * esize));
    }
  }
  // Keeps the compute stream busy before each optimizer write (a 256 MiB device copy).
  constexpr size_t kBusyBytes = size_t{256} << 20;
  void* busy = nullptr;
  ASSERT_EQ(cudaMalloc(&busy, 2 * kBusyBytes), cudaSuccess);
  std::vector<std::unique_ptr<Pinned>> written(units);

  constexpr float kLearningRate = 0.125f;
  for (int step = 0; step < 3; ++step) {
    for (size_t u = 0; u < units; ++u) {
      for (size_t t = 0; t < master[u].size(); ++t) {
        for (size_t i = 0; i < master[u][t].size(); ++i) {
          Store(precision.param, grad[u][t]->as<void>(), i,
                Hashed(1000 * (step + 1) + u * 10 + t, i));
        }
      }
    }
    for (size_t u = 0; u < units; ++u) {  // forward: the compute stream reads every parameter
      ASSERT_TRUE((*fsdp)->PreForward(static_cast<int>(u)).ok());
      for (size_t t = 0; t < master[u].size(); ++t) {
        absl::StatusOr<TensorView> view =
            (*fsdp)->unit(static_cast<int>(u)).View(absl::StrCat("t", t));
        ASSERT_TRUE(view.ok()) << view.status();
        ASSERT_EQ(view->dtype, precision.param);
        ASSERT_EQ(cudaMemcpyAsync(seen[u][t]->as<void>(), view->data, seen[u][t]->bytes(),
                                  cudaMemcpyDeviceToHost, raw),
                  cudaSuccess);
      }
      ASSERT_TRUE((*fsdp)->PostForward(static_cast<int>(u)).ok());
    }
    for (size_t u = units; u-- > 0;) {  // backward: the compute stream writes every gradient
      ASSERT_TRUE((*fsdp)->PreBackward(static_cast<int>(u)).ok());
      for (size_t t = 0; t < master[u].size(); ++t) {
        absl::StatusOr<TensorView> view =
            (*fsdp)->unit(static_cast<int>(u)).GradView(absl::StrCat("t", t));
        ASSERT_TRUE(view.ok()) << view.status();
        ASSERT_EQ(cudaMemcpyAsync(view->data, grad[u][t]->as<void>(), grad[u][t]->bytes(),
                                  cudaMemcpyHostToDevice, raw),
                  cudaSuccess);
      }
      ASSERT_TRUE((*fsdp)->PostBackward(static_cast<int>(u)).ok());
    }
    ASSERT_TRUE((*fsdp)->FinishBackward().ok());

    // Clipping by the global norm: steps 0 and 2 clip to half the norm, step 1 not at all. The
    // reference norm: the reduced gradients (one rank: the gradients through the reduce dtype).
    double squares = 0;
    for (size_t u = 0; u < units; ++u) {
      for (size_t t = 0; t < master[u].size(); ++t) {
        for (size_t i = 0; i < master[u][t].size(); ++i) {
          const double g =
              Round(precision.reduce, Load(precision.param, grad[u][t]->as<void>(), i));
          squares += g * g;
        }
      }
    }
    const double expected_norm = std::sqrt(squares);
    const double max_norm = step == 1 ? 1e9 : 0.5 * expected_norm;
    absl::StatusOr<double> norm = (*fsdp)->ClipGradNorm(max_norm, deadline);
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_NEAR(*norm, expected_norm, 1e-12 * expected_norm) << "step " << step;
    const double coef = max_norm / (*norm + 1e-6);
    const bool clipped = coef < 1.0;
    EXPECT_EQ(clipped, step != 1);
    ASSERT_EQ(cudaStreamSynchronize(raw), cudaSuccess);

    for (size_t u = 0; u < units; ++u) {
      FlatParameter& unit = (*fsdp)->unit(static_cast<int>(u));
      // What forward read: the master cast to the parameter dtype.
      for (size_t t = 0; t < master[u].size(); ++t) {
        size_t wrong = 0;
        for (size_t i = 0; i < master[u][t].size(); ++i) {
          wrong += Load(precision.param, seen[u][t]->as<void>(), i) !=
                   Round(precision.param, master[u][t][i]);
        }
        EXPECT_EQ(wrong, 0u) << "step " << step << " unit " << u << " tensor " << t
                             << ": forward read stale or wrong parameters";
      }
      // The reduced gradient (one rank: the gradient itself, through the reduce dtype) and the
      // optimizer on the host, written back on the compute stream behind the busy copy.
      absl::StatusOr<FlatShardView> shard_grad = unit.ShardGrad();
      ASSERT_TRUE(shard_grad.ok()) << shard_grad.status();
      const FlatShardView shard = unit.master_shard();
      ASSERT_EQ(shard_grad->dtype, DType::kF32);
      ASSERT_EQ(shard.dtype, DType::kF32);
      // Offloaded: both in host memory; otherwise both on the GPU.
      ASSERT_EQ(InHostMemory(shard.data), precision.offload) << "master shard of unit " << u;
      ASSERT_EQ(InHostMemory(shard_grad->data), precision.offload) << "gradient of unit " << u;
      std::vector<float> g(shard.elements), p(shard.elements);
      ASSERT_EQ(cudaMemcpy(g.data(), shard_grad->data, g.size() * 4, cudaMemcpyDefault),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(p.data(), shard.data, p.size() * 4, cudaMemcpyDefault), cudaSuccess);
      std::vector<bool> covered(shard.elements, false);
      for (size_t t = 0; t < master[u].size(); ++t) {
        const size_t offset = unit.layout().tensor(static_cast<int>(t)).offset;
        size_t wrong = 0;
        for (size_t i = 0; i < master[u][t].size(); ++i) {
          float expected_grad =
              Round(precision.reduce, Load(precision.param, grad[u][t]->as<void>(), i));
          // Scaled in f32 by the factor rounded to f32, as the kernels do.
          if (clipped) expected_grad *= static_cast<float>(coef);
          wrong += g[offset + i] != expected_grad || p[offset + i] != master[u][t][i];
          covered[offset + i] = true;
          master[u][t][i] -= kLearningRate * expected_grad;
          p[offset + i] = master[u][t][i];
        }
        EXPECT_EQ(wrong, 0u) << "step " << step << " unit " << u << " tensor " << t
                             << ": wrong sharded gradient or master shard";
      }
      for (size_t i = 0; i < shard.elements; ++i) {
        if (!covered[i]) {
          EXPECT_EQ(g[i], 0.0f) << "unit " << u << " padding element " << i;
        }
      }
      written[u] = std::make_unique<Pinned>(p.size() * 4);
      std::memcpy(written[u]->as<void>(), p.data(), p.size() * 4);
      ASSERT_EQ(cudaMemcpyAsync(static_cast<char*>(busy) + kBusyBytes, busy, kBusyBytes,
                                cudaMemcpyDeviceToDevice, raw),
                cudaSuccess);
      ASSERT_EQ(
          cudaMemcpyAsync(shard.data, written[u]->as<void>(), p.size() * 4, cudaMemcpyDefault, raw),
          cudaSuccess);
    }
    ASSERT_TRUE((*fsdp)->ZeroGrad().ok());
    absl::StatusOr<StepMetrics> metrics = (*fsdp)->LastStepMetrics(deadline);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_GT(metrics->bytes_gathered, 0) << metrics->ToString();
  }
  ASSERT_EQ(cudaStreamSynchronize(raw), cudaSuccess);
  fsdp->reset();
  EXPECT_EQ(cudaFree(busy), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaSchedulerTest,
                         ::testing::Values(Precision{DType::kF32, DType::kF32},
                                           Precision{DType::kBF16, DType::kF32},
                                           Precision{DType::kBF16, DType::kBF16},
                                           Precision{DType::kF32, DType::kF32, true},
                                           Precision{DType::kBF16, DType::kF32, true}),
                         [](const ::testing::TestParamInfo<Precision>& info) {
                           return absl::StrCat("param_", DTypeName(info.param.param), "_reduce_",
                                               DTypeName(info.param.reduce),
                                               info.param.offload ? "_cpu_offload" : "");
                         });

}  // namespace
}  // namespace shardline

#else  // !SHARDLINE_WITH_CUDA

TEST(CudaSchedulerTest, NeedsCuda) {
  GTEST_SKIP() << "CUDA is not compiled in (SHARDLINE_WITH_CUDA=OFF)";
}

#endif  // SHARDLINE_WITH_CUDA
