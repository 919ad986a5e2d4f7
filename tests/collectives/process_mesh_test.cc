// The hybrid-sharding mesh over the local backend: group membership against the row-major
// layout, collectives within rows and columns, degenerate shapes, invalid shapes.
#include "collectives/process_mesh.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/stream.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;

struct Shape {
  int world;
  int shard;
};

class ProcessMeshTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ProcessMeshTest, GroupsFollowTheRowMajorLayout) {
  const auto [n, s] = GetParam();
  auto comms = *CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  RunRankThreads(n, [&](int r) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(comms[r], s, deadline);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ(mesh->shard_size(), s);
    EXPECT_EQ(mesh->replicate_size(), n / s);
    EXPECT_EQ(mesh->shard_rank(), r % s);
    EXPECT_EQ(mesh->replicate_rank(), r / s);
    auto stream = *CreateHostStream({});
    // Gather world ranks along the row and along the column.
    int32_t me = r;
    std::vector<int32_t> row(s), column(n / s);
    ASSERT_TRUE(
        mesh->shard()->AllGather(&me, row.data(), 1, DType::kI32, *stream)->Wait(deadline).ok());
    ASSERT_TRUE(mesh->replicate()
                    ->AllGather(&me, column.data(), 1, DType::kI32, *stream)
                    ->Wait(deadline)
                    .ok());
    for (int j = 0; j < s; ++j) EXPECT_EQ(row[j], r / s * s + j);
    for (int i = 0; i < n / s; ++i) EXPECT_EQ(column[i], i * s + r % s);
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, ProcessMeshTest,
                         ::testing::Values(Shape{4, 2}, Shape{6, 3}, Shape{6, 2}, Shape{4, 4},
                                           Shape{4, 1}, Shape{1, 1}),
                         [](const auto& info) {
                           return absl::StrCat(info.param.world / info.param.shard, "x",
                                               info.param.shard);
                         });

TEST(ProcessMeshInvalidTest, ShardSizeMustDivideTheWorld) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = absl::Seconds(5)});
  for (int bad : {0, -1, 2}) {
    absl::StatusOr<ProcessMesh> mesh =
        ProcessMesh::Create(comms[0], bad, absl::Now() + absl::Seconds(5));
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(mesh.status().message(), "does not divide the world size 1"));
  }
}

TEST(RanksPerHostTest, AllThreadsShareOneHost) {
  const int n = 3;
  auto comms = *CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  RunRankThreads(n, [&](int r) {
    absl::StatusOr<int> per_host = RanksPerHost(*comms[r], absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(per_host.ok()) << per_host.status();
    EXPECT_EQ(*per_host, n);
  });
}

}  // namespace
}  // namespace shardline
