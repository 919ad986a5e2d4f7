// The sim backend on a Topology (collectives/sim/sim_communicator.h, topology.h): completion
// times are the cost model's, splits keep their placement (a ProcessMesh's shard group inside a
// node, its replicate group across nodes, a hierarchical world), overlapping collectives on the
// same ports share them exactly as the fair-share rule says, disjoint ports do not interfere,
// data still moves, and the same calls give the same times.

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/process_mesh.h"
#include "collectives/sim/sim_communicator.h"
#include "collectives/sim/topology.h"
#include "gmock/gmock.h"
#include "runtime/virtual_time.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using ::testing::HasSubstr;

// 2 nodes x 4 devices: intra 100 GB/s, 2 us; 2 NICs of 50 GB/s per node (25 GB/s per device),
// 10 us.
std::shared_ptr<const Topology> TwoNodes() {
  Topology t;
  t.name = "2x4";
  t.nodes = 2;
  t.devices_per_node = 4;
  t.device_memory_bytes = uint64_t{16} << 30;
  t.compute_flops_per_s = 100e12;
  t.intra_node = {.bandwidth_bytes_per_s = 100e9, .latency_s = 2e-6};
  t.nics_per_node = 2;
  t.inter_node = {.bandwidth_bytes_per_s = 50e9, .latency_s = 10e-6};
  t.collectives = DefaultCollectiveAlgorithms();
  EXPECT_TRUE(ValidateTopology(t).ok()) << ValidateTopology(t);
  return std::make_shared<const Topology>(std::move(t));
}

SimOptions On(std::shared_ptr<const Topology> topology, std::vector<int> devices = {}) {
  SimOptions options;
  options.topology = std::move(topology);
  options.devices = std::move(devices);
  options.timeout = absl::Seconds(100);
  options.move_data = false;
  return options;
}

// Phantom buffers (move_data = false: never touched; the API only wants them non-null).
void* const kIn = reinterpret_cast<void*>(uintptr_t{1} << 40);
void* const kOut = reinterpret_cast<void*>(uintptr_t{2} << 40);

// A simulation of `n` ranks with `streams_per_rank` virtual streams each.
struct Sim {
  Sim(int n, SimOptions options, int streams_per_rank = 1)
      : timeline(*VirtualTimeline::Create({})) {
    absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> created =
        CreateSimCommunicators(*timeline, n, options);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) comms = *std::move(created);
    streams.resize(streams_per_rank);
    for (int s = 0; s < streams_per_rank; ++s) {
      for (int r = 0; r < n; ++r) {
        streams[s].push_back(
            *CreateVirtualStream(*timeline, {.name = absl::StrCat("rank", r, ".s", s)}));
      }
    }
  }
  ~Sim() {
    streams.clear();
    comms.clear();
  }
  void Delay(int s, int r, absl::Duration d) {
    StreamOp op;
    op.name = "compute";
    op.kind = StreamOpKind::kCompute;
    op.duration = d;
    EXPECT_TRUE(streams[s][r]->Submit(std::move(op)).ok());
  }
  // Dups of every rank's communicator, from this thread.
  std::vector<std::shared_ptr<Communicator>> Dups() {
    std::vector<std::shared_ptr<Communicator>> out;
    for (auto& c : comms) out.push_back(*c->Dup(absl::Now() + absl::Seconds(20)));
    return out;
  }

  std::unique_ptr<VirtualTimeline> timeline;
  std::vector<std::shared_ptr<Communicator>> comms;
  std::vector<std::vector<std::unique_ptr<Stream>>> streams;  // [stream][rank]
};

double DoneUs(const Work& work) {
  std::optional<absl::Time> at = work.event()->completed_at();
  EXPECT_TRUE(at.has_value());
  return at.has_value() ? absl::ToDoubleMicroseconds(*at - absl::UnixEpoch()) : -1;
}

// Times are absl::Durations (quarter-nanosecond ticks): compare to the microsecond formula
// within a nanosecond.
void ExpectUs(double got, double want) { EXPECT_NEAR(got, want, 1e-3) << want; }

