// Buffer, the Allocator base (accounting and guarded release) and the host allocator. The CUDA
// allocators live in runtime/cuda/cuda_allocator.cc; without CUDA their factories are here.

#include "runtime/allocator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/clock.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/shared_memory.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace shardline {
namespace {

// A block leaked on purpose (a stream may still use it: see Buffer::Leak) is not a leak for
// LeakSanitizer. Memory that is not a heap block (a shareable arena's) is ignored by it too.
void IgnoreLeak(const void* data) {
#if defined(__SANITIZE_ADDRESS__)
  __lsan_ignore_object(data);
#else
  (void)data;
#endif
}

}  // namespace

// ---- Buffer ----------------------------------------------------------------------------------

Buffer::Buffer(Buffer&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      guards_(std::move(other.guards_)),
      device_(other.device_),
      release_(std::move(other.release_)) {
  other.guards_.clear();
  other.release_ = nullptr;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    guards_ = std::move(other.guards_);
    other.guards_.clear();
    device_ = other.device_;
    release_ = std::move(other.release_);
    other.release_ = nullptr;
  }
  return *this;
}

Buffer::~Buffer() { Reset(); }

Buffer Buffer::Adopt(void* data, size_t size, Device device, ReleaseFn release) {
  Buffer buffer;
  buffer.data_ = data;
  buffer.size_ = data == nullptr ? 0 : size;
  buffer.device_ = device;
  buffer.release_ = std::move(release);
  return buffer;
}

Buffer Buffer::View(void* data, size_t size, Device device) {
  return Adopt(data, size, device, nullptr);
}

Device Buffer::device() const { return allocator_ != nullptr ? allocator_->device() : device_; }

void Buffer::ReleaseAfter(std::shared_ptr<Event> event) {
  if (event != nullptr && data_ != nullptr && (allocator_ != nullptr || release_ != nullptr)) {
    guards_.push_back(std::move(event));
  }
}

namespace {

// Runs an adopted buffer's release once its last guard completed.
struct AdoptedRelease {
  std::mutex mu;
  size_t left = 0;
  void* data = nullptr;
  Buffer::ReleaseFn release;

  void GuardCompleted() {
    Buffer::ReleaseFn run;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (--left > 0) return;
      run = std::move(release);
    }
    std::move(run)(data);
  }
};

}  // namespace

void Buffer::Leak() {
  if (allocator_ != nullptr && data_ != nullptr) allocator_->CountLeaked(size_);
  if (data_ != nullptr) IgnoreLeak(data_);
  release_ = nullptr;  // adopted memory: its release never runs
  allocator_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  guards_.clear();
}

void Allocator::CountLeaked(size_t bytes) {
  SL_LOG(WARN, ALLOC) << "allocator '" << name_ << "': leaking a block of " << bytes
                      << " bytes that a stream may still use";
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= static_cast<int64_t>(bytes);
  --stats_.live_allocations;
  ++stats_.leaked_blocks;
  stats_.leaked_bytes += static_cast<int64_t>(bytes);
}

void Buffer::Reset() {
  if (allocator_ != nullptr && data_ != nullptr) {
    allocator_->Release(data_, size_, guards_);
  } else if (release_ != nullptr) {
    guards_.erase(std::remove(guards_.begin(), guards_.end(), nullptr), guards_.end());
    if (guards_.empty()) {
      std::move(release_)(data_);
    } else {
      auto state = std::make_shared<AdoptedRelease>();
      state->data = data_;
      state->release = std::move(release_);
      // One extra count, dropped below, so that guards completing during registration cannot
      // release before every guard is registered.
      state->left = guards_.size() + 1;
      for (const std::shared_ptr<Event>& guard : guards_) {
        guard->OnComplete([state](const absl::Status&) { state->GuardCompleted(); });
      }
      state->GuardCompleted();
    }
  }
  release_ = nullptr;
  allocator_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  guards_.clear();
}

// ---- Allocator -------------------------------------------------------------------------------

