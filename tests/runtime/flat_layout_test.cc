#include "runtime/flat_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/check.h"
#include "runtime/half.h"
#include "runtime/shard_norms.h"
#include "tests/runtime/random_layout.h"

namespace shardline {
namespace {

using ::shardline::testing::FillRandom;
using ::shardline::testing::IterationScale;
using ::shardline::testing::RandomDType;
using ::shardline::testing::RandomOptions;
using ::shardline::testing::RandomSpecs;
using ::shardline::testing::RandomTensorCount;
using ::shardline::testing::UniformInt;
using ::testing::HasSubstr;

// --- An independent reference: the placement rule written as the plainest loop. -------------

struct Reference {
  std::vector<size_t> numel;
  std::vector<size_t> offset;
  std::vector<int> storage;
  size_t shard_elements = 0;
  size_t total = 0;
  std::vector<int> owner;  // per unsharded element: storage tensor, or -1 for padding
};

Reference ComputeReference(const std::vector<TensorSpec>& specs, const FlatLayoutOptions& o) {
  Reference ref;
  const size_t a = o.alignment_bytes / DTypeSize(o.element_dtype);
  size_t cursor = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    size_t n = 1;
    for (int64_t d : specs[i].shape) n *= static_cast<size_t>(d);
    ref.numel.push_back(n);
    if (!specs[i].tied_to.empty()) {
      size_t j = 0;
      while (specs[j].name != specs[i].tied_to) ++j;
      ref.offset.push_back(ref.offset[j]);
      ref.storage.push_back(ref.storage[j]);
      continue;
    }
    while (cursor % a != 0) ++cursor;
    ref.offset.push_back(cursor);
    ref.storage.push_back(static_cast<int>(i));
    cursor += n;
  }
  const size_t S = o.num_shards;
  size_t shard = 0;
  while (shard * S < cursor || shard % a != 0 || shard % o.block_elements != 0) ++shard;
  ref.shard_elements = shard;
  ref.total = shard * S;
  ref.owner.assign(ref.total, -1);
  for (size_t i = 0; i < specs.size(); ++i) {
    if (ref.storage[i] != static_cast<int>(i)) continue;
    for (size_t k = 0; k < ref.numel[i]; ++k) ref.owner[ref.offset[i] + k] = static_cast<int>(i);
  }
  return ref;
}

// Checks every structural property of `layout` against the reference. Returns false (after
// recording failures) so callers can stop early.
void CheckStructure(const FlatLayout& layout, const std::vector<TensorSpec>& specs,
                    const FlatLayoutOptions& options, const Reference& ref) {
  ASSERT_EQ(layout.num_tensors(), static_cast<int>(specs.size()));
  ASSERT_EQ(layout.shard_elements(), ref.shard_elements);
  ASSERT_EQ(layout.total_elements(), ref.total);
  ASSERT_EQ(layout.specs(), specs);
  ASSERT_EQ(layout.options(), options);
  size_t tensor_elements = 0;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const FlatTensor& t = layout.tensor(i);
    ASSERT_EQ(t.numel, ref.numel[i]) << i;
    ASSERT_EQ(t.offset, ref.offset[i]) << i;
    ASSERT_EQ(t.storage, ref.storage[i]) << i;
    ASSERT_EQ(layout.FindTensor(specs[i].name), std::optional<int>(i));
    if (t.storage == i) tensor_elements += t.numel;
  }
  ASSERT_EQ(layout.tensor_elements(), tensor_elements);

