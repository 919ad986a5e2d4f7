#include "runtime/phantom_allocator.h"

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace shardline {
namespace {

// [2^55, 2^56): non-canonical on x86-64 with 4-level paging; with 5-level paging the kernel
// maps nothing above 2^47 unless a caller asks for it by address. On AArch64 bits 52-55 lie
// beyond every user address space, and the top byte, which the hardware ignores, stays 0.
constexpr uintptr_t kRangeBegin = uintptr_t{1} << 55;
constexpr uintptr_t kRangeBytes = uintptr_t{1} << 55;

size_t RoundUp(size_t bytes) {
  return (bytes + kPhantomAlignment - 1) / kPhantomAlignment * kPhantomAlignment;
}

// The phantom range of the process, shared by every phantom allocator so that their buffers
// never overlap: free extents, handed out best fit and coalesced when returned, so that the
// range is reused like memory (a counter that never reuses would run out over a long
// simulation).
class PhantomRange {
 public:
  PhantomRange() { InsertLocked(kRangeBegin, kRangeBytes); }

  // The start of a free extent of `bytes` (a multiple of kPhantomAlignment), or nullopt.
  std::optional<uintptr_t> Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto fit = by_size_.lower_bound({bytes, 0});
    if (fit == by_size_.end()) return std::nullopt;
    const auto [size, begin] = *fit;
    by_size_.erase(fit);
    by_begin_.erase(begin);
    if (size > bytes) InsertLocked(begin + bytes, size - bytes);
    return begin;
  }

  // Returns an extent from Take(), merged with its free neighbours.
  void Give(uintptr_t begin, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto next = by_begin_.lower_bound(begin);
    if (next != by_begin_.end() && next->first == begin + bytes) {
      bytes += next->second;
      by_size_.erase({next->second, next->first});
      next = by_begin_.erase(next);
    }
    if (next != by_begin_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == begin) {
        begin = prev->first;
        bytes += prev->second;
        by_size_.erase({prev->second, prev->first});
        by_begin_.erase(prev);
      }
    }
    InsertLocked(begin, bytes);
  }

 private:
  void InsertLocked(uintptr_t begin, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    by_begin_.emplace(begin, bytes);
    by_size_.emplace(bytes, begin);
  }

  std::mutex mu_;
  std::map<uintptr_t, size_t> by_begin_ ABSL_GUARDED_BY(mu_);            // begin -> bytes
  std::set<std::pair<size_t, uintptr_t>> by_size_ ABSL_GUARDED_BY(mu_);  // (bytes, begin)
};

PhantomRange& Range() {
  static PhantomRange* const range = new PhantomRange();
  return *range;
}

class PhantomAllocator final : public Allocator {
 public:
  PhantomAllocator(Device device, std::string name, size_t capacity_bytes)
      : Allocator(device, std::move(name)), capacity_bytes_(capacity_bytes) {}
  ~PhantomAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* /*first_user*/) override {
    // The capacity is checked here, under our own lock, rather than against stats(): the base
    // counts a block only after AllocateRaw returns, so concurrent requests could all pass.
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > capacity_bytes_ - in_use_bytes_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("phantom capacity of ", capacity_bytes_, " bytes exceeded: ", bytes,
                         " bytes requested with ", in_use_bytes_, " bytes in use (",
                         capacity_bytes_ - in_use_bytes_, " left)"));
      }
      in_use_bytes_ += bytes;
    }
    std::optional<uintptr_t> begin;
    if (bytes <= kRangeBytes) begin = Range().Take(RoundUp(bytes));
    if (!begin.has_value()) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_bytes_ -= bytes;
      return absl::ResourceExhaustedError(absl::StrCat(
          "the process's phantom address range (", kRangeBytes,
          " bytes, shared by every phantom allocator) has no free extent for ", bytes, " bytes"));
    }
    return reinterpret_cast<void*>(*begin);
  }

  void DeallocateRaw(void* data, size_t bytes) override {
    Range().Give(reinterpret_cast<uintptr_t>(data), RoundUp(bytes));
    std::lock_guard<std::mutex> lock(mu_);
    in_use_bytes_ -= bytes;
  }

 private:
  const size_t capacity_bytes_;
  std::mutex mu_;
  size_t in_use_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // requested bytes of blocks not yet freed
};

}  // namespace

std::unique_ptr<Allocator> CreatePhantomAllocator(Device device, std::string name,
                                                  size_t capacity_bytes) {
  return std::make_unique<PhantomAllocator>(device, std::move(name), capacity_bytes);
}

bool IsPhantomAddress(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  return at >= kRangeBegin && at - kRangeBegin < kRangeBytes;
}

}  // namespace shardline