// The pending blocks live in nodes that are recycled, so that a guarded release allocates nothing
// once the set has warmed up; each guard's completion callback refers to its block by one pointer
// (GuardCallback), small enough for the EventCallback's inline storage.
//
// A node is held by the set while its block is pending and by each registered callback until the
// callback is destroyed (run or not); it is recycled once nobody holds it. The set lives until the
// allocator is gone and no node is held, so a callback that runs late (after its block was taken
// for reuse, or after the allocator was destroyed) only updates the set.
struct Allocator::PendingSet {
  struct Guard {
    std::shared_ptr<Event> event;
    bool completed = false;
  };
  struct Block {
    PendingSet* set = nullptr;
    void* data = nullptr;
    size_t bytes = 0;
    std::vector<Guard> guards;  // keeps its capacity across the node's uses
    size_t outstanding = 0;     // guards not completed
    int holds = 0;              // the set's (while pending) + one per callback alive
    bool pending = false;       // in `blocks`: callbacks of a block taken out change nothing
  };

  // The completion callback of guard `index` of `block`.
  class GuardCallback {
   public:
    GuardCallback(Block* block, size_t index) : block_(block), index_(index) {}
    GuardCallback(GuardCallback&& other) noexcept
        : block_(std::exchange(other.block_, nullptr)), index_(other.index_) {}
    GuardCallback& operator=(GuardCallback&&) = delete;
    // A callback dropped unrun (its event will never complete) leaves the guard outstanding.
    ~GuardCallback() {
      if (block_ != nullptr) block_->set->Drop(block_, index_, /*completed=*/false);
    }
    void operator()(const absl::Status&) && {
      Block* block = std::exchange(block_, nullptr);
      block->set->Drop(block, index_, /*completed=*/true);
    }

   private:
    Block* block_;
    size_t index_;
  };

