// Tests of runtime/allocator.h: exact accounting against a model kept by the test, zero-byte
// requests, alignment, ResourceExhausted, guarded release (test-controlled events and a real
// host stream), Buffer move semantics, destruction.

#include "runtime/allocator.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "tests/common/rank_threads.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using ::testing::HasSubstr;
using testing::ManualEvent;

// The counters as the test expects them, maintained independently of the allocator.
struct Model {
  int64_t current = 0, peak = 0, live = 0, total_allocs = 0, total_bytes = 0;
  void Alloc(int64_t n) {
    current += n;
    peak = std::max(peak, current);
    ++live;
    ++total_allocs;
    total_bytes += n;
  }
  void Free(int64_t n) {
    current -= n;
    --live;
  }
};

void ExpectStats(const Allocator& a, const Model& m) {
  const MemoryStats s = a.stats();
  EXPECT_EQ(s.current_bytes, m.current);
  EXPECT_EQ(s.peak_bytes, m.peak);
  EXPECT_EQ(s.live_allocations, m.live);
  EXPECT_EQ(s.total_allocations, m.total_allocs);
  EXPECT_EQ(s.total_bytes, m.total_bytes);
}

TEST(AllocatorTest, AccountingIsExactAcrossInterleavedAllocations) {
  auto alloc = CreateHostAllocator();
  Model m;
  absl::StatusOr<Buffer> a = alloc->Allocate(100);
  ASSERT_TRUE(a.ok());
  m.Alloc(100);
  absl::StatusOr<Buffer> b = alloc->Allocate(200);
  ASSERT_TRUE(b.ok());
  m.Alloc(200);
  ExpectStats(*alloc, m);
  a->Reset();
  m.Free(100);
  ExpectStats(*alloc, m);
  EXPECT_EQ(alloc->stats().peak_bytes, 300);

  absl::StatusOr<Buffer> c = alloc->Allocate(50);
  ASSERT_TRUE(c.ok());
  m.Alloc(50);
  ExpectStats(*alloc, m);

  alloc->ResetPeak();  // peak := current
  m.peak = m.current;
  ExpectStats(*alloc, m);

  alloc->ResetStats();  // peak := current, totals := live
  m.peak = m.current;
  m.total_allocs = m.live;
  m.total_bytes = m.current;
  ExpectStats(*alloc, m);
  EXPECT_EQ(alloc->stats().total_allocations, 2);
  EXPECT_EQ(alloc->stats().total_bytes, 250);

  b->Reset();
  m.Free(200);
  c = Buffer();  // move-assigning an empty buffer releases the old one
  m.Free(50);
  ExpectStats(*alloc, m);
  EXPECT_EQ(alloc->stats().current_bytes, 0);
  EXPECT_EQ(alloc->stats().peak_bytes, 250);
}

TEST(AllocatorTest, RandomSequenceMatchesModel) {
  auto alloc = CreateHostAllocator(64, "random");
  std::mt19937 rng(42);
  Model m;
  std::vector<Buffer> live;
  for (int step = 0; step < 2000; ++step) {
    const int action = rng() % 10;
    if (action < 6 || live.empty()) {
      const size_t n = rng() % 5000;  // includes 0
      absl::StatusOr<Buffer> b = alloc->Allocate(n);
      ASSERT_TRUE(b.ok());
      ASSERT_EQ(b->size(), n);
      if (n > 0) {
        m.Alloc(static_cast<int64_t>(n));
        std::memset(b->data(), 0xab, n);  // the memory is usable
      } else {
        EXPECT_TRUE(b->empty());
        EXPECT_EQ(b->data(), nullptr);
      }
      live.push_back(*std::move(b));
    } else if (action < 9) {
      const size_t i = rng() % live.size();
      if (live[i].size() > 0) m.Free(static_cast<int64_t>(live[i].size()));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (step % 2) {
      alloc->ResetPeak();
      m.peak = m.current;
    } else {
      alloc->ResetStats();
      m.peak = m.current;
      m.total_allocs = m.live;
      m.total_bytes = m.current;
    }
    ExpectStats(*alloc, m);
  }
  live.clear();
  m.current = 0;
  m.live = 0;
  ExpectStats(*alloc, m);
}

TEST(AllocatorTest, ZeroBytesIsAnEmptyBufferAndNotCounted) {
  auto alloc = CreateHostAllocator();
  absl::StatusOr<Buffer> b = alloc->Allocate(0);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->empty());
  EXPECT_EQ(b->data(), nullptr);
  const MemoryStats s = alloc->stats();
  EXPECT_EQ(s.total_allocations, 0);
  EXPECT_EQ(s.live_allocations, 0);
  b->ReleaseAfter(ManualEvent::Create());  // ignored for an empty buffer
  b->Reset();
  EXPECT_EQ(alloc->stats().live_allocations, 0);
}

