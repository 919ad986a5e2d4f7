#include "runtime/reshard_plan.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/flat_layout.h"
#include "tests/runtime/random_layout.h"

namespace shardline {
namespace {

using ::shardline::testing::FillRandom;
using ::shardline::testing::IterationScale;
using ::shardline::testing::RandomDType;
using ::shardline::testing::RandomOptions;
using ::shardline::testing::RandomSpecs;
using ::shardline::testing::RandomTensorCount;
using ::testing::HasSubstr;

using Shards = std::vector<std::vector<uint8_t>>;

Shards MakeShards(const FlatLayout& layout, uint8_t fill) {
  return Shards(layout.num_shards(), std::vector<uint8_t>(layout.shard_bytes(), fill));
}

// Shards holding random tensor bytes (written through the tensors' own offsets, not through the
// shard views under test) and zero padding.
Shards RandomShards(const FlatLayout& layout, std::mt19937_64& rng) {
  const size_t esize = layout.element_size();
  std::vector<uint8_t> unsharded(layout.total_bytes(), 0);
  for (const FlatTensor& t : layout.tensors()) {
    if (t.is_tie() || t.numel == 0) continue;
    std::vector<uint8_t> bytes(t.numel * esize);
    FillRandom(rng, bytes);
    std::memcpy(unsharded.data() + t.offset * esize, bytes.data(), bytes.size());
  }
  Shards shards;
  for (int s = 0; s < layout.num_shards(); ++s) {
    shards.emplace_back(unsharded.begin() + layout.ShardBegin(s) * esize,
                        unsharded.begin() + layout.ShardEnd(s) * esize);
  }
  return shards;
}

absl::Status Execute(const ReshardPlan& plan, const Shards& src, Shards& dst) {
  std::vector<const void*> in;
  std::vector<void*> out;
  for (const auto& s : src) in.push_back(s.data());
  for (auto& d : dst) out.push_back(d.data());
  return ExecuteReshardPlan(plan, in, out);
}

// Each tensor's bytes, read through its offset in the concatenated shards.
std::vector<std::vector<uint8_t>> Unflatten(const FlatLayout& layout, const Shards& shards) {
  std::vector<uint8_t> gathered;
  for (const auto& s : shards) gathered.insert(gathered.end(), s.begin(), s.end());
  std::vector<std::vector<uint8_t>> tensors;
  const size_t esize = layout.element_size();
  for (const FlatTensor& t : layout.tensors()) {
    tensors.emplace_back(gathered.begin() + t.offset * esize, gathered.begin() + t.end() * esize);
  }
  return tensors;
}

// Sorted by both sides, maximally merged, each tensor element read once and written once,
// padding never touched.
void CheckPlanShape(const ReshardPlan& plan, const FlatLayout& from, const FlatLayout& to) {
  ASSERT_EQ(plan.total_elements(), from.tensor_elements());
  std::vector<int> read(from.total_elements(), 0), written(to.total_elements(), 0);
  for (size_t k = 0; k < plan.copies.size(); ++k) {
    const ReshardCopy& c = plan.copies[k];
    ASSERT_GT(c.length, 0u);
    for (size_t e = 0; e < c.length; ++e) {
      const size_t src = from.ShardBegin(c.src_shard) + c.src_offset + e;
      const size_t dst = to.ShardBegin(c.dst_shard) + c.dst_offset + e;
      ASSERT_LT(c.src_offset + e, from.shard_elements());
      ASSERT_LT(c.dst_offset + e, to.shard_elements());
      ++read[src];
      ++written[dst];
      // The element is the same element of the same tensor on both sides.
      const int t = from.TensorAtOffset(src);
      ASSERT_GE(t, 0) << "copy " << c << " reads padding";
      ASSERT_EQ(to.TensorAtOffset(dst), t) << "copy " << c;
      ASSERT_EQ(src - from.tensor(t).offset, dst - to.tensor(t).offset) << "copy " << c;
    }
    if (k == 0) continue;
    const ReshardCopy& p = plan.copies[k - 1];
    ASSERT_TRUE(std::make_pair(p.dst_shard, p.dst_offset) <
                std::make_pair(c.dst_shard, c.dst_offset));
    ASSERT_TRUE(std::make_pair(p.src_shard, p.src_offset) <
                std::make_pair(c.src_shard, c.src_offset));
    ASSERT_FALSE(p.src_shard == c.src_shard && p.dst_shard == c.dst_shard &&
                 p.src_offset + p.length == c.src_offset && p.dst_offset + p.length == c.dst_offset)
        << "copies " << p << " and " << c << " should have been merged";
  }
  for (size_t e = 0; e < read.size(); ++e) {
    ASSERT_EQ(read[e], from.TensorAtOffset(e) >= 0 ? 1 : 0) << "source element " << e;
  }
  for (size_t e = 0; e < written.size(); ++e) {
    ASSERT_EQ(written[e], to.TensorAtOffset(e) >= 0 ? 1 : 0) << "destination element " << e;
  }
  size_t by_dst = 0, by_src = 0;
  for (int d = 0; d < plan.dst_shards; ++d) {
    for (const ReshardCopy& c : plan.ForDestination(d)) {
      ASSERT_EQ(c.dst_shard, d);
      ++by_dst;
    }
  }
  for (int s = 0; s < plan.src_shards; ++s) {
    for (const ReshardCopy& c : plan.ForSource(s)) {
      ASSERT_EQ(c.src_shard, s);
      ++by_src;
    }
  }
  ASSERT_EQ(by_dst, plan.copies.size());
  ASSERT_EQ(by_src, plan.copies.size());
}

TEST(ReshardPlanPropertyTest, RoundTripIsIdentityAndTouchesEachElementOnce) {
  std::mt19937_64 rng(31337);
  const int iterations = 2000 / IterationScale();
  for (int it = 0; it < iterations; ++it) {
    SCOPED_TRACE(::testing::Message() << "iteration " << it);
    const std::vector<TensorSpec> specs = RandomSpecs(rng, RandomTensorCount(rng));
    const DType element = RandomDType(rng);
    const FlatLayoutOptions from_options = RandomOptions(rng, element);
    const FlatLayoutOptions to_options = RandomOptions(rng, element);
    const FlatLayout from = *FlatLayout::Create(specs, from_options);
    const FlatLayout to = *FlatLayout::Create(specs, to_options);

    absl::StatusOr<ReshardPlan> forward = PlanReshard(from, to);
    ASSERT_TRUE(forward.ok()) << forward.status();
    ASSERT_NO_FATAL_FAILURE(CheckPlanShape(*forward, from, to));
    absl::StatusOr<ReshardPlan> backward = PlanReshard(to, from);
    ASSERT_TRUE(backward.ok()) << backward.status();
    ASSERT_NO_FATAL_FAILURE(CheckPlanShape(*backward, to, from));

    const Shards original = RandomShards(from, rng);
    // Destination padding is pre-filled with a sentinel: the plan must leave it alone.
    Shards moved = MakeShards(to, 0xEE);
    ASSERT_TRUE(Execute(*forward, original, moved).ok());
    ASSERT_EQ(Unflatten(to, moved), Unflatten(from, original));
    for (const PaddingRange& p : to.PaddingRanges()) {
      const int s = static_cast<int>(p.begin / to.shard_elements());
      for (size_t b = (p.begin - to.ShardBegin(s)) * to.element_size();
           b < (p.end - to.ShardBegin(s)) * to.element_size(); ++b) {
        ASSERT_EQ(moved[s][b], 0xEE) << "padding written at element " << p.begin;
      }
    }
    for (int s = 0; s < to.num_shards(); ++s) to.ZeroShardPadding(s, moved[s].data());

    Shards back = MakeShards(from, 0);
    ASSERT_TRUE(Execute(*backward, moved, back).ok());
    ASSERT_EQ(back, original) << "N -> M -> N is not the identity";
  }
}

TEST(ReshardPlanTest, SameLayoutIsOneCopyPerContiguousRun) {
  // No alignment gaps (i8 elements, 1-byte alignment): each shard is one copy onto itself.
  const std::vector<TensorSpec> specs = {{"a", {5}}, {"b", {7}}, {"c", {3}}};
  const FlatLayout layout = *FlatLayout::Create(
      specs, {.num_shards = 4, .element_dtype = DType::kI8, .alignment_bytes = 1});
  const ReshardPlan plan = *PlanReshard(layout, layout);
  EXPECT_THAT(plan.copies,
              ::testing::ElementsAre(ReshardCopy{0, 0, 0, 0, 4}, ReshardCopy{1, 1, 0, 0, 4},
                                     ReshardCopy{2, 2, 0, 0, 4}, ReshardCopy{3, 3, 0, 0, 3}));
  // 4 -> 2 shards of the same buffer.
  const FlatLayout two = *FlatLayout::Create(
      specs, {.num_shards = 2, .element_dtype = DType::kI8, .alignment_bytes = 1});
  EXPECT_THAT(PlanReshard(layout, two)->copies,
              ::testing::ElementsAre(ReshardCopy{0, 0, 0, 0, 4}, ReshardCopy{1, 0, 0, 4, 4},
                                     ReshardCopy{2, 1, 0, 0, 4}, ReshardCopy{3, 1, 0, 4, 3}));
}

TEST(ReshardPlanTest, RejectsDifferentTensors) {
  const std::vector<TensorSpec> specs = {{"a", {5}}, {"b", {7}}, {"c", {3}}};
  const FlatLayout from = *FlatLayout::Create(specs, {.num_shards = 2});
  std::vector<TensorSpec> other = specs;
  other[1].name = "B";
  absl::Status status = PlanReshard(from, *FlatLayout::Create(other, {.num_shards = 3})).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("tensor 1 differs: from has 'b' [7] f32, to has 'B'"));
  other = specs;
  other[2].shape = {1, 3};
  status = PlanReshard(from, *FlatLayout::Create(other, {.num_shards = 3})).status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("tensor 2 differs"));
  other = specs;
  other.pop_back();
  status = PlanReshard(from, *FlatLayout::Create(other, {.num_shards = 3})).status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("first unmatched tensor 2 is 'c'"));
  status = PlanReshard(from,
                       *FlatLayout::Create(specs, {.num_shards = 2, .element_dtype = DType::kBF16}))
               .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("element dtypes differ"));
}

TEST(ReshardPlanTest, ExecuteRejectsBadArguments) {
  const std::vector<TensorSpec> specs = {{"a", {5}}, {"b", {7}}};
  const FlatLayout from = *FlatLayout::Create(specs, {.num_shards = 2});
  const FlatLayout to = *FlatLayout::Create(specs, {.num_shards = 3});
  ReshardPlan plan = *PlanReshard(from, to);
  Shards src = MakeShards(from, 0), dst = MakeShards(to, 0);
  EXPECT_TRUE(Execute(plan, src, dst).ok());
  Shards short_dst = MakeShards(from, 0);
  EXPECT_THAT(std::string(Execute(plan, src, short_dst).message()),
              HasSubstr("got 2 source and 2 destination shard pointers, the plan has 2 and 3"));
  std::vector<const void*> in = {src[0].data(), nullptr};
  std::vector<void*> out = {dst[0].data(), dst[1].data(), dst[2].data()};
  EXPECT_THAT(std::string(ExecuteReshardPlan(plan, in, out).message()),
              HasSubstr("source shard 1 pointer is null"));
  plan.copies.back().length += plan.dst_shard_elements;
  EXPECT_EQ(Execute(plan, src, dst).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardline
