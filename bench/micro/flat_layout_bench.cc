// Microbenchmarks of FlatLayout and the reshard plan: building a 10,000-tensor layout (once per
// unit at startup), and the per-step view lookups (every step, so they must cost nanoseconds to
// microseconds), plus serialisation, resharding and the per-shard norm.
//
//   flat_layout_bench --benchmark_filter=View

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "runtime/check.h"
#include "runtime/flat_layout.h"
#include "runtime/reshard_plan.h"
#include "runtime/shard_norms.h"

namespace shardline {
namespace {

// A transformer-like parameter list: per block, 4 weight matrices, their biases and two norms;
// one tied embedding. Shapes are scaled by `width` (elements stay small enough for the norm
// benchmark to fit in memory comfortably).
std::vector<TensorSpec> ModelSpecs(int num_tensors, int64_t width) {
  std::vector<TensorSpec> specs;
  specs.push_back({"embed", {4 * width, width}, DType::kBF16});
  int block = 0;
  while (static_cast<int>(specs.size()) < num_tensors - 1) {
    const std::string p = absl::StrCat("blocks.", block++, ".");
    const TensorSpec block_specs[] = {
        {p + "attn.qkv.weight", {3 * width, width}, DType::kBF16},
        {p + "attn.qkv.bias", {3 * width}, DType::kBF16},
        {p + "attn.out.weight", {width, width}, DType::kBF16},
        {p + "attn.out.bias", {width}, DType::kBF16},
        {p + "ln1.weight", {width}, DType::kF32},
        {p + "mlp.up.weight", {4 * width, width}, DType::kBF16},
        {p + "mlp.up.bias", {4 * width}, DType::kBF16},
        {p + "mlp.down.weight", {width, 4 * width}, DType::kBF16},
        {p + "mlp.down.bias", {width}, DType::kBF16},
        {p + "ln2.weight", {width}, DType::kF32},
    };
    for (const TensorSpec& s : block_specs) {
      if (static_cast<int>(specs.size()) == num_tensors - 1) break;
      specs.push_back(s);
    }
  }
  specs.push_back({"lm_head", {4 * width, width}, DType::kBF16, "embed"});
  return specs;
}

FlatLayout MakeLayout(int num_tensors, int shards, int64_t width = 16) {
  absl::StatusOr<FlatLayout> layout =
      FlatLayout::Create(ModelSpecs(num_tensors, width), {.num_shards = shards});
  SL_CHECK_OK(layout.status());
  return *std::move(layout);
}

void BM_CreateLayout(benchmark::State& state) {
  const std::vector<TensorSpec> specs = ModelSpecs(static_cast<int>(state.range(0)), 16);
  for (auto _ : state) {
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = 8});
    benchmark::DoNotOptimize(layout);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_CreateLayout)->Arg(100)->Arg(10000)->Unit(benchmark::kMillisecond);

// The per-step lookup: a rank's slices of a unit.
void BM_ViewShardSlices(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(static_cast<int>(state.range(0)), 8);
  int shard = 0;
  for (auto _ : state) {
    absl::Span<const ShardSlice> slices = layout.ShardSlices(shard);
    benchmark::DoNotOptimize(slices);
    shard = (shard + 1) & 7;
  }
}
BENCHMARK(BM_ViewShardSlices)->Arg(10000);

// What an optimizer does each step: walk every slice of its shard.
void BM_ViewWalkShard(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(static_cast<int>(state.range(0)), 8);
  for (auto _ : state) {
    size_t sum = 0;
    for (const ShardSlice& s : layout.ShardSlices(3)) sum += s.length + s.tensor;
    benchmark::DoNotOptimize(sum);
  }
  state.SetItemsProcessed(state.iterations() * layout.ShardSlices(3).size());
}
BENCHMARK(BM_ViewWalkShard)->Arg(10000)->Unit(benchmark::kMicrosecond);

// A checkpoint or per-parameter optimizer: every tensor's slices, one lookup each.
void BM_ViewAllTensorSlices(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(static_cast<int>(state.range(0)), 8);
  for (auto _ : state) {
    size_t n = 0;
    for (int t = 0; t < layout.num_tensors(); ++t) n += layout.TensorSlices(t).size();
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(state.iterations() * layout.num_tensors());
}
BENCHMARK(BM_ViewAllTensorSlices)->Arg(10000)->Unit(benchmark::kMicrosecond);

void BM_TensorAtOffset(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(10000, 8);
  uint64_t x = 88172645463325252ull;
  for (auto _ : state) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    benchmark::DoNotOptimize(layout.TensorAtOffset(x % layout.total_elements()));
  }
}
BENCHMARK(BM_TensorAtOffset);

void BM_FindTensor(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(10000, 8);
  const std::string name = "blocks.500.mlp.up.weight";
  for (auto _ : state) benchmark::DoNotOptimize(layout.FindTensor(name));
}
BENCHMARK(BM_FindTensor);

void BM_Serialize(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(10000, 8);
  size_t bytes = 0;
  for (auto _ : state) {
    std::string s = layout.Serialize();
    bytes = s.size();
    benchmark::DoNotOptimize(s);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_Serialize)->Unit(benchmark::kMicrosecond);

void BM_Deserialize(benchmark::State& state) {
  const std::string bytes = MakeLayout(10000, 8).Serialize();
  for (auto _ : state) {
    absl::StatusOr<FlatLayout> layout = FlatLayout::Deserialize(bytes);
    benchmark::DoNotOptimize(layout);
  }
  state.SetBytesProcessed(state.iterations() * bytes.size());
}
BENCHMARK(BM_Deserialize)->Unit(benchmark::kMillisecond);

void BM_PlanReshard(benchmark::State& state) {
  const std::vector<TensorSpec> specs = ModelSpecs(10000, 16);
  const FlatLayout from = *FlatLayout::Create(specs, {.num_shards = 8});
  const FlatLayout to = *FlatLayout::Create(specs, {.num_shards = 6, .alignment_bytes = 64});
  for (auto _ : state) {
    absl::StatusOr<ReshardPlan> plan = PlanReshard(from, to);
    benchmark::DoNotOptimize(plan);
  }
  state.SetItemsProcessed(state.iterations() * specs.size());
}
BENCHMARK(BM_PlanReshard)->Unit(benchmark::kMicrosecond);

// Gradient clipping's local half: the sum of squares of one f32 shard.
void BM_ShardSquaredNorm(benchmark::State& state) {
  const FlatLayout layout = MakeLayout(10000, 8, state.range(0));
  std::vector<float> shard(layout.shard_elements(), 0.5f);
  for (auto _ : state) {
    absl::StatusOr<double> sum = ShardSquaredNorm(layout, 2, shard.data(), DType::kF32);
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * layout.shard_bytes());
}
BENCHMARK(BM_ShardSquaredNorm)->Arg(16)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