TEST(AllocatorTest, Alignment) {
  for (size_t alignment : {size_t{1}, size_t{8}, size_t{64}, size_t{256}, size_t{4096}}) {
    auto alloc = CreateHostAllocator(alignment);
    std::vector<Buffer> keep;
    for (size_t n : {1, 3, 64, 1000, 4097, 1 << 20}) {
      absl::StatusOr<Buffer> b = alloc->Allocate(n);
      ASSERT_TRUE(b.ok());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % alignment, 0u)
          << "alignment " << alignment << " size " << n;
      EXPECT_EQ(b->device(), Device::Host());
      EXPECT_EQ(b->allocator(), alloc.get());
      keep.push_back(*std::move(b));
    }
  }
  // Default: 64 bytes.
  auto alloc = CreateHostAllocator();
  absl::StatusOr<Buffer> b = alloc->Allocate(5);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
}

TEST(AllocatorDeathTest, AlignmentMustBeAPowerOfTwo) {
  EXPECT_DEATH(CreateHostAllocator(48), "power of two");
}

TEST(AllocatorTest, AbsurdSizeIsResourceExhausted) {
  auto alloc = CreateHostAllocator(64, "big");
  absl::StatusOr<Buffer> keep = alloc->Allocate(123);
  ASSERT_TRUE(keep.ok());
  const MemoryStats before = alloc->stats();
  for (size_t n : {size_t{1} << 62, ~size_t{0}, ~size_t{0} - 63}) {
    absl::StatusOr<Buffer> b = alloc->Allocate(n);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
    EXPECT_THAT(b.status().message(), HasSubstr("'big'"));
    EXPECT_THAT(b.status().message(), HasSubstr(std::to_string(n)));
    EXPECT_THAT(b.status().message(), HasSubstr("in use: 123 bytes"));
  }
  const MemoryStats after = alloc->stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.total_allocations, before.total_allocations);
}

TEST(AllocatorTest, GuardedReleaseWaitsForEveryEvent) {
  auto alloc = CreateHostAllocator();
  auto e1 = ManualEvent::Create();
  auto e2 = ManualEvent::Create();
  absl::StatusOr<Buffer> b = alloc->Allocate(1000);
  ASSERT_TRUE(b.ok());
  b->ReleaseAfter(e1);
  b->ReleaseAfter(nullptr);  // ignored
  b->ReleaseAfter(e2);
  b->Reset();
  EXPECT_TRUE(b->empty());
  // Still counted: a stream may be reading it.
  EXPECT_EQ(alloc->stats().current_bytes, 1000);
  EXPECT_EQ(alloc->stats().live_allocations, 1);
  EXPECT_EQ(alloc->Collect(), 0);
  e1->Complete();
  EXPECT_EQ(alloc->Collect(), 0);  // e2 still pending
  EXPECT_EQ(alloc->stats().current_bytes, 1000);
  e2->Complete();
  EXPECT_EQ(alloc->Collect(), 1);
  EXPECT_EQ(alloc->stats().current_bytes, 0);
  EXPECT_EQ(alloc->stats().live_allocations, 0);
  EXPECT_EQ(alloc->Collect(), 0);
}

TEST(AllocatorTest, CompletedGuardFreesAtOnce) {
  auto alloc = CreateHostAllocator();
  auto e = ManualEvent::Create();
  e->Complete();
  absl::StatusOr<Buffer> b = alloc->Allocate(10);
  ASSERT_TRUE(b.ok());
  b->ReleaseAfter(e);
  b->Reset();
  EXPECT_EQ(alloc->stats().current_bytes, 0);
}

TEST(AllocatorTest, NextAllocateCollectsWithoutBlocking) {
  auto alloc = CreateHostAllocator();
  auto e = ManualEvent::Create();
  {
    absl::StatusOr<Buffer> b = alloc->Allocate(300);
    ASSERT_TRUE(b.ok());
    b->ReleaseAfter(e);
  }                                               // destroyed: pending
  absl::StatusOr<Buffer> c = alloc->Allocate(7);  // event not complete: nothing freed
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(alloc->stats().current_bytes, 307);
  EXPECT_EQ(alloc->pending_blocks(), 1);
  e->Complete();
  absl::StatusOr<Buffer> d = alloc->Allocate(8);  // collects the guarded block first
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(alloc->stats().current_bytes, 15);
  EXPECT_EQ(alloc->stats().peak_bytes, 307);  // the guarded block was freed before the 8
}