CollectiveCost Cost(const Topology& t, CollectiveKind kind, size_t count, GroupShape g) {
  absl::StatusOr<CollectiveCost> c = EstimateCollective(t, kind, count, DType::kF32, g);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(SimTopologyTest, OptionErrors) {
  VirtualTimeline timeline;
  auto topo = TwoNodes();
  EXPECT_THAT(CreateSimCommunicators(timeline, 3, On(topo, {0, 1})).status().message(),
              HasSubstr("SimOptions.devices has 2 entries for a group of 3 ranks"));
  EXPECT_THAT(CreateSimCommunicators(timeline, 2, On(topo, {0, 8})).status().message(),
              HasSubstr("rank 1 is placed on device 8, outside the topology's devices 0..7"));
  EXPECT_THAT(CreateSimCommunicators(timeline, 2, On(topo, {5, 5})).status().message(),
              HasSubstr("already occupies"));
  EXPECT_THAT(CreateSimCommunicators(timeline, 9, On(topo)).status().message(),
              HasSubstr("device 8"));
  {  // No topology: no traffic accounting.
    absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> plain =
        CreateSimCommunicators(timeline, 2, SimOptions{});
    ASSERT_TRUE(plain.ok());
    EXPECT_TRUE(SimTrafficByDevice(*(*plain)[0]).empty());
  }
  SimOptions flat;
  flat.devices = {0, 1};
  EXPECT_THAT(CreateSimCommunicators(timeline, 2, flat).status().message(),
              HasSubstr("SimOptions.devices is set but SimOptions.topology is not"));
  Topology bad = *topo;
  bad.nics_per_node = 0;
  EXPECT_THAT(CreateSimCommunicators(timeline, 2, On(std::make_shared<const Topology>(bad)))
                  .status()
                  .message(),
              HasSubstr("field 'inter_node.nics_per_node'"));
}

// The world of 8 ranks spans both nodes: each collective completes at the model's time, one
// after the other on one stream; the all-gather goes hierarchical, and data still moves.
TEST(SimTopologyTest, WorldCollectivesTakeTheModelsTime) {
  auto topo = TwoNodes();
  SimOptions options = On(topo);
  options.move_data = true;
  Sim sim(8, options);
  const size_t count = 250001;  // odd; f32
  const GroupShape world{8, 2, 4};
  const CollectiveCost ag = Cost(*topo, CollectiveKind::kAllGather, count, world);
  const CollectiveCost ar = Cost(*topo, CollectiveKind::kAllReduce, count, world);
  EXPECT_EQ(ag.algorithm, CollectiveAlgorithm::kHierarchical);
  // Hand check of the hierarchy: L = 1 * 10us + 3 * 2us; p = 1000004 B over the network at
  // 25 GB/s, then 3 * 2 * p inside the node at 100 GB/s.
  ExpectUs(ag.seconds() * 1e6, 16 + 1000004 / 25e3 + 6 * 1000004 / 100e3);
  std::vector<std::vector<float>> in(8), out(8, std::vector<float>(count * 8));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<Work> gathers, reduces;
  std::vector<std::vector<float>> original(8);
  for (int r = 0; r < 8; ++r) {
    in[r].resize(count);
    for (float& x : in[r]) x = dist(rng);
    original[r] = in[r];
    gathers.push_back(*sim.comms[r]->AllGather(in[r].data(), out[r].data(), count, DType::kF32,
                                               *sim.streams[0][r]));
    reduces.push_back(*sim.comms[r]->AllReduce(in[r].data(), in[r].data(), count, DType::kF32,
                                               *sim.streams[0][r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < 8; ++r) {
    ExpectUs(DoneUs(gathers[r]), ag.seconds() * 1e6);
    ExpectUs(DoneUs(reduces[r]), (ag.seconds() + ar.seconds()) * 1e6);
  }
  // Traffic per device: both collectives' bytes per rank on each level.
  const std::vector<SimLinkTraffic> traffic = SimTrafficByDevice(*sim.comms[3]);
  ASSERT_EQ(traffic.size(), 8u);
  for (const SimLinkTraffic& t : traffic) {
    EXPECT_EQ(t.collectives, 2);
    EXPECT_DOUBLE_EQ(t.intra_node_bytes, ag.intra_bytes + ar.intra_bytes);
    EXPECT_DOUBLE_EQ(t.inter_node_bytes, ag.inter_bytes + ar.inter_bytes);
  }
  EXPECT_GT(ag.inter_bytes, 0);
  EXPECT_GT(ar.intra_bytes, 0);
  // Slice s of every rank's gather is rank s's input; the all-reduce is the rank-order sum.
  for (int r = 0; r < 8; ++r) {
    for (int s = 0; s < 8; ++s) {
      ASSERT_EQ(std::memcmp(out[r].data() + s * count, original[s].data(), count * sizeof(float)),
                0);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    float sum = original[0][i];
    for (int s = 1; s < 8; ++s) sum += original[s][i];
    for (int r = 0; r < 8; ++r) ASSERT_EQ(in[r][i], sum) << r << " " << i;
  }
}

// Two all-gathers on the same 4 ranks of one node (the world and its Dup, on two streams):
// together on the same ports, each gets half the bandwidth. Started together: both end at
// L + 2X. Staggered and unequal cases below.
TEST(SimTopologyTest, OverlappingCollectivesShareTheirPorts) {
  auto topo = TwoNodes();
  const size_t count = 1000000;  // p = 4 MB
  const CollectiveCost c = Cost(*topo, CollectiveKind::kAllGather, count, {4, 1, 4});
  const double L = c.latency_s * 1e6, X = c.transfer_s * 1e6;
  ExpectUs(L, 6);
  ExpectUs(X, 120);

  {  // Alone: L + X.
    Sim sim(4, On(topo));
    std::vector<Work> w;
    for (int r = 0; r < 4; ++r) {
      w.push_back(*sim.comms[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
    }
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    for (const Work& x : w) ExpectUs(DoneUs(x), L + X);
  }
  {  // Together: both share from L on, both end at L + 2X.
    Sim sim(4, On(topo), 2);
    auto dups = sim.Dups();
    std::vector<Work> a, b;
    for (int r = 0; r < 4; ++r) {
      a.push_back(*sim.comms[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
      b.push_back(*dups[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
    }
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    for (int r = 0; r < 4; ++r) {
      ExpectUs(DoneUs(a[r]), L + 2 * X);
      ExpectUs(DoneUs(b[r]), L + 2 * X);
    }
  }
  {  // Staggered by X/2: A alone on [L, L + X/2) moves X/2; both at 1/2 until A ends at
     // L + X/2 + 2 (X/2) = L + 1.5X, when B has moved X/2; B alone then ends at L + 2X.
    Sim sim(4, On(topo), 2);
    auto dups = sim.Dups();
    std::vector<Work> a, b;
    for (int r = 0; r < 4; ++r) {
      a.push_back(*sim.comms[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
      sim.Delay(1, r, absl::Microseconds(X / 2));
      b.push_back(*dups[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
    }
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    for (int r = 0; r < 4; ++r) {
      ExpectUs(DoneUs(a[r]), L + 1.5 * X);
      ExpectUs(DoneUs(b[r]), L + 2 * X);
    }
  }
  {  // Three at once, one of them half the size: the rule is the most flows on any port.
     // Shares 1/3 until the small one (X/2 of work) ends at L + 1.5X; the others, X/2 done,
     // then at 1/2: end at L + 1.5X + X = L + 2.5X.
    Sim sim(4, On(topo), 3);
    auto dups1 = sim.Dups();
    auto dups2 = sim.Dups();
    std::vector<Work> a, b, small;
    for (int r = 0; r < 4; ++r) {
      a.push_back(*sim.comms[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
      b.push_back(*dups1[r]->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
      small.push_back(*dups2[r]->AllGather(kIn, kOut, count / 2, DType::kF32, *sim.streams[2][r]));
    }
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    for (int r = 0; r < 4; ++r) {
      ExpectUs(DoneUs(small[r]), L + 1.5 * X);
      ExpectUs(DoneUs(a[r]), L + 2.5 * X);
      ExpectUs(DoneUs(b[r]), L + 2.5 * X);
    }
  }
}

// A message between the nodes takes the topology's cost of one message; two messages out of one
// device share its network port (L + 2X each); one between other devices does not.
TEST(SimTopologyTest, MessagesTakeTheModelsTimeAndShareTheirPorts) {
  auto topo = TwoNodes();
  const size_t count = 1000000;  // 4 MB
  const CollectiveCost c = Cost(*topo, CollectiveKind::kSend, count, {2, 2, 1});
  const double L = c.latency_s * 1e6, X = c.transfer_s * 1e6;
  EXPECT_GT(c.inter_bytes, 0);
  Sim sim(8, On(topo), 2);
  // Device 0 sends to 4 and 5 at once (sharing its port); device 1 sends to 6.
  std::vector<Work> received;
  ASSERT_TRUE(sim.comms[0]->Send(kIn, count, DType::kF32, 4, *sim.streams[0][0]).ok());
  ASSERT_TRUE(sim.comms[0]->Send(kIn, count, DType::kF32, 5, *sim.streams[1][0]).ok());
  ASSERT_TRUE(sim.comms[1]->Send(kIn, count, DType::kF32, 6, *sim.streams[0][1]).ok());
  for (int r : {4, 5, 6}) {
    received.push_back(
        *sim.comms[r]->Recv(kOut, count, DType::kF32, r == 6 ? 1 : 0, *sim.streams[0][r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  ExpectUs(DoneUs(received[0]), L + 2 * X);
  ExpectUs(DoneUs(received[1]), L + 2 * X);
  ExpectUs(DoneUs(received[2]), L + X);
  // The senders' traffic counts the network bytes.
  const std::vector<SimLinkTraffic> traffic = SimTrafficByDevice(*sim.comms[0]);
  EXPECT_DOUBLE_EQ(traffic[0].inter_node_bytes, 2 * c.inter_bytes);
  EXPECT_DOUBLE_EQ(traffic[1].inter_node_bytes, c.inter_bytes);
}

// Collectives on disjoint ports do not interfere: two all-gathers on the two halves of one node,
// and a network all-reduce next to an all-gather inside the node on other devices.
TEST(SimTopologyTest, DisjointPortsDoNotShare) {
  auto topo = TwoNodes();
  const size_t count = 1000000;
  // A world of 4 on devices {0, 1, 4, 5} (2 nodes x 2), split by threads into the mesh 2 x 2:
  // shard groups on devices {0,1} (node 0) and {4,5} (node 1), replicate groups {0,4}, {1,5}.
  SimOptions options = On(topo, {0, 1, 4, 5});
  options.dup_without_rendezvous = false;
  Sim sim(4, options, 2);
  std::vector<std::optional<ProcessMesh>> meshes(4);
  RunRankThreads(4, [&](int r) {
    absl::StatusOr<ProcessMesh> mesh =
        ProcessMesh::Create(sim.comms[r], 2, absl::Now() + absl::Seconds(20));
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    if (mesh.ok()) meshes[r] = *std::move(mesh);
  });
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(meshes[r].has_value());

  // The shard groups are inside one node each, the replicate groups across the nodes.
  const CollectiveCost shard_ag = Cost(*topo, CollectiveKind::kAllGather, count, {2, 1, 2});
  const CollectiveCost rep_ar = Cost(*topo, CollectiveKind::kAllReduce, count, {2, 2, 1});
  ASSERT_TRUE(shard_ag.uses_intra() && !shard_ag.uses_inter());
  ASSERT_TRUE(rep_ar.uses_inter() && !rep_ar.uses_intra());
  std::vector<Work> ag, ar;
  for (int r = 0; r < 4; ++r) {
    ag.push_back(*meshes[r]->shard()->AllGather(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
    ar.push_back(
        *meshes[r]->replicate()->AllReduce(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < 4; ++r) {
    // Both shard groups at once (disjoint devices), both replicate groups at once (disjoint
    // devices), and each next to the other level: nobody slows anybody.
    ExpectUs(DoneUs(ag[r]), shard_ag.seconds() * 1e6);
    ExpectUs(DoneUs(ar[r]), rep_ar.seconds() * 1e6);
  }
  // Traffic: the shard group's bytes stay inside the nodes, the replicate group's cross them;
  // devices 2, 3 (unused) sent nothing.
  const std::vector<SimLinkTraffic> traffic = SimTrafficByDevice(*meshes[0]->shard());
  ASSERT_EQ(traffic.size(), 6u);
  for (int d : {0, 1, 4, 5}) {
    EXPECT_DOUBLE_EQ(traffic[d].intra_node_bytes, shard_ag.intra_bytes) << d;
    EXPECT_DOUBLE_EQ(traffic[d].inter_node_bytes, rep_ar.inter_bytes) << d;
  }
  for (int d : {2, 3}) EXPECT_EQ(traffic[d].collectives, 0);
  // The replicate all-reduce: a ring of 2 over the network, 2 * 1 * 2 MB at 25 GB/s + 2 * 10us.
  ExpectUs(rep_ar.seconds() * 1e6, 20 + 2 * 2e6 / 25e3);

  // Two replicate all-reduces on the same column (the group and its Dup) do share: 2X.
  // (Every split of this simulation is a rendezvous of threads: dup_without_rendezvous = false.)
  std::vector<std::shared_ptr<Communicator>> rep_dups(4);
  RunRankThreads(2, [&](int i) {
    const int r = 2 * i;  // ranks 0 and 2: one replicate group
    absl::StatusOr<std::shared_ptr<Communicator>> dup =
        meshes[r]->replicate()->Dup(absl::Now() + absl::Seconds(20));
    EXPECT_TRUE(dup.ok()) << dup.status();
    if (dup.ok()) rep_dups[r] = *dup;
  });
  ASSERT_NE(rep_dups[0], nullptr);
  ASSERT_NE(rep_dups[2], nullptr);
  const double t0 = absl::ToDoubleMicroseconds(sim.timeline->Now() - absl::UnixEpoch());
  std::vector<Work> x, y;
  for (int r : {0, 2}) {
    x.push_back(
        *meshes[r]->replicate()->AllReduce(kIn, kOut, count, DType::kF32, *sim.streams[0][r]));
    y.push_back(*rep_dups[r]->AllReduce(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (size_t i = 0; i < x.size(); ++i) {
    ExpectUs(DoneUs(x[i]), t0 + rep_ar.latency_s * 1e6 + 2 * rep_ar.transfer_s * 1e6);
    ExpectUs(DoneUs(y[i]), t0 + rep_ar.latency_s * 1e6 + 2 * rep_ar.transfer_s * 1e6);
  }
}

// A busy schedule (three communicators, staggered, mixed kinds and sizes, both nodes) gives the
// same completion times, to the tick, every time.
TEST(SimTopologyTest, Deterministic) {
  auto run = [] {
    auto topo = TwoNodes();
    Sim sim(8, On(topo), 3);
    auto d1 = sim.Dups();
    auto d2 = sim.Dups();
    std::vector<absl::Time> times;
    std::vector<Work> works;
    std::mt19937 rng(99);
    for (int step = 0; step < 6; ++step) {
      const size_t count = 1000 + rng() % 100000;
      const absl::Duration delay = absl::Nanoseconds(rng() % 50000);
      for (int r = 0; r < 8; ++r) {
        sim.Delay(1, r, delay * (r % 3));
        works.push_back(
            *sim.comms[r]->AllGather(kIn, kOut, count, DType::kBF16, *sim.streams[0][r]));
        works.push_back(*d1[r]->AllReduce(kIn, kOut, count, DType::kF32, *sim.streams[1][r]));
        works.push_back(
            *d2[r]->ReduceScatter(kIn, kOut, count / 8 + 1, DType::kF32, *sim.streams[2][r]));
      }
    }
    EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
    for (const Work& w : works) times.push_back(*w.event()->completed_at());
    return times;
  };
  const std::vector<absl::Time> first = run();
  EXPECT_EQ(first.size(), 6u * 8 * 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(run(), first);
}

}  // namespace
}  // namespace shardline