  // A callback of guard `index` of `block` is done with it: run (`completed`) or dropped. Only
  // bookkeeping: this may run on a stream's worker or a CUDA callback thread, where freeing
  // memory is not allowed.
  void Drop(Block* block, size_t index, bool completed) {
    bool destroy = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (completed && block->pending && !block->guards[index].completed) {
        block->guards[index].completed = true;
        if (--block->outstanding == 0) {
          SetReadyLocked(ready + 1);
          cv.notify_all();
        }
      }
      destroy = UnholdLocked(block);
    }
    if (destroy) delete this;
  }

  // A pending block of `bytes` at `data`, without guards yet, held by the set (mu held).
  Block* NewBlockLocked(void* data, size_t bytes) {
    Block* block = nullptr;
    if (free.empty()) {
      nodes.push_back(std::make_unique<Block>());
      block = nodes.back().get();
      block->set = this;
    } else {
      block = free.back();
      free.pop_back();
    }
    ++held_nodes;
    block->data = data;
    block->bytes = bytes;
    block->pending = true;
    block->holds = 1;
    blocks.push_back(block);
    return block;
  }

  // Drops one hold of `block`, recycling its node when it was the last (mu held). True if the
  // set must now be deleted (by the caller, after unlocking).
  bool UnholdLocked(Block* block) {
    if (--block->holds > 0) return false;
    free.push_back(block);
    --held_nodes;
    return owner_gone && held_nodes == 0;
  }

  // Takes a pending block out of the set; its guards' late callbacks change nothing (mu held).
  // Only the allocator calls this: the set outlives it.
  void RemoveLocked(std::vector<Block*>::iterator it) {
    Block* block = *it;
    blocks.erase(it);
    if (block->outstanding == 0) SetReadyLocked(ready - 1);
    block->pending = false;
    block->guards.clear();
    (void)UnholdLocked(block);
  }

  // Moves the blocks whose guards all completed out of the set (mu held).
  template <typename Out>
  void TakeReadyLocked(Out& out) {
    // Most calls (every Allocate and guarded Release) find none ready: no walk over the set.
    for (size_t i = 0; i < blocks.size() && ready > 0;) {
      Block* block = blocks[i];
      if (block->outstanding == 0) {
        out.push_back(Freed{block->data, block->bytes});
        RemoveLocked(blocks.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }

  // `ready` := n (mu held), and its copy that Collect reads without the lock.
  void SetReadyLocked(size_t n) {
    ready = n;
    any_ready.store(n > 0, std::memory_order_release);
  }

  std::mutex mu;
  std::condition_variable cv;  // DrainPending waits for outstanding == 0
  std::vector<Block*> blocks;  // pending, oldest first
  size_t ready = 0;            // blocks with outstanding == 0 (SetReadyLocked)
  // ready > 0, readable without mu: most Collect calls (every Allocate and guarded Release)
  // find nothing ready and take no lock. One that misses a block made ready meanwhile leaves it
  // to the next call.
  std::atomic<bool> any_ready{false};
  std::vector<std::unique_ptr<Block>> nodes;
  std::vector<Block*> free;  // nodes nobody holds
  size_t held_nodes = 0;     // nodes.size() - free.size()
  bool owner_gone = false;   // the allocator was destroyed
};

void Allocator::PendingSetDeleter::operator()(PendingSet* set) const {
  bool destroy = false;
  {
    std::lock_guard<std::mutex> lock(set->mu);
    set->owner_gone = true;
    destroy = set->held_nodes == 0;
  }
  if (destroy) delete set;
}

Allocator::Allocator(Device device, std::string name)
    : device_(device), name_(std::move(name)), pending_(new PendingSet) {}

Allocator::~Allocator() {
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    SL_CHECK(pending_->blocks.empty())
        << "allocator '" << name_ << "' destroyed with " << pending_->blocks.size()
        << " guarded blocks pending: its implementation must call DrainPending() in its "
           "destructor";
  }
  std::lock_guard<std::mutex> lock(mu_);
  SL_CHECK(stats_.live_allocations == 0)
      << "allocator '" << name_ << "' destroyed while " << stats_.live_allocations << " buffers ("
      << stats_.current_bytes << " bytes) from it are alive";
}

absl::StatusOr<Buffer> Allocator::Allocate(size_t bytes) { return AllocateImpl(bytes, nullptr); }

absl::StatusOr<Buffer> Allocator::Allocate(size_t bytes, Stream& first_user) {
  return AllocateImpl(bytes, &first_user);
}

absl::StatusOr<Buffer> Allocator::AllocateImpl(size_t bytes, Stream* first_user) {
  if (bytes == 0) return Buffer();
  // Blocks whose readers finished are freed first, so their memory (for a pool: the very same
  // blocks) is available to this request.
  Collect();
  absl::StatusOr<void*> data = AllocateRaw(bytes, first_user);
  if (!data.ok()) {
    const MemoryStats s = stats();
    return absl::Status(
        data.status().code(),
        absl::StrCat("allocator '", name_, "' (", device_.ToString(), "): cannot allocate ", bytes,
                     " bytes (in use: ", s.current_bytes, " bytes in ", s.live_allocations,
                     " allocations, peak ", s.peak_bytes, " bytes): ", data.status().message()));
  }
  SL_CHECK(*data != nullptr) << "allocator '" << name_ << "' returned null for " << bytes
                             << " bytes";
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.current_bytes += static_cast<int64_t>(bytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
    ++stats_.live_allocations;
    ++stats_.total_allocations;
    stats_.total_bytes += static_cast<int64_t>(bytes);
  }
  return Buffer(this, *data, bytes);
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Allocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.current_bytes;
}

void Allocator::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.current_bytes;
  stats_.total_allocations = stats_.live_allocations;
  stats_.total_bytes = stats_.current_bytes;
  stats_.stream_ordered_reuses = 0;
}

int Allocator::Collect() {
  if (!pending_->any_ready.load(std::memory_order_acquire)) return 0;
  absl::InlinedVector<Freed, 8> ready;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    pending_->TakeReadyLocked(ready);
  }
  FreeBlocks(ready);
  return static_cast<int>(ready.size());
}

int64_t Allocator::pending_blocks() const {
  std::lock_guard<std::mutex> lock(pending_->mu);
  return static_cast<int64_t>(pending_->blocks.size());
}