  // Every (tensor, shard) intersection equals the interval arithmetic, and the per-tensor
  // slices tile each tensor exactly once.
  const size_t sh = layout.shard_elements();
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const FlatTensor& t = layout.tensor(i);
    std::vector<int> cover(t.numel, 0);
    for (const ShardSlice& sl : layout.TensorSlices(i)) {
      ASSERT_EQ(sl.tensor, t.storage);
      ASSERT_GT(sl.length, 0u);
      for (size_t k = 0; k < sl.length; ++k) ++cover[sl.tensor_offset + k];
    }
    ASSERT_TRUE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }))
        << "tensor " << i << " not tiled exactly once";
    for (int s = 0; s < layout.num_shards(); ++s) {
      const size_t lo = std::max(t.offset, s * sh);
      const size_t hi = std::min(t.end(), (s + 1) * sh);
      std::optional<ShardSlice> got = layout.Intersection(i, s);
      if (lo >= hi) {
        ASSERT_FALSE(got.has_value()) << "tensor " << i << " shard " << s;
      } else {
        ASSERT_TRUE(got.has_value()) << "tensor " << i << " shard " << s;
        ASSERT_EQ(*got, (ShardSlice{t.storage, s, lo - t.offset, lo - s * sh, hi - lo}));
      }
    }
  }

  // Shard slices and padding partition [0, total) exactly, in order, within their shards.
  std::vector<int> owner_seen(ref.total, -2);
  size_t seen_slices = 0;
  for (int s = 0; s < layout.num_shards(); ++s) {
    size_t prev_end = 0;
    for (const ShardSlice& sl : layout.ShardSlices(s)) {
      ASSERT_EQ(sl.shard, s);
      ASSERT_GE(sl.shard_offset, prev_end);
      ASSERT_LE(sl.shard_offset + sl.length, sh);
      ASSERT_EQ(layout.ShardBegin(s) + sl.shard_offset,
                layout.tensor(sl.tensor).offset + sl.tensor_offset);
      prev_end = sl.shard_offset + sl.length;
      for (size_t k = 0; k < sl.length; ++k) {
        int& o = owner_seen[layout.ShardBegin(s) + sl.shard_offset + k];
        ASSERT_EQ(o, -2);
        o = sl.tensor;
      }
      ++seen_slices;
    }
    for (const PaddingRange& p : layout.ShardPadding(s)) {
      ASSERT_LT(p.begin, p.end);
      ASSERT_GE(p.begin, layout.ShardBegin(s));
      ASSERT_LE(p.end, layout.ShardEnd(s));
      for (size_t k = p.begin; k < p.end; ++k) {
        ASSERT_EQ(owner_seen[k], -2);
        owner_seen[k] = -1;
      }
    }
  }
  ASSERT_EQ(seen_slices, layout.slices().size());
  ASSERT_EQ(owner_seen, ref.owner);

  // TensorAtOffset at every tensor boundary and a few random offsets.
  std::vector<size_t> probes = {0, ref.total, ref.total + 1};
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const FlatTensor& t = layout.tensor(i);
    for (size_t d : {size_t{0}, size_t{1}}) {
      if (t.offset >= d) probes.push_back(t.offset - d);
      probes.push_back(t.end() + d);
    }
  }
  for (size_t probe : probes) {
    const int want = probe < ref.total ? ref.owner[probe] : -1;
    ASSERT_EQ(layout.TensorAtOffset(probe), want) << "offset " << probe;
  }
}

// Shards `tensor_data` (per storage tensor, numel * element_size bytes) with the layout's
// shard views, zero-fills padding, gathers (concatenates) the shards and unflattens every
// tensor, ties included: each must come back bit-exactly.
void CheckShardGatherUnflatten(const FlatLayout& layout, std::mt19937_64& rng,
                               const Reference& ref) {
  const size_t esize = layout.element_size();
  std::vector<std::vector<uint8_t>> data(layout.num_tensors());
  for (int i = 0; i < layout.num_tensors(); ++i) {
    if (layout.tensor(i).storage != i) continue;
    data[i].resize(layout.tensor(i).numel * esize);
    FillRandom(rng, data[i]);
  }
  std::vector<std::vector<uint8_t>> shards(layout.num_shards(),
                                           std::vector<uint8_t>(layout.shard_bytes(), 0xA5));
  for (int s = 0; s < layout.num_shards(); ++s) {
    for (const ShardSlice& sl : layout.ShardSlices(s)) {
      std::memcpy(shards[s].data() + sl.shard_offset * esize,
                  data[sl.tensor].data() + sl.tensor_offset * esize, sl.length * esize);
    }
    layout.ZeroShardPadding(s, shards[s].data());
  }
  std::vector<uint8_t> gathered;
  for (const auto& shard : shards) gathered.insert(gathered.end(), shard.begin(), shard.end());
  ASSERT_EQ(gathered.size(), layout.total_bytes());
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const FlatTensor& t = layout.tensor(i);
    const std::vector<uint8_t>& want = data[t.storage];
    ASSERT_EQ(want.size(), t.numel * esize);
    if (want.empty()) continue;  // memcmp of zero bytes may still not take null pointers
    ASSERT_EQ(0, std::memcmp(gathered.data() + t.offset * esize, want.data(), want.size()))
        << "tensor " << i << " (" << t.spec.name << ") differs after gather + unflatten";
  }
  for (size_t e = 0; e < ref.total; ++e) {
    if (ref.owner[e] != -1) continue;
    for (size_t b = 0; b < esize; ++b) ASSERT_EQ(gathered[e * esize + b], 0) << "padding " << e;
  }
}