TEST(AllocatorTest, FailedGuardEventStillFreesTheBlock) {
  auto alloc = CreateHostAllocator();
  auto e = ManualEvent::Create();
  absl::StatusOr<Buffer> b = alloc->Allocate(64);
  ASSERT_TRUE(b.ok());
  b->ReleaseAfter(e);
  b->Reset();
  EXPECT_EQ(alloc->stats().live_allocations, 1);
  e->Fail(absl::InternalError("stream poisoned"));
  EXPECT_EQ(alloc->Collect(), 1);
  EXPECT_EQ(alloc->stats().live_allocations, 0);
}

// An event whose Query() reports its stream's failure while the captured work still runs
// (as a CUDA stream poisoned by a host function does, with kernels still in flight), and whose
// completion (OnComplete) comes only when the work has finished. A block guarded by it must stay
// allocated until then, not be freed when the failure is first reported.
class EarlyFailureEvent final : public Event {
 public:
  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream&) override { return absl::UnimplementedError("test double"); }
  absl::StatusOr<bool> Query() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return absl::InternalError("stream poisoned by a host function");
    return finished_;
  }
  absl::Status Synchronize(absl::Time) override { return Query().status(); }
  void OnComplete(EventCallback callback) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_) {
        callbacks_.push_back(std::move(callback));
        return;
      }
    }
    std::move(callback)(absl::InternalError("stream poisoned by a host function"));
  }
  void FailEarly() {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
  }
  void FinishWork() {
    std::vector<EventCallback> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = true;
      callbacks.swap(callbacks_);
    }
    for (auto& callback : callbacks) {
      std::move(callback)(absl::InternalError("stream poisoned by a host function"));
    }
  }

 private:
  std::mutex mu_;
  bool failed_ = false;
  bool finished_ = false;
  std::vector<EventCallback> callbacks_;
};

TEST(AllocatorTest, AFailedGuardKeepsItsBlockUntilItsWorkHasFinished) {
  auto alloc = CreateHostAllocator();
  auto event = std::make_shared<EarlyFailureEvent>();
  absl::StatusOr<Buffer> b = alloc->Allocate(4096);
  ASSERT_TRUE(b.ok());
  b->ReleaseAfter(event);
  b->Reset();
  event->FailEarly();  // the stream failed; its kernels still read the block
  EXPECT_EQ(alloc->Collect(), 0);
  EXPECT_EQ(alloc->stats().live_allocations, 1);
  absl::StatusOr<Buffer> other = alloc->Allocate(4096);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(alloc->stats().current_bytes, 8192) << "the failed guard's block was freed early";
  event->FinishWork();
  EXPECT_EQ(alloc->Collect(), 1);
  EXPECT_EQ(alloc->stats().current_bytes, 4096);
}

TEST(AllocatorTest, BufferMoveSemantics) {
  auto alloc = CreateHostAllocator();
  absl::StatusOr<Buffer> a = alloc->Allocate(10);
  ASSERT_TRUE(a.ok());
  void* p = a->data();
  Buffer moved(*std::move(a));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.size(), 10u);
  EXPECT_TRUE(a->empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a->allocator(), nullptr);
  absl::StatusOr<Buffer> other = alloc->Allocate(20);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(alloc->stats().current_bytes, 30);
  moved = *std::move(other);  // releases the 10-byte block
  EXPECT_EQ(alloc->stats().current_bytes, 20);
  EXPECT_EQ(moved.size(), 20u);
  // Guards move with the buffer.
  auto e = ManualEvent::Create();
  moved.ReleaseAfter(e);
  Buffer third = std::move(moved);
  third.Reset();
  EXPECT_EQ(alloc->stats().current_bytes, 20);
  e->Complete();
  alloc->Collect();
  EXPECT_EQ(alloc->stats().current_bytes, 0);
}

