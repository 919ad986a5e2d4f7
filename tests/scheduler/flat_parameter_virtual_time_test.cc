// FlatParameter on virtual time with phantom memory (review items a1, a2, a5): a test double of
// the simulator's stream — it advances a ManualClock by each op's declared cost and never runs
// the op — drives gathers and reductions of a unit whose memory comes from a phantom allocator
// (addresses without memory). If FlatParameter touched its memory anywhere but through stream
// ops, this would fault; the pool's exact accounting and the virtual time are checked against
// what the ops declare.

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "collectives/local/local_communicator.h"
#include "gtest/gtest.h"
#include "runtime/caching_pool.h"
#include "runtime/clock.h"
#include "runtime/flat_layout.h"
#include "runtime/phantom_allocator.h"
#include "runtime/stream.h"
#include "scheduler/flat_parameter.h"

namespace shardline {
namespace {

// Completes when recorded, at the recording stream's virtual time.
class VirtualEvent final : public Event {
 public:
  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream& stream) override;
  absl::StatusOr<bool> Query() override { return true; }
  absl::Status Synchronize(absl::Time) override { return absl::OkStatus(); }
  void OnComplete(EventCallback callback) override { std::move(callback)(absl::OkStatus()); }
  uint64_t recorded_stream_id() const override { return stream_id_; }
  std::optional<absl::Time> completed_at() const override { return at_; }

 private:
  uint64_t stream_id_ = 0;
  std::optional<absl::Time> at_;
};

// Runs nothing: each op costs bytes / bandwidth of virtual time on the stream's own timeline;
// a wait moves the timeline to the waited-for event's time. The shared ManualClock follows the
// latest timeline.
class VirtualStream final : public Stream {
 public:
  VirtualStream(std::string name, ManualClock& clock, double bytes_per_second)
      : name_(std::move(name)), clock_(clock), rate_(bytes_per_second) {}

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return name_; }
  const Clock& clock() const override { return clock_; }
  absl::Status Submit(StreamOp op) override {
    now_ += absl::Seconds(static_cast<double>(op.bytes) / rate_);
    clock_.Set(now_);
    ops.push_back({op.name, op.kind, op.bytes});
    return absl::OkStatus();  // `run` is never called: the memory may be phantom
  }
  absl::Status WaitEvent(Event& event) override {
    if (std::optional<absl::Time> at = event.completed_at(); at.has_value() && *at > now_) {
      now_ = *at;
    }
    return absl::OkStatus();
  }
  absl::Status Synchronize(absl::Time) override { return absl::OkStatus(); }
  absl::Status status() const override { return absl::OkStatus(); }
  std::shared_ptr<Event> CreateEvent() override { return std::make_shared<VirtualEvent>(); }
  absl::Time now() const { return now_; }

  struct Seen {
    std::string name;
    StreamOpKind kind;
    uint64_t bytes;
  };
  std::vector<Seen> ops;

 private:
  const std::string name_;
  ManualClock& clock_;
  const double rate_;
  absl::Time now_ = absl::UnixEpoch();
};

absl::Status VirtualEvent::Record(Stream& stream) {
  auto* virtual_stream = dynamic_cast<VirtualStream*>(&stream);
  if (virtual_stream == nullptr) return absl::InvalidArgumentError("not a virtual stream");
  stream_id_ = stream.id();
  at_ = virtual_stream->now();
  return absl::OkStatus();
}

// 64 ranks of a unit of 16 GiB (bf16 parameters, f32 master): one thread, phantom memory, no
// data moved. Every rank's pool holds exactly one unsharded copy and one gradient at the peak.
TEST(FlatParameterVirtualTimeTest, ManyRanksOfAHugeUnitOnPhantomMemory) {
  constexpr int kRanks = 64;
  constexpr int64_t kRows = 65536;
  constexpr int64_t kCols = 65536;  // 4 Gi elements
  const std::vector<TensorSpec> specs = {{.name = "w", .shape = {kRows, kCols}}};
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = kRanks});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const size_t total = layout->total_elements();
  const size_t shard = layout->shard_elements();
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
      CreateLocalCommunicators(kRanks, {.timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  const MixedPrecisionPolicy policy{DType::kBF16, DType::kF32, DType::kF32, false};
  ManualClock clock;
  constexpr double kRate = 100e9;  // bytes per virtual second
  for (int r = 0; r < kRanks; ++r) {
    std::unique_ptr<Allocator> phantom = CreatePhantomAllocator(Device::Host(), "phantom");
    CachingPool pool(*phantom);
    VirtualStream init("init", clock, kRate), gather("gather", clock, kRate),
        compute("compute", clock, kRate), reduce("reduce", clock, kRate);
    absl::StatusOr<std::unique_ptr<FlatParameter>> unit = FlatParameter::Create(
        *layout, r, policy,
        {.unsharded_pool = &pool, .shard_allocator = phantom.get(), .init_stream = &init});
    ASSERT_TRUE(unit.ok()) << unit.status();
    for (int step = 0; step < 2; ++step) {
      pool.ResetPeak();
      ASSERT_TRUE((*unit)->Gather(*(*comms)[r], gather).ok());
      ASSERT_TRUE((*unit)->WaitGathered(compute).ok());
      ASSERT_TRUE((*unit)->PrepareGrad(compute).ok());
      absl::StatusOr<std::shared_ptr<Event>> ready = RecordEvent(compute);
      ASSERT_TRUE(ready.ok());
      ASSERT_TRUE((*unit)->ReduceScatter(*(*comms)[r], reduce, *ready).ok());
      ASSERT_TRUE((*unit)->Accumulate(reduce).ok());
      ASSERT_TRUE((*unit)->WaitReduced(compute).ok());
      // Parameters and gradient in bf16, plus the gradient's f32 copy for the reduction.
      EXPECT_EQ(pool.stats().peak_bytes, static_cast<int64_t>(total * (2 + 2 + 4)));
      EXPECT_EQ(pool.stats().current_bytes, 0);
    }
    // Steady state: the second step reused every block.
    EXPECT_EQ(pool.cache_stats().misses, 3);
    EXPECT_EQ(phantom->stats().current_bytes,
              static_cast<int64_t>(shard * 4 * 2 + pool.cache_stats().reserved_bytes));
    if (r == 0) {
      // The costs the ops declared: a cast of the shard and the all-gather of the whole buffer
      // on the gather stream, per step.
      ASSERT_GE(gather.ops.size(), 4u);
      EXPECT_EQ(gather.ops[0].kind, StreamOpKind::kCast);
      EXPECT_EQ(gather.ops[0].bytes, shard * 4);
      EXPECT_EQ(gather.ops[1].kind, StreamOpKind::kCollective);
      EXPECT_EQ(gather.ops[1].bytes, total * 2);
      // Two steps of those, plus the second gather's waits: for the first gather (same stream,
      // none) and, through the pool's stream-ordered reuse, for the reduction that last used its
      // block.
      const absl::Duration own = absl::Seconds(static_cast<double>(shard * 4 + total * 2) / kRate);
      EXPECT_GT(gather.now() - absl::UnixEpoch(), 2 * own) << "the second gather did not wait";
      EXPECT_EQ(init.ops.size(), 1u);  // the master's zero-fill, never run
      EXPECT_EQ(init.ops[0].kind, StreamOpKind::kFill);
    }
    ASSERT_TRUE((*unit)->ReleaseShardGrad(nullptr).ok());
    unit->reset();
  }
  EXPECT_GT(clock.Now(), absl::UnixEpoch());
}

}  // namespace
}  // namespace shardline