TEST(FlatLayoutPropertyTest, RandomLayoutsMatchReferenceAndRoundTrip) {
  std::mt19937_64 rng(20240611);
  const int iterations = 3000 / IterationScale();
  for (int it = 0; it < iterations; ++it) {
    SCOPED_TRACE(::testing::Message() << "iteration " << it);
    const std::vector<TensorSpec> specs = RandomSpecs(rng, RandomTensorCount(rng));
    const FlatLayoutOptions options = RandomOptions(rng, RandomDType(rng));
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, options);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const Reference ref = ComputeReference(specs, options);
    ASSERT_NO_FATAL_FAILURE(CheckStructure(*layout, specs, options, ref));
    ASSERT_NO_FATAL_FAILURE(CheckShardGatherUnflatten(*layout, rng, ref));

    // Value semantics: a copy is equal; the serialised form round-trips.
    const FlatLayout copy = *layout;
    ASSERT_EQ(copy, *layout);
    const std::string bytes = layout->Serialize();
    absl::StatusOr<FlatLayout> parsed = FlatLayout::Deserialize(bytes);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(*parsed, *layout);
    ASSERT_EQ(parsed->Fingerprint(), layout->Fingerprint());
    ASSERT_EQ(parsed->Serialize(), bytes);
    ASSERT_TRUE(CompareLayouts(*parsed, *layout).ok());
  }
}

// --- A worked example, by hand. ----------------------------------------------------------------

TEST(FlatLayoutTest, HandComputedExample) {
  // f32 elements, 16-byte alignment = 4 elements, 3 shards.
  //   a [2,3]: 6 elements at 0, gap [6, 8); b [3] at 8, gap [11, 12); c [5] at 12..17.
  //   17 elements over 3 shards -> 6 each, rounded up to 4 -> 8; total 24, tail [17, 24).
  const std::vector<TensorSpec> specs = {{"a", {2, 3}, DType::kBF16},
                                         {"b", {3}, DType::kF32},
                                         {"c", {5}, DType::kF32},
                                         {"a_tied", {2, 3}, DType::kBF16, "a"}};
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = 3});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->alignment_elements(), 4u);
  EXPECT_EQ(layout->shard_elements(), 8u);
  EXPECT_EQ(layout->total_elements(), 24u);
  EXPECT_EQ(layout->data_end(), 17u);
  EXPECT_EQ(layout->tensor_elements(), 14u);
  EXPECT_EQ(layout->tensor(1).offset, 8u);
  EXPECT_EQ(layout->tensor(2).offset, 12u);
  EXPECT_EQ(layout->tensor(3).offset, 0u);
  EXPECT_EQ(layout->tensor(3).storage, 0);
  EXPECT_THAT(layout->ShardSlices(1),
              ::testing::ElementsAre(ShardSlice{1, 1, 0, 0, 3}, ShardSlice{2, 1, 0, 4, 4}));
  EXPECT_THAT(layout->ShardSlices(2), ::testing::ElementsAre(ShardSlice{2, 2, 4, 0, 1}));
  EXPECT_THAT(layout->TensorSlices(3), ::testing::ElementsAre(ShardSlice{0, 0, 0, 0, 6}));
  EXPECT_THAT(
      layout->PaddingRanges(),
      ::testing::ElementsAre(PaddingRange{6, 8}, PaddingRange{11, 12}, PaddingRange{17, 24}));
  EXPECT_EQ(layout->TensorAtOffset(7), -1);
  EXPECT_EQ(layout->TensorAtOffset(16), 2);
  const std::string table = layout->ToString();
  EXPECT_THAT(table, HasSubstr("tied to a"));
  EXPECT_THAT(table, HasSubstr("c[0:4)@4"));
  EXPECT_THAT(table, HasSubstr("c[4:5)@0"));
}