void Allocator::FreeBlocks(absl::Span<const Freed> blocks) {
  if (blocks.empty()) return;
  int64_t bytes = 0;
  for (const Freed& block : blocks) {
    DeallocateRaw(block.data, block.bytes);
    bytes += static_cast<int64_t>(block.bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= bytes;
  stats_.live_allocations -= static_cast<int64_t>(blocks.size());
}

void Allocator::Release(void* data, size_t bytes, absl::Span<const std::shared_ptr<Event>> guards) {
  // The guards that count: not null, and the same event given twice (shared events:
  // RecordSharedEvent) is one guard. Both loops below walk them in the same order.
  auto counts = [&](size_t i) {
    return guards[i] != nullptr &&
           std::find(guards.begin(), guards.begin() + static_cast<std::ptrdiff_t>(i), guards[i]) ==
               guards.begin() + static_cast<std::ptrdiff_t>(i);
  };
  size_t n = 0;
  for (size_t i = 0; i < guards.size(); ++i) n += counts(i) ? 1 : 0;
  if (n == 0) {
    FreeBlocks({Freed{data, bytes}});
    return;
  }
  PendingSet::Block* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    block = pending_->NewBlockLocked(data, bytes);
    for (size_t i = 0; i < guards.size(); ++i) {
      if (counts(i)) block->guards.push_back(PendingSet::Guard{guards[i], false});
    }
    block->outstanding = n;
    // The callbacks' holds, taken now: the node stays ours until they are registered.
    block->holds += static_cast<int>(n);
  }
  // Outside the lock: a guard that already completed calls back at once, on this thread. The
  // events are the caller's (`guards`), not the block's, which another thread may take meanwhile.
  for (size_t i = 0, index = 0; i < guards.size(); ++i) {
    if (counts(i)) guards[i]->OnComplete(PendingSet::GuardCallback(block, index++));
  }
  // Most releases are unguarded or their readers are already done: free those at once.
  Collect();
}

std::optional<Allocator::PendingBlock> Allocator::TakePending(
    absl::FunctionRef<bool(size_t)> fits) {
  PendingBlock taken;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    auto it = std::find_if(pending_->blocks.begin(), pending_->blocks.end(),
                           [&](const PendingSet::Block* block) { return fits(block->bytes); });
    if (it == pending_->blocks.end()) return std::nullopt;
    PendingSet::Block& block = **it;
    taken.data = block.data;
    taken.bytes = block.bytes;
    for (PendingSet::Guard& guard : block.guards) {
      if (!guard.completed) taken.outstanding.push_back(std::move(guard.event));
    }
    pending_->RemoveLocked(it);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= static_cast<int64_t>(taken.bytes);
  --stats_.live_allocations;
  ++stats_.stream_ordered_reuses;
  return taken;
}

void Allocator::ReturnPending(PendingBlock block) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.current_bytes += static_cast<int64_t>(block.bytes);
    ++stats_.live_allocations;
    --stats_.stream_ordered_reuses;
  }
  Release(block.data, block.bytes, block.outstanding);
}

void Allocator::DrainPending() {
  // One deadline for all blocks: a destructor blocks at most SHARDLINE_TIMEOUT_S in total.
  const absl::Time deadline = DefaultDeadline();
  // Each outstanding guard is synchronized, not waited for on a condition: a virtual-time
  // event completes only when some thread drives its timeline, which Synchronize does (and a
  // stalled timeline answers at once, instead of the wall clock running out).
  std::vector<std::shared_ptr<Event>> outstanding;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    for (const PendingSet::Block* block : pending_->blocks) {
      for (const PendingSet::Guard& guard : block->guards) {
        if (!guard.completed) outstanding.push_back(guard.event);
      }
    }
  }
  for (const std::shared_ptr<Event>& event : outstanding) {
    if (absl::Now() >= deadline) break;
    event->Synchronize(deadline).IgnoreError();  // a failed reader has finished all the same
  }
  outstanding.clear();
  std::vector<Freed> freeable;
  std::vector<Freed> leaked;
  {
    std::unique_lock<std::mutex> lock(pending_->mu);
    pending_->TakeReadyLocked(freeable);
    while (!pending_->blocks.empty()) {
      const PendingSet::Block& block = *pending_->blocks.back();
      leaked.push_back(Freed{block.data, block.bytes});
      pending_->RemoveLocked(pending_->blocks.end() - 1);
    }
  }
  FreeBlocks(freeable);
  if (leaked.empty()) return;
  int64_t leaked_bytes = 0;
  for (const Freed& block : leaked) leaked_bytes += static_cast<int64_t>(block.bytes);
  SL_LOG(WARN, ALLOC) << "allocator '" << name_ << "': leaking " << leaked.size() << " block(s) of "
                      << leaked_bytes
                      << " bytes at destruction: their readers did not finish by the "
                         "SHARDLINE_TIMEOUT_S deadline (or wait for work that will never run)";
  for (const Freed& block : leaked) {
    IgnoreLeak(block.data);
    LeakRaw(block.data, block.bytes);
  }
  // Leaked blocks are gone from this allocator's point of view.
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= leaked_bytes;
  stats_.live_allocations -= static_cast<int64_t>(leaked.size());
  stats_.leaked_blocks += static_cast<int64_t>(leaked.size());
  stats_.leaked_bytes += leaked_bytes;
}

