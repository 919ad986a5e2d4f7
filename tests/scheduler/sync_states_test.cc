// SyncModuleStates (scheduler/sync_states.h), ranks as threads over the local backend: the root's
// hashed tensors (odd sizes, mixed dtypes, empty ones) reach every rank bit for bit, for buckets
// larger than everything, of odd sizes, smaller than one tensor and of one byte, for every root;
// the number of broadcasts is the number of buckets; a rank with other sizes fails every rank
// naming it; bad arguments are InvalidArgument.
#include "scheduler/sync_states.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/status.h"
#include "tests/common/local_ranks.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);
absl::Time Deadline() { return absl::Now() + kTimeout; }

using ::shardline::testing::HashMix;

struct Def {
  size_t count;
  DType dtype;
};
const std::vector<Def> kDefs = {{1031, DType::kF32}, {0, DType::kF64},  {7, DType::kBF16},
                                {1, DType::kI64},    {333, DType::kU8}, {0, DType::kF32},
                                {29, DType::kF64},   {5, DType::kI32}};

// The bytes of tensor t on `rank` (the root's are the values every rank must end with).
std::vector<char> Bytes(int rank, size_t t, const Def& d) {
  std::vector<char> out(d.count * DTypeSize(d.dtype));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(HashMix(HashMix(HashMix(rank) ^ t) ^ i));
  }
  return out;
}

std::vector<absl::Status> RunRanks(
    int world, const std::function<absl::Status(int, std::shared_ptr<Communicator>)>& fn) {
  return testing::RunLocalRanks(world, kTimeout, fn);
}

TEST(SyncModuleStatesTest, EveryRankGetsTheRootsBytesForEveryBucketSize) {
  size_t total = 0;
  for (const Def& d : kDefs) total += d.count * DTypeSize(d.dtype);
  for (const size_t bucket : {size_t{1} << 20, size_t{4096}, size_t{1000}, size_t{37}, size_t{1}}) {
    for (const int root : {0, 2}) {
      const int world = 3;
      std::vector<uint64_t> issued(world);
      auto statuses = RunRanks(world, [&](int r, std::shared_ptr<Communicator> comm) {
        std::vector<std::vector<char>> mine;
        std::vector<SyncTensor> tensors;
        for (size_t t = 0; t < kDefs.size(); ++t) {
          mine.push_back(Bytes(r, t, kDefs[t]));
          tensors.push_back({.data = mine.back().empty() ? nullptr : mine.back().data(),
                             .count = kDefs[t].count,
                             .dtype = kDefs[t].dtype});
        }
        const uint64_t before = comm->next_seq();
        SL_RETURN_IF_ERROR(
            SyncModuleStates(*comm, tensors, {.root = root, .bucket_bytes = bucket}, Deadline()));
        issued[r] = comm->next_seq() - before;
        size_t wrong = 0;
        for (size_t t = 0; t < kDefs.size(); ++t) {
          const std::vector<char> want = Bytes(root, t, kDefs[t]);
          for (size_t i = 0; i < want.size(); ++i) wrong += mine[t][i] != want[i];
        }
        EXPECT_EQ(wrong, 0u) << "rank " << r << " bucket " << bucket << " root " << root;
        return absl::OkStatus();
      });
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(statuses[r].ok()) << statuses[r];
        // One all-gather (the size check) and one broadcast per bucket.
        EXPECT_EQ(issued[r], 1 + (total + bucket - 1) / bucket) << "bucket " << bucket;
      }
    }
  }
}

TEST(SyncModuleStatesTest, OtherSizesFailEveryRankNamingTheRank) {
  auto statuses = RunRanks(3, [&](int r, std::shared_ptr<Communicator> comm) {
    std::vector<char> a(r == 1 ? 12 : 8), b(4);
    std::vector<SyncTensor> tensors = {{.data = a.data(), .count = a.size(), .dtype = DType::kU8},
                                       {.data = b.data(), .count = b.size(), .dtype = DType::kU8}};
    return SyncModuleStates(*comm, tensors, {.bucket_bytes = 5}, Deadline());
  });
  for (const absl::Status& s : statuses) {
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(),
                                  "rank 1 has 2 tensors of 16 bytes, the root (rank "
                                  "0) 2 tensors of 12 bytes"))
        << s;
  }
  // The same total in another order is caught too.
  statuses = RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) {
    std::vector<char> a(r == 1 ? 4 : 8), b(r == 1 ? 8 : 4);
    std::vector<SyncTensor> tensors = {{.data = a.data(), .count = a.size(), .dtype = DType::kU8},
                                       {.data = b.data(), .count = b.size(), .dtype = DType::kU8}};
    return SyncModuleStates(*comm, tensors, {}, Deadline());
  });
  for (const absl::Status& s : statuses) {
    EXPECT_TRUE(absl::StrContains(s.message(), "sizes in another order")) << s;
  }
}

TEST(SyncModuleStatesTest, BadArguments) {
  auto comms = CreateLocalCommunicators(1, {.timeout = kTimeout});
  ASSERT_TRUE(comms.ok());
  Communicator& comm = *(*comms)[0];
  std::vector<SyncTensor> null = {{.data = nullptr, .count = 3, .dtype = DType::kF32}};
  absl::Status s = SyncModuleStates(comm, null, {}, Deadline());
  EXPECT_TRUE(absl::IsInvalidArgument(s) && absl::StrContains(s.message(), "tensor 0 has 3")) << s;
  s = SyncModuleStates(comm, {}, {.bucket_bytes = 0}, Deadline());
  EXPECT_TRUE(absl::IsInvalidArgument(s) && absl::StrContains(s.message(), "bucket_bytes")) << s;
  s = SyncModuleStates(comm, {}, {.root = 1}, Deadline());
  EXPECT_TRUE(absl::IsInvalidArgument(s) && absl::StrContains(s.message(), "root 1")) << s;
  EXPECT_TRUE(SyncModuleStates(comm, {}, {}, Deadline()).ok());
}

}  // namespace
}  // namespace shardline