TEST(FlatLayoutTest, BlockAndAlignmentRoundShardsToTheirLcm) {
  // 10 f32 elements, alignment 4 elements, block 3: shards are multiples of 12.
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(
      {{"w", {10}}}, {.num_shards = 2, .alignment_bytes = 16, .block_elements = 3});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->shard_elements(), 12u);
  // A padding run across a shard boundary is split in two.
  absl::StatusOr<FlatLayout> tail = FlatLayout::Create(
      {{"w", {3}}}, {.num_shards = 4, .element_dtype = DType::kI8, .alignment_bytes = 1});
  ASSERT_TRUE(tail.ok());
  EXPECT_THAT(tail->PaddingRanges(), ::testing::ElementsAre(PaddingRange{3, 4}));
  absl::StatusOr<FlatLayout> spread = FlatLayout::Create(
      {{"w", {1}}}, {.num_shards = 3, .element_dtype = DType::kI8, .alignment_bytes = 2});
  ASSERT_TRUE(spread.ok());
  EXPECT_EQ(spread->shard_elements(), 2u);
  EXPECT_THAT(spread->PaddingRanges(),
              ::testing::ElementsAre(PaddingRange{1, 2}, PaddingRange{2, 4}, PaddingRange{4, 6}));
}

TEST(FlatLayoutTest, EmptyLayouts) {
  const FlatLayout def;
  EXPECT_EQ(def.num_tensors(), 0);
  EXPECT_EQ(def.num_shards(), 1);
  EXPECT_EQ(def.total_elements(), 0u);
  EXPECT_TRUE(def.ShardSlices(0).empty());
  absl::StatusOr<FlatLayout> created = FlatLayout::Create({}, {});
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(*created, def);
  EXPECT_EQ(created->Fingerprint(), def.Fingerprint());

  absl::StatusOr<FlatLayout> zeros =
      FlatLayout::Create({{"z0", {0}}, {"z1", {3, 0, 2}}}, {.num_shards = 4});
  ASSERT_TRUE(zeros.ok());
  EXPECT_EQ(zeros->total_elements(), 0u);
  EXPECT_TRUE(zeros->slices().empty());
  EXPECT_TRUE(zeros->TensorSlices(1).empty());
  EXPECT_EQ(zeros->TensorAtOffset(0), -1);
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(zeros->ShardSlices(s).empty());
  absl::StatusOr<FlatLayout> round = FlatLayout::Deserialize(zeros->Serialize());
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(*round, *zeros);
}

TEST(FlatLayoutTest, TiesShareStorageAndResolveByName) {
  const std::vector<TensorSpec> specs = {{"embed", {7, 3}, DType::kBF16},
                                         {"mid", {5}},
                                         {"lm_head", {7, 3}, DType::kBF16, "embed"},
                                         {"lm_head2", {7, 3}, DType::kBF16, "lm_head"}};
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = 4});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensor_elements(), 26u);
  const int head = *layout->FindTensor("lm_head");
  const int head2 = *layout->FindTensor("lm_head2");
  EXPECT_EQ(head, 2);
  EXPECT_EQ(layout->tensor(head).tied_to, 0);
  EXPECT_EQ(layout->tensor(head2).tied_to, 2);
  EXPECT_EQ(layout->tensor(head2).storage, 0);
  EXPECT_EQ(layout->TensorSlices(head2), layout->TensorSlices(0));
  EXPECT_EQ(layout->Intersection(head2, 0), layout->Intersection(0, 0));
  EXPECT_FALSE(layout->FindTensor("nope").has_value());
  for (int s = 0; s < layout->num_shards(); ++s) {
    for (const ShardSlice& sl : layout->ShardSlices(s)) EXPECT_NE(sl.tensor, head);
  }
}

absl::Status CreateStatus(const std::vector<TensorSpec>& specs, const FlatLayoutOptions& o = {}) {
  return FlatLayout::Create(specs, o).status();
}

void ExpectInvalid(const absl::Status& status, const std::string& substring) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

