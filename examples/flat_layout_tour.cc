// A tour of FlatLayout: builds a small unit (four parameters, one of them tied), prints where
// every element lives in the flat buffer and in each shard, the per-shard views an optimizer
// uses, and the plan that reshards a checkpoint from 3 ranks to 2. Its output is the worked
// example in docs/architecture.md.
//
//   ./flat_layout_tour

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/flat_layout.h"
#include "runtime/reshard_plan.h"

namespace {

using shardline::DType;
using shardline::FlatLayout;
using shardline::FlatTensor;
using shardline::ShardSlice;
using shardline::TensorSpec;

// One letter per tensor that owns storage (A, B, C, ...); ties print as their target.
char Letter(const FlatLayout& layout, int tensor) {
  int rank = 0;
  for (int i = 0; i < tensor; ++i) rank += layout.tensor(i).is_tie() ? 0 : 1;
  return static_cast<char>('A' + rank);
}

// "A3": element 3 of tensor A; "..": padding.
std::string Cell(const FlatLayout& layout, size_t offset) {
  const int t = layout.TensorAtOffset(offset);
  if (t < 0) return "..";
  return absl::StrCat(std::string(1, Letter(layout, t)), offset - layout.tensor(t).offset);
}

void PrintPicture(const FlatLayout& layout) {
  const size_t n = layout.shard_elements();
  std::printf("The unsharded flat buffer, one row per shard (rank r owns row r):\n\n");
  std::string header = "           ";
  for (size_t k = 0; k < n; ++k) header += absl::StrFormat(" %-3d", k);
  std::printf("%s  <- offset in shard\n", header.c_str());
  for (int s = 0; s < layout.num_shards(); ++s) {
    std::string row;
    for (size_t k = 0; k < n; ++k) {
      row += absl::StrFormat(" %-3s", Cell(layout, layout.ShardBegin(s) + k));
    }
    std::printf("  shard %d |%s |  elements [%zu, %zu)\n", s, row.c_str(), layout.ShardBegin(s),
                layout.ShardEnd(s));
  }
  std::printf("\n  Legend: X<i> = element i of tensor X (row-major), .. = padding (zero-filled)\n");
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const FlatTensor& t = layout.tensor(i);
    if (t.is_tie()) {
      std::printf("          %s is tied to %s: no elements of its own (it reads %c)\n",
                  t.spec.name.c_str(), layout.tensor(t.tied_to).spec.name.c_str(),
                  Letter(layout, t.storage));
    } else {
      std::printf("          %c = %s, %zu elements at offset %zu\n", Letter(layout, i),
                  t.spec.name.c_str(), t.numel, t.offset);
    }
  }
}

}  // namespace

int main() {
  // Four parameters; the buffer holds f32 (the master dtype), whatever each parameter's own dtype.
  const std::vector<TensorSpec> specs = {
      {"embed", {2, 3}, DType::kBF16},
      {"norm.weight", {3}, DType::kF32},
      {"proj.weight", {2, 5}, DType::kBF16},
      {"lm_head", {2, 3}, DType::kBF16, /*tied_to=*/"embed"},
  };
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(
      specs, {.num_shards = 3, .element_dtype = DType::kF32, .alignment_bytes = 16});
  if (!layout.ok()) {
    std::fprintf(stderr, "%s\n", std::string(layout.status().message()).c_str());
    return 1;
  }
  std::printf(
      "FlatLayout::Create(specs, {.num_shards = 3, .element_dtype = kF32, "
      ".alignment_bytes = 16})\n\n");
  std::printf("%s\n", layout->ToString().c_str());
  PrintPicture(*layout);

  std::printf("\nPer-shard views (ShardSlices(r): what rank r's optimizer steps on):\n");
  for (int s = 0; s < layout->num_shards(); ++s) {
    for (const ShardSlice& sl : layout->ShardSlices(s)) {
      std::printf("  shard %d: %-12s elements [%zu, %zu) at shard offset %zu\n", s,
                  layout->tensor(sl.tensor).spec.name.c_str(), sl.tensor_offset,
                  sl.tensor_offset + sl.length, sl.shard_offset);
    }
  }

  // The same unit saved by 3 ranks, loaded by 2 (and a 32-byte alignment).
  absl::StatusOr<FlatLayout> two = FlatLayout::Create(
      specs, {.num_shards = 2, .element_dtype = DType::kF32, .alignment_bytes = 32});
  absl::StatusOr<shardline::ReshardPlan> plan = shardline::PlanReshard(*layout, *two);
  if (!two.ok() || !plan.ok()) return 1;
  std::printf("\nReshard 3 shards (16 B alignment) -> 2 shards (32 B alignment):\n\n");
  PrintPicture(*two);
  std::printf("\n  PlanReshard copies (elements):\n");
  for (const shardline::ReshardCopy& c : plan->copies) {
    std::printf("    src shard %d [%zu, %zu) -> dst shard %d [%zu, %zu)\n", c.src_shard,
                c.src_offset, c.src_offset + c.length, c.dst_shard, c.dst_offset,
                c.dst_offset + c.length);
  }
  std::printf("\n  fingerprints: 3-shard %016llx, 2-shard %016llx\n",
              static_cast<unsigned long long>(layout->Fingerprint()),
              static_cast<unsigned long long>(two->Fingerprint()));
  return 0;
}