// ---- Host allocator --------------------------------------------------------------------------

namespace {

// No machine maps more than 2^47 bytes of user address space; larger requests fail here,
// without asking malloc (sanitizer allocators abort on absurd sizes instead of failing).
constexpr size_t kMaxHostAllocation = size_t{1} << 47;

class HostAllocator final : public Allocator {
 public:
  HostAllocator(size_t alignment, std::string name, bool shareable)
      : Allocator(Device::Host(), std::move(name)),
        alignment_(std::max(alignment, sizeof(void*))),
        shareable_bytes_(shareable ? ShareableThreshold(alignment_) : 0) {}
  ~HostAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* /*first_user*/) override {
    if (bytes > kMaxHostAllocation) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "more than the largest possible host allocation (", kMaxHostAllocation, " bytes)"));
    }
    if (shareable_bytes_ > 0 && bytes >= shareable_bytes_) {
      absl::StatusOr<void*> shared = AllocateShareable(bytes);
      if (shared.ok()) return shared;
      // No arena could be created or grown (address space or memory-file space): private
      // memory still works (peers then read it with process_vm_readv). Said once per allocator.
      if (!said_private_.exchange(true)) {
        SL_LOG(INFO, ALLOC) << "host allocator '" << name() << "': " << shared.status().message()
                            << "; large allocations that do not fit use private memory";
      }
    }
    void* data = nullptr;
    // posix_memalign, unlike aligned_alloc, takes any size, not only multiples of the alignment.
    const int rc = posix_memalign(&data, alignment_, bytes);
    if (rc != 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("posix_memalign(alignment=", alignment_, "): ", std::strerror(rc)));
    }
    return data;
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    // Private memory is never inside an arena.
    if (shareable_bytes_ > 0 && bytes >= shareable_bytes_ && FindShareable(data, 1)) {
      return FreeShareable(data, bytes);
    }
    std::free(data);
  }

 private:
  // Arena blocks are page-aligned: larger alignments take private memory.
  static size_t ShareableThreshold(size_t alignment) {
    if (alignment > static_cast<size_t>(sysconf(_SC_PAGESIZE))) return 0;
    return static_cast<size_t>(ParamHostShareableBytes().GetOrDefault());
  }

  size_t alignment_;
  size_t shareable_bytes_;  // 0: never shareable
  std::atomic<bool> said_private_{false};
};

}  // namespace

std::unique_ptr<Allocator> CreateHostAllocator(size_t alignment, std::string name) {
  SL_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0)
      << "CreateHostAllocator: alignment must be a power of two, got " << alignment;
  return std::make_unique<HostAllocator>(alignment, std::move(name), /*shareable=*/false);
}

std::unique_ptr<Allocator> CreateShareableHostAllocator(size_t alignment, std::string name) {
  SL_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0)
      << "CreateShareableHostAllocator: alignment must be a power of two, got " << alignment;
  return std::make_unique<HostAllocator>(alignment, std::move(name), /*shareable=*/true);
}

#ifndef SHARDLINE_WITH_CUDA
absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedAllocator(std::string name) {
  return absl::UnimplementedError("shardline was built without CUDA");
}
absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device_index, std::string name) {
  return absl::UnimplementedError("shardline was built without CUDA");
}
#endif  // SHARDLINE_WITH_CUDA

}  // namespace shardline