TEST(FlatLayoutTest, RejectsBadSpecs) {
  ExpectInvalid(CreateStatus({{"a", {1}}, {"", {1}}}), "spec 1 has an empty name");
  ExpectInvalid(CreateStatus({{"a", {1}}, {"a", {1}}}), "repeats the name");
  ExpectInvalid(CreateStatus({{"a", {1}}, {"a", {2}, DType::kF16}}), "'a'");
  ExpectInvalid(CreateStatus({{"w", {2, -3}}}), "negative dim -3");
  ExpectInvalid(CreateStatus({{"w", {int64_t{1} << 40, int64_t{1} << 40}}}),
                "more elements than size_t");
  // A zero dim after an overflowing prefix is still an overflow of the shape product.
  ExpectInvalid(CreateStatus({{"w", {int64_t{1} << 40, int64_t{1} << 40, 0}}}), "'w'");
  const int64_t huge = std::numeric_limits<int64_t>::max() / 2;
  ExpectInvalid(CreateStatus({{"a", {huge}}, {"b", {huge}}, {"c", {huge}}}), "overflows size_t");
  ExpectInvalid(CreateStatus({{"a", {huge}}}, {.element_dtype = DType::kF64, .alignment_bytes = 8}),
                "overflows size_t");
  ExpectInvalid(CreateStatus({{"a", {1}}, {"b", {1}, DType::kF32, "zzz"}}),
                "tied_to 'zzz', which names no earlier spec");
  ExpectInvalid(CreateStatus({{"b", {1}, DType::kF32, "a"}, {"a", {1}}}), "no earlier spec");
  ExpectInvalid(CreateStatus({{"a", {1}, DType::kF32, "a"}}), "no earlier spec");
  ExpectInvalid(CreateStatus({{"a", {2, 3}}, {"b", {3, 2}, DType::kF32, "a"}}),
                "same shape and dtype");
  ExpectInvalid(CreateStatus({{"a", {2, 3}}, {"b", {2, 3}, DType::kBF16, "a"}}),
                "same shape and dtype");
  ExpectInvalid(CreateStatus({{"w", std::vector<int64_t>(kMaxFlatTensorRank + 1, 1)}}), "rank");
  ExpectInvalid(CreateStatus({{std::string(kMaxFlatTensorNameBytes + 1, 'x'), {1}}}), "name has");
}

TEST(FlatLayoutTest, RejectsBadOptions) {
  ExpectInvalid(CreateStatus({}, {.num_shards = 0}), "num_shards 0");
  ExpectInvalid(CreateStatus({}, {.num_shards = -2}), "num_shards -2");
  ExpectInvalid(CreateStatus({}, {.num_shards = kMaxFlatLayoutShards + 1}), "num_shards");
  ExpectInvalid(CreateStatus({}, {.alignment_bytes = 0}), "alignment_bytes 0 is not a power");
  ExpectInvalid(CreateStatus({}, {.alignment_bytes = 24}), "alignment_bytes 24 is not a power");
  ExpectInvalid(CreateStatus({}, {.element_dtype = DType::kF64, .alignment_bytes = 4}),
                "not a whole number of f64 elements");
  ExpectInvalid(CreateStatus({}, {.block_elements = 0}), "block_elements");
  ExpectInvalid(CreateStatus({}, {.element_dtype = static_cast<DType>(99)}), "element_dtype");
  EXPECT_TRUE(CreateStatus({}, {.element_dtype = DType::kI8, .alignment_bytes = 1}).ok());
}

// --- Serialisation. --------------------------------------------------------------------------

FlatLayout SampleLayout() {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(
      {{"embed", {7, 3}, DType::kBF16},
       {"ln", {0}},
       {"w", {5, 2}, DType::kF16},
       {"head", {7, 3}, DType::kBF16, "embed"}},
      {.num_shards = 3, .element_dtype = DType::kF32, .alignment_bytes = 32, .block_elements = 2});
  SL_CHECK_OK(layout.status());
  return *std::move(layout);
}