TEST(AllocatorTest, DestructorWaitsForGuardedBlocks) {
  auto alloc = CreateHostAllocator();
  auto e = ManualEvent::Create();
  {
    absl::StatusOr<Buffer> b = alloc->Allocate(100);
    ASSERT_TRUE(b.ok());
    b->ReleaseAfter(e);
  }
  std::thread completer([e] {
    absl::SleepFor(absl::Milliseconds(20));  // a delay the destructor must wait out
    e->Complete();
  });
  const absl::Time start = absl::Now();
  alloc.reset();  // blocks until the event completes
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(15));
  completer.join();
}

TEST(AllocatorDeathTest, DestroyingWithLiveBuffersIsABug) {
  EXPECT_DEATH(
      {
        auto alloc = CreateHostAllocator(64, "leaky");
        absl::StatusOr<Buffer> b = alloc->Allocate(10);
        Buffer* leaked = new Buffer(*std::move(b));
        (void)leaked;
        alloc.reset();
      },
      "leaky");
}

// The same guard with a real host stream: the block stays allocated while the stream's work
// that reads it has not run.
TEST(AllocatorTest, GuardedByRealHostStream) {
  auto alloc = CreateHostAllocator();
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "reader"});
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto gate = ManualEvent::Create();
  absl::StatusOr<Buffer> b = alloc->Allocate(4096);
  ASSERT_TRUE(b.ok());
  std::memset(b->data(), 1, 4096);
  std::byte* data = b->as<std::byte>();
  std::atomic<int> sum{0};
  // The "read" cannot run before the test opens the gate (bounded wait).
  ASSERT_TRUE((*stream)
                  ->Enqueue([gate, data, &sum]() -> absl::Status {
                    SL_RETURN_IF_ERROR(gate->Synchronize(absl::Now() + absl::Seconds(30)));
                    int s = 0;
                    for (int i = 0; i < 4096; ++i) s += static_cast<int>(data[i]);
                    sum = s;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(**stream);
  ASSERT_TRUE(done.ok());
  b->ReleaseAfter(*done);
  b->Reset();
  EXPECT_EQ(alloc->Collect(), 0);
  EXPECT_EQ(alloc->stats().current_bytes, 4096);
  gate->Complete();
  ASSERT_TRUE((*done)->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(sum.load(), 4096);
  EXPECT_EQ(alloc->Collect(), 1);
  EXPECT_EQ(alloc->stats().current_bytes, 0);
}

TEST(AllocatorTest, ConcurrentAllocationsAreCountedExactly) {
  auto alloc = CreateHostAllocator();
  constexpr int kThreads = 4;
  constexpr int kIters = 500;
  RunRankThreads(kThreads, [&](int t) {
    std::vector<Buffer> keep;
    for (int i = 0; i < kIters; ++i) {
      absl::StatusOr<Buffer> b = alloc->Allocate(static_cast<size_t>(1 + (i + t) % 97));
      ASSERT_TRUE(b.ok());
      keep.push_back(*std::move(b));
      if (keep.size() > 8) keep.erase(keep.begin());
    }
  });
  int64_t total_bytes = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kIters; ++i) total_bytes += 1 + (i + t) % 97;
  }
  const MemoryStats s = alloc->stats();
  EXPECT_EQ(s.current_bytes, 0);
  EXPECT_EQ(s.live_allocations, 0);
  EXPECT_EQ(s.total_allocations, kThreads * kIters);
  EXPECT_EQ(s.total_bytes, total_bytes);
}

TEST(AllocatorTest, CudaFactoriesWithoutCudaOrGpu) {
  absl::StatusOr<std::unique_ptr<Allocator>> pinned = CreatePinnedAllocator();
  absl::StatusOr<std::unique_ptr<Allocator>> cuda = CreateCudaAllocator(0);
#ifndef SHARDLINE_WITH_CUDA
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(cuda.status().message(), HasSubstr("without CUDA"));
#else
  if (!cuda.ok()) {
    // No GPU here: the error says so instead of crashing.
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable) << cuda.status();
    GTEST_SKIP() << "no CUDA device: " << cuda.status();
  }
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  for (Allocator* a : {pinned->get(), cuda->get()}) {
    absl::StatusOr<Buffer> b = a->Allocate(1 << 20);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->stats().current_bytes, 1 << 20);
    b->Reset();
    EXPECT_EQ(a->stats().current_bytes, 0);
  }
  EXPECT_EQ((*cuda)->device(), Device::Cuda(0));
  EXPECT_EQ(CreateCudaAllocator(1 << 20).status().code(), absl::StatusCode::kUnavailable);
#endif
}

}  // namespace
}  // namespace shardline
