// Destroying a scheduler (or a pool) while streams still use its memory never aborts the process
// and never frees memory under a reader (issue 27, case 5): what the drain cannot wait out by the
// SHARDLINE_TIMEOUT_S deadline is leaked — warned about and counted in MemoryStats::leaked_*.
// The deadline is 1 s in this binary (set before anything reads it), so that the leak path runs
// in a second. Destroying schedulers on virtual time mid-step is in scheduler_property_test.cc.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/caching_pool.h"
#include "runtime/status.h"
#include "scheduler/scheduler.h"
#include "tests/common/gate.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

// Before main: knobs are read once and cached.
const bool kShortTimeout = [] { return setenv("SHARDLINE_TIMEOUT_S", "1", 1) == 0; }();

float Value(size_t i) { return 0.25f + static_cast<float>((i * 2654435761u) % 1000) * 1e-3f; }

TEST(SchedulerTeardownTest, DestroyingTheSchedulerWhileComputeReadsAViewLeaksTheBlock) {
  ASSERT_TRUE(kShortTimeout);
  auto comms = CreateLocalCommunicators(1);
  ASSERT_OK(comms.status());
  auto compute = CreateHostStream({.name = "compute"});
  ASSERT_OK(compute.status());
  auto sched = Scheduler::Create((*comms)[0], **compute, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(sched.status());
  constexpr size_t kElements = 1001;
  ASSERT_OK(
      (*sched)->RegisterUnit({.name = "u0", .tensors = {{.name = "w", .shape = {1001}}}}).status());
  std::vector<float> init(kElements);
  for (size_t i = 0; i < kElements; ++i) init[i] = Value(i);
  const void* tensors[] = {init.data()};
  ASSERT_OK((*sched)->unit(0).SetShardFromTensors(tensors, absl::Now() + absl::Seconds(10)));

  ASSERT_OK((*sched)->PreForward(0));
  auto view = (*sched)->unit(0).View(0);
  ASSERT_OK(view.status());
  const float* data = static_cast<const float*>(view->data);
  // The framework's compute reads the view long after the scheduler is gone: it is held until
  // the gate opens, after the destruction.
  auto gate = std::make_shared<testing::Gate>();
  auto mismatches = std::make_shared<int>(-1);
  ASSERT_OK((*compute)->Enqueue([gate, data, mismatches] {
    gate->Wait();
    int wrong = 0;
    for (size_t i = 0; i < kElements; ++i) wrong += data[i] != Value(i) ? 1 : 0;
    *mismatches = wrong;
    return absl::OkStatus();
  }));
  const absl::Time start = absl::Now();
  sched->reset();  // before: the pool's CHECK aborted the process here
  const absl::Duration took = absl::Now() - start;
  // The drain waited for the reader until the 1 s deadline, then leaked the block.
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Seconds(10));
  gate->Open();
  ASSERT_OK((*compute)->Synchronize(absl::Now() + absl::Seconds(30)));
  // The leaked memory was never freed or reused: the reader saw the gathered values (under
  // AddressSanitizer a freed block would be a use-after-free report).
  EXPECT_EQ(*mismatches, 0);
}

TEST(SchedulerTeardownTest, APoolDestroyedWithAnUnfinishedReaderCountsTheLeakInItsBacking) {
  auto backing = CreateHostAllocator(64, "backing");
  auto stream = CreateHostStream({.name = "reader"});
  ASSERT_OK(stream.status());
  auto gate = std::make_shared<testing::Gate>();
  {
    CachingPool pool(*backing, {.name = "pool"});
    auto block = pool.Allocate(4096);
    ASSERT_OK(block.status());
    ASSERT_OK((*stream)->Enqueue([gate] {
      gate->Wait();
      return absl::OkStatus();
    }));
    auto read = RecordEvent(**stream);
    ASSERT_OK(read.status());
    block->ReleaseAfter(*read);
    *block = Buffer();  // returned, guarded by the reader's event
    EXPECT_EQ(pool.pending_blocks(), 1);
  }  // the pool's drain runs out (1 s), leaks the block; before: CHECK failure
  const MemoryStats stats = backing->stats();
  EXPECT_EQ(stats.leaked_blocks, 1);
  EXPECT_EQ(stats.leaked_bytes, 4096);
  EXPECT_EQ(stats.live_allocations, 0);
  EXPECT_EQ(stats.current_bytes, 0);
  gate->Open();
  ASSERT_OK((*stream)->Synchronize(absl::Now() + absl::Seconds(30)));
  backing.reset();  // nothing counts as alive: no CHECK failure
}

}  // namespace
}  // namespace shardline