TEST(FlatLayoutSerializeTest, RejectsEveryTruncationAndTrailingBytes) {
  const std::string bytes = SampleLayout().Serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<FlatLayout> parsed = FlatLayout::Deserialize(bytes.substr(0, n));
    ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "prefix " << n;
  }
  ExpectInvalid(FlatLayout::Deserialize(bytes + "x").status(), "1 trailing bytes");
  std::string magic = bytes;
  magic[0] = 'X';
  ExpectInvalid(FlatLayout::Deserialize(magic).status(), "bad magic");
  std::string version = bytes;
  version[4] = 7;
  ExpectInvalid(FlatLayout::Deserialize(version).status(), "unsupported version 7");
}

TEST(FlatLayoutSerializeTest, RejectsInconsistentDerivedFields) {
  std::string bytes = SampleLayout().Serialize();
  bytes[28] ^= 1;  // shard_elements (see the format in flat_layout.cc)
  ExpectInvalid(FlatLayout::Deserialize(bytes).status(), "stored shard_elements");
}

TEST(FlatLayoutSerializeTest, HugeCountsFailFastWithoutAllocating) {
  std::string bytes = FlatLayout().Serialize();
  ASSERT_EQ(bytes.size(), 40u);
  for (int b = 36; b < 40; ++b) bytes[b] = '\xff';  // num_tensors = 2^32 - 1
  ExpectInvalid(FlatLayout::Deserialize(bytes).status(), "cannot fit");
}

