// Buffer, the Allocator base (accounting and guarded release) and the host allocator. The CUDA
// allocators live in runtime/cuda/cuda_allocator.cc; without CUDA their factories are here.

#include "runtime/allocator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/shared_memory.h"

namespace shardline {
namespace {

// True if `event` no longer holds its block back. A failed event frees the block too: the work
// it captured will not run any more (its stream is poisoned), so nothing reads the memory.
bool GuardDone(Event& event, const std::string& allocator_name) {
  absl::StatusOr<bool> done = event.Query();
  if (done.ok()) return *done;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    SL_LOG(WARN, ALLOC) << "allocator '" << allocator_name
                        << "': a guard event of a released buffer failed (" << done.status()
                        << "); freeing the block anyway (logged once)";
  }
  return true;
}

// Drops the completed (and null) guards; true if none is left.
bool DropDoneGuards(std::vector<std::shared_ptr<Event>>& guards, const std::string& name) {
  std::erase_if(
      guards, [&](const std::shared_ptr<Event>& e) { return e == nullptr || GuardDone(*e, name); });
  return guards.empty();
}

}  // namespace

// ---- Buffer ----------------------------------------------------------------------------------

Buffer::Buffer(Buffer&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      guards_(std::move(other.guards_)) {
  other.guards_.clear();
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    guards_ = std::move(other.guards_);
    other.guards_.clear();
  }
  return *this;
}

Buffer::~Buffer() { Reset(); }

Device Buffer::device() const {
  return allocator_ != nullptr ? allocator_->device() : Device::Host();
}

void Buffer::ReleaseAfter(std::shared_ptr<Event> event) {
  if (event != nullptr && data_ != nullptr) guards_.push_back(std::move(event));
}

void Buffer::Reset() {
  if (allocator_ != nullptr && data_ != nullptr) {
    allocator_->Release(data_, size_, std::move(guards_));
  }
  allocator_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  guards_.clear();
}

// ---- Allocator -------------------------------------------------------------------------------

Allocator::Allocator(Device device, std::string name) : device_(device), name_(std::move(name)) {}

Allocator::~Allocator() {
  std::lock_guard<std::mutex> lock(mu_);
  SL_CHECK(pending_.empty()) << "allocator '" << name_ << "' destroyed with " << pending_.size()
                             << " guarded blocks pending: its implementation must call "
                                "DrainPending() in its destructor";
  SL_CHECK(stats_.live_allocations == 0)
      << "allocator '" << name_ << "' destroyed while " << stats_.live_allocations << " buffers ("
      << stats_.current_bytes << " bytes) from it are alive";
}

absl::StatusOr<Buffer> Allocator::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  // Blocks whose readers finished are freed first, so their memory (for a pool: the very same
  // blocks) is available to this request.
  Collect();
  absl::StatusOr<void*> data = AllocateRaw(bytes);
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
}

int Allocator::Collect() {
  std::vector<Pending> ready;
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = CollectLocked(ready);
  }
  FreeBlocks(ready);
  return n;
}

int Allocator::CollectLocked(std::vector<Pending>& ready) {
  int n = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (DropDoneGuards(it->guards, name_)) {
      ready.push_back(std::move(*it));
      it = pending_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

void Allocator::FreeBlocks(std::vector<Pending>& blocks) {
  if (blocks.empty()) return;
  int64_t bytes = 0;
  for (const Pending& p : blocks) {
    DeallocateRaw(p.data, p.bytes);
    bytes += static_cast<int64_t>(p.bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= bytes;
  stats_.live_allocations -= static_cast<int64_t>(blocks.size());
  blocks.clear();
}

void Allocator::Release(void* data, size_t bytes, std::vector<std::shared_ptr<Event>> guards) {
  // Most releases are unguarded or their readers are already done: free at once.
  if (DropDoneGuards(guards, name_)) {
    std::vector<Pending> now;
    now.push_back(Pending{data, bytes, {}});
    FreeBlocks(now);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(Pending{data, bytes, std::move(guards)});
}

void Allocator::DrainPending() {
  std::vector<Pending> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(pending_);
  }
  std::vector<Pending> freeable;
  int64_t leaked_bytes = 0;
  int64_t leaked_blocks = 0;
  for (Pending& p : blocks) {
    bool timed_out = false;
    for (const std::shared_ptr<Event>& e : p.guards) {
      const absl::Status s = e->Synchronize(DefaultDeadline());
      if (absl::IsDeadlineExceeded(s)) {
        timed_out = true;
        SL_LOG(WARN, ALLOC) << "allocator '" << name_ << "': leaking a block of " << p.bytes
                            << " bytes at destruction, its reader did not finish: " << s;
        break;
      }
    }
    if (timed_out) {
      leaked_bytes += static_cast<int64_t>(p.bytes);
      ++leaked_blocks;
    } else {
      freeable.push_back(std::move(p));
    }
  }
  FreeBlocks(freeable);
  // Leaked blocks are gone from this allocator's point of view.
  std::lock_guard<std::mutex> lock(mu_);
  stats_.current_bytes -= leaked_bytes;
  stats_.live_allocations -= leaked_blocks;
}

// ---- Host allocator --------------------------------------------------------------------------

namespace {

// No machine maps more than 2^47 bytes of user address space; larger requests fail here,
// without asking malloc (sanitizer allocators abort on absurd sizes instead of failing).
constexpr size_t kMaxHostAllocation = size_t{1} << 47;

class HostAllocator final : public Allocator {
 public:
  HostAllocator(size_t alignment, std::string name)
      : Allocator(Device::Host(), std::move(name)),
        alignment_(std::max(alignment, sizeof(void*))),
        shareable_bytes_(ShareableThreshold(alignment_)) {}
  ~HostAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes) override {
    if (bytes > kMaxHostAllocation) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "more than the largest possible host allocation (", kMaxHostAllocation, " bytes)"));
    }
    if (shareable_bytes_ > 0 && bytes >= shareable_bytes_) {
      absl::StatusOr<void*> shared = AllocateShareable(bytes);
      if (shared.ok()) return shared;
      // Out of descriptors or memory-file space: private memory still works (peers then read
      // it with process_vm_readv). Said once per allocator.
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
    if (shareable_bytes_ > 0 && bytes >= shareable_bytes_) {
      std::optional<ShareableSpan> span = FindShareable(data, bytes);
      if (span && span->offset == 0) return FreeShareable(data, bytes);
    }
    std::free(data);
  }

 private:
  // Shareable regions are page-aligned: larger alignments take private memory.
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
  return std::make_unique<HostAllocator>(alignment, std::move(name));
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
