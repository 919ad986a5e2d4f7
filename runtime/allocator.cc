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

namespace shardline {

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

void Buffer::Reset() {
  if (allocator_ != nullptr && data_ != nullptr) {
    allocator_->Release(data_, size_, std::move(guards_));
  } else if (release_ != nullptr) {
    std::erase(guards_, nullptr);
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

struct Allocator::PendingSet {
  struct Block {
    void* data = nullptr;
    size_t bytes = 0;
    std::vector<std::shared_ptr<Event>> guards;
    std::vector<bool> completed;  // per guard
    size_t outstanding = 0;       // guards not completed
  };

  // Called by guard `index` of block `id` when it completes. Only bookkeeping: this may run on
  // a stream's worker or a CUDA callback thread, where freeing memory is not allowed.
  void GuardCompleted(uint64_t id, size_t index) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.find(id);
    if (it == blocks.end() || it->second.completed[index]) return;  // taken for reuse
    it->second.completed[index] = true;
    if (--it->second.outstanding == 0) {
      ++ready;
      cv.notify_all();
    }
  }

  // Moves the blocks whose guards all completed out of the set (mu held).
  void TakeReadyLocked(std::vector<Freed>& out) {
    // Most calls (every Allocate and guarded Release) find none ready: no walk over the set.
    if (ready == 0) return;
    for (auto it = blocks.begin(); it != blocks.end() && ready > 0;) {
      if (it->second.outstanding == 0) {
        out.push_back(Freed{it->second.data, it->second.bytes});
        it = blocks.erase(it);
        --ready;
      } else {
        ++it;
      }
    }
  }

  std::mutex mu;
  std::condition_variable cv;  // DrainPending waits for outstanding == 0
  uint64_t next_id = 0;
  std::map<uint64_t, Block> blocks;  // by id: oldest first
  size_t ready = 0;                  // blocks with outstanding == 0
};

Allocator::Allocator(Device device, std::string name)
    : device_(device), name_(std::move(name)), pending_(std::make_shared<PendingSet>()) {}

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
  std::vector<Freed> ready;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    pending_->TakeReadyLocked(ready);
  }
  const int n = static_cast<int>(ready.size());
  FreeBlocks(ready);
  return n;
}

int64_t Allocator::pending_blocks() const {
  std::lock_guard<std::mutex> lock(pending_->mu);
  return static_cast<int64_t>(pending_->blocks.size());
}

void Allocator::FreeBlocks(std::vector<Freed>& blocks) {
  if (blocks.empty()) return;
  int64_t bytes = 0;
  for (const Freed& block : blocks) {
    DeallocateRaw(block.data, block.bytes);
    bytes += static_cast<int64_t>(block.bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= bytes;
  stats_.live_allocations -= static_cast<int64_t>(blocks.size());
  blocks.clear();
}

void Allocator::Release(void* data, size_t bytes, std::vector<std::shared_ptr<Event>> guards) {
  std::erase(guards, nullptr);
  // The same event given twice (shared events: RecordSharedEvent) is one guard.
  for (size_t i = 1; i < guards.size();) {
    if (std::find(guards.begin(), guards.begin() + i, guards[i]) != guards.begin() + i) {
      guards.erase(guards.begin() + i);
    } else {
      ++i;
    }
  }
  if (guards.empty()) {
    std::vector<Freed> now{Freed{data, bytes}};
    FreeBlocks(now);
    return;
  }
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    id = pending_->next_id++;
    PendingSet::Block& block = pending_->blocks[id];
    block.data = data;
    block.bytes = bytes;
    block.completed.assign(guards.size(), false);
    block.outstanding = guards.size();
    block.guards = guards;
  }
  // Outside the lock: a guard that already completed calls back at once, on this thread.
  for (size_t i = 0; i < guards.size(); ++i) {
    guards[i]->OnComplete(
        [set = pending_, id, i](const absl::Status&) { set->GuardCompleted(id, i); });
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
                           [&](const auto& entry) { return fits(entry.second.bytes); });
    if (it == pending_->blocks.end()) return std::nullopt;
    PendingSet::Block& block = it->second;
    if (block.outstanding == 0) --pending_->ready;
    taken.data = block.data;
    taken.bytes = block.bytes;
    for (size_t i = 0; i < block.guards.size(); ++i) {
      if (!block.completed[i]) taken.outstanding.push_back(std::move(block.guards[i]));
    }
    pending_->blocks.erase(it);
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
  Release(block.data, block.bytes, std::move(block.outstanding));
}

void Allocator::DrainPending() {
  // One deadline for all blocks: a destructor blocks at most SHARDLINE_TIMEOUT_S in total.
  const absl::Time deadline = DefaultDeadline();
  std::vector<Freed> freeable;
  std::vector<Freed> leaked;
  {
    std::unique_lock<std::mutex> lock(pending_->mu);
    WallClock().WaitUntil(pending_->cv, lock, deadline, [&] {
      return std::all_of(pending_->blocks.begin(), pending_->blocks.end(),
                         [](const auto& entry) { return entry.second.outstanding == 0; });
    });
    pending_->TakeReadyLocked(freeable);
    for (auto& [id, block] : pending_->blocks) leaked.push_back(Freed{block.data, block.bytes});
    pending_->blocks.clear();
    pending_->ready = 0;
  }
  FreeBlocks(freeable);
  if (leaked.empty()) return;
  int64_t leaked_bytes = 0;
  for (const Freed& block : leaked) leaked_bytes += static_cast<int64_t>(block.bytes);
  SL_LOG(WARN, ALLOC) << "allocator '" << name_ << "': leaking " << leaked.size() << " block(s) of "
                      << leaked_bytes
                      << " bytes at destruction: their readers did not finish by the "
                         "SHARDLINE_TIMEOUT_S deadline";
  // Leaked blocks are gone from this allocator's point of view.
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= leaked_bytes;
  stats_.live_allocations -= static_cast<int64_t>(leaked.size());
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
    absl::StatusOr<int64_t> bytes = ParamHostShareableBytes().Get();
    if (!bytes.ok() || alignment > static_cast<size_t>(sysconf(_SC_PAGESIZE))) return 0;
    return static_cast<size_t>(*bytes);
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