TEST(FlatLayoutSerializeTest, MutatedAndGarbageInputNeverCrashes) {
  std::mt19937_64 rng(7);
  const std::string bytes = SampleLayout().Serialize();
  int accepted = 0;
  const int iterations = 20000 / IterationScale();
  for (int it = 0; it < iterations; ++it) {
    std::string mutated = bytes;
    const int flips = UniformInt(rng, 1, 4);
    for (int f = 0; f < flips; ++f) {
      mutated[UniformInt(rng, 0, mutated.size() - 1)] = static_cast<char>(rng());
    }
    absl::StatusOr<FlatLayout> parsed = FlatLayout::Deserialize(mutated);
    if (parsed.ok()) {
      ++accepted;  // e.g. a changed name byte: a different but valid layout
      ASSERT_EQ(parsed->Serialize(), mutated);
    } else {
      ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  for (int it = 0; it < iterations / 4; ++it) {
    std::string garbage(UniformInt(rng, 0, 120), '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    if (UniformInt(rng, 0, 1) == 0 && garbage.size() >= 6) {
      garbage.replace(0, 6, std::string("SLFL\x01\x00", 6));
    }
    EXPECT_FALSE(FlatLayout::Deserialize(garbage).ok());
  }
  EXPECT_GT(accepted, 0);
}

TEST(FlatLayoutCompareTest, NamesFirstDifference) {
  const std::vector<TensorSpec> base = {{"a", {2}}, {"b", {3, 4}}, {"c", {5}}};
  FlatLayout x = *FlatLayout::Create(base, {.num_shards = 2});
  EXPECT_TRUE(CompareLayouts(x, *FlatLayout::Create(base, {.num_shards = 2})).ok());

  std::vector<TensorSpec> other = base;
  other[1].shape = {4, 3};
  other[2].name = "d";
  FlatLayout y = *FlatLayout::Create(other, {.num_shards = 2});
  EXPECT_NE(x, y);
  EXPECT_NE(x.Fingerprint(), y.Fingerprint());
  absl::Status status = CompareLayouts(x, y, "rank 0", "rank 3");
  ExpectInvalid(status, "tensor 1 ('b' vs 'b') shape: rank 0 has [3, 4], rank 3 has [4, 3]");

  other = base;
  other[2].dtype = DType::kBF16;
  ExpectInvalid(CompareLayouts(x, *FlatLayout::Create(other, {.num_shards = 2})),
                "tensor 2 ('c' vs 'c') dtype");
  other = base;
  other.push_back({"e", {1}});
  ExpectInvalid(CompareLayouts(x, *FlatLayout::Create(other, {.num_shards = 2})),
                "first extra tensor is 3 ('e')");
  ExpectInvalid(CompareLayouts(x, *FlatLayout::Create(base, {.num_shards = 4})),
                "num_shards: a has 2, b has 4");
  ExpectInvalid(
      CompareLayouts(x, *FlatLayout::Create(base, {.num_shards = 2, .alignment_bytes = 64})),
      "alignment_bytes");
}

// --- Norms. -----------------------------------------------------------------------------------

double LoadAsDouble(const uint8_t* p, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kF64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DType::kBF16: {
      // Independent of runtime/half.h: a bf16 is the top half of an f32.
      uint32_t bits = static_cast<uint32_t>(p[0] | (p[1] << 8)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kF16: {
      uint16_t bits;
      std::memcpy(&bits, p, 2);
      return HalfBitsToFloat(bits);
    }
    default:
      return 0.0;
  }
}

void StoreRandom(std::mt19937_64& rng, uint8_t* p, DType dtype) {
  const float x = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(p, &x, 4);
      break;
    case DType::kF64: {
      const double d = x;
      std::memcpy(p, &d, 8);
      break;
    }
    case DType::kBF16: {
      const uint16_t bits = FloatToBf16Bits(x);
      std::memcpy(p, &bits, 2);
      break;
    }
    case DType::kF16: {
      const uint16_t bits = FloatToHalfBits(x);
      std::memcpy(p, &bits, 2);
      break;
    }
    default:
      break;
  }
}

TEST(FlatLayoutNormTest, ShardAndTensorSumsMatchAPlainLoop) {
  std::mt19937_64 rng(99);
  constexpr DType kFloats[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};
  const int iterations = 300 / IterationScale();
  for (int it = 0; it < iterations; ++it) {
    SCOPED_TRACE(::testing::Message() << "iteration " << it);
    const DType dtype = kFloats[UniformInt(rng, 0, 3)];
    const std::vector<TensorSpec> specs = RandomSpecs(rng, RandomTensorCount(rng));
    const FlatLayoutOptions options = RandomOptions(rng, RandomDType(rng));
    FlatLayout layout = *FlatLayout::Create(specs, options);
    const Reference ref = ComputeReference(specs, options);
    // The norm buffer has the layout's element offsets in `dtype` (not element_dtype); padding
    // holds huge values that must be skipped.
    const size_t size = DTypeSize(dtype);
    std::vector<uint8_t> unsharded(ref.total * size);
    std::vector<double> want_tensor(specs.size(), 0.0);
    double want_total = 0.0;
    for (size_t e = 0; e < ref.total; ++e) {
      if (ref.owner[e] < 0) {
        std::memset(&unsharded[e * size], 0x7b, size);
        continue;
      }
      StoreRandom(rng, &unsharded[e * size], dtype);
      const double x = LoadAsDouble(&unsharded[e * size], dtype);
      want_tensor[ref.owner[e]] += x * x;
      want_total += x * x;
    }
    std::vector<double> got_tensor(specs.size(), 0.0);
    std::vector<double> partials;
    for (int s = 0; s < layout.num_shards(); ++s) {
      const uint8_t* data = unsharded.data() + layout.ShardBegin(s) * size;
      absl::StatusOr<double> partial = ShardSquaredNorm(layout, s, data, dtype);
      ASSERT_TRUE(partial.ok()) << partial.status();
      partials.push_back(*partial);
      ASSERT_TRUE(
          AccumulateTensorSquaredNorms(layout, s, data, dtype, absl::MakeSpan(got_tensor)).ok());
    }
    EXPECT_NEAR(GlobalL2Norm(partials), std::sqrt(want_total), 1e-9 * (1 + std::sqrt(want_total)));
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_NEAR(got_tensor[i], want_tensor[i], 1e-9 * (1 + want_tensor[i])) << "tensor " << i;
    }
  }
}

TEST(FlatLayoutNormTest, RejectsBadArguments) {
  FlatLayout layout = SampleLayout();
  std::vector<float> data(layout.shard_elements(), 1.0f);
  ExpectInvalid(ShardSquaredNorm(layout, 0, data.data(), DType::kI32).status(), "i32");
  ExpectInvalid(ShardSquaredNorm(layout, 3, data.data(), DType::kF32).status(), "shard 3");
  ExpectInvalid(ShardSquaredNorm(layout, 0, nullptr, DType::kF32).status(), "null");
  std::vector<double> sums(2);
  ExpectInvalid(
      AccumulateTensorSquaredNorms(layout, 0, data.data(), DType::kF32, absl::MakeSpan(sums)),
      "sums has 2 entries");
}

}  // namespace
}  // namespace shardline
