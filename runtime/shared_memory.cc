#include "runtime/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/status.h"

namespace shardline {

SL_PARAM(int64_t, HostShareableBytes, "HOST_SHAREABLE_BYTES", 1 << 20,
         "Allocations of at least this many bytes from a shareable host allocator come from "
         "the memory-file arenas that local peers can map (the ucx backend then copies and "
         "reduces straight out of them); 0: none. At most 1 TiB.",
         InRange<int64_t>(0, int64_t{1} << 40));

SL_PARAM(int64_t, HostShareableArenaBytes, "HOST_SHAREABLE_ARENA_BYTES", int64_t{8} << 30,
         "Address space the first shareable-memory arena reserves (each further arena reserves "
         "twice the previous one's); only the pages blocks use are memory. 1 MiB to 16 TiB.",
         InRange<int64_t>(int64_t{1} << 20, int64_t{1} << 44));

namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t RoundUp(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

// The memory file grows in steps of this much (or to the arena's end), so that a run of small
// blocks does not call ftruncate each time.
constexpr size_t kGrowStep = size_t{2} << 20;
// The most address space one arena reserves (a single larger request gets exactly its size).
constexpr size_t kMaxArenaBytes = size_t{1} << 40;

struct Arena {
  uint64_t id = 0;
  int fd = -1;
  uint8_t* base = nullptr;
  size_t capacity = 0;    // reserved (mapped) length
  size_t file_bytes = 0;  // the memory file's length
  size_t top = 0;         // end of the highest block ever handed out and not merged back
  std::map<size_t, size_t> free_by_offset;           // offset -> length, below `top`
  std::set<std::pair<size_t, size_t>> free_by_size;  // (length, offset)
  std::map<size_t, size_t> live;                     // offset -> length

  void AddFree(size_t offset, size_t length) {
    free_by_offset.emplace(offset, length);
    free_by_size.emplace(length, offset);
  }
  void RemoveFree(std::map<size_t, size_t>::iterator it) {
    free_by_size.erase({it->second, it->first});
    free_by_offset.erase(it);
  }
};

class Arenas {
 public:
  static Arenas& Get() {
    static Arenas* const arenas = new Arenas();  // outlives static destructors
    return *arenas;
  }

  absl::StatusOr<void*> Allocate(size_t bytes) {
    const size_t length = RoundUp(bytes, PageSize());
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::unique_ptr<Arena>& arena : arenas_) {
      absl::StatusOr<std::optional<size_t>> offset = Place(*arena, length);
      if (!offset.ok()) return offset.status();
      if (offset->has_value()) return arena->base + **offset;
    }
    SL_ASSIGN_OR_RETURN(Arena * arena, NewArena(length));
    absl::StatusOr<std::optional<size_t>> offset = Place(*arena, length);
    if (!offset.ok()) return offset.status();
    SL_CHECK(offset->has_value()) << "a new shareable arena has no room for " << length << " bytes";
    return arena->base + **offset;
  }

  void Free(void* data, size_t bytes) {
    size_t length = RoundUp(bytes, PageSize());
    int fd = -1;
    size_t offset = 0;
    Arena* arena = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      arena = FindLocked(reinterpret_cast<uintptr_t>(data));
      SL_CHECK(arena != nullptr) << "FreeShareable: " << data << " is not shareable memory";
      offset = static_cast<size_t>(static_cast<uint8_t*>(data) - arena->base);
      auto it = arena->live.find(offset);
      SL_CHECK(it != arena->live.end() && it->second == length)
          << "FreeShareable: " << data << " (" << bytes << " bytes) is not a live block";
      fd = arena->fd;
    }
    // Outside the lock (freeing a large block takes a while); the block stays live, so nobody
    // else can take it meanwhile. The pages go back to the kernel even where peers map them,
    // and the range reads as zeros from now on (the zero fill of the next block here).
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(length)) != 0) {
      // Kernels without hole punching for memory files: the same through the mapping.
      SL_CHECK(madvise(data, length, MADV_REMOVE) == 0)
          << "FreeShareable: cannot release the pages of " << length
          << " bytes: " << std::strerror(errno);
    }
    std::lock_guard<std::mutex> lock(mu_);
    arena->live.erase(offset);
    // Merge with the free neighbours; a free range that reaches `top` lowers it instead.
    auto next = arena->free_by_offset.lower_bound(offset);
    if (next != arena->free_by_offset.end() && next->first == offset + length) {
      length += next->second;
      arena->RemoveFree(next);
    }
    auto prev = arena->free_by_offset.lower_bound(offset);
    if (prev != arena->free_by_offset.begin()) {
      --prev;
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        arena->RemoveFree(prev);
      }
    }
    if (offset + length == arena->top) {
      arena->top = offset;
    } else {
      arena->AddFree(offset, length);
    }
  }

  std::optional<ShareableSpan> Find(uintptr_t begin, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    Arena* arena = FindLocked(begin);
    if (arena == nullptr) return std::nullopt;
    const size_t offset = begin - reinterpret_cast<uintptr_t>(arena->base);
    if (offset > arena->file_bytes || bytes > arena->file_bytes - offset) return std::nullopt;
    return ShareableSpan{arena->id, arena->fd, arena->capacity, offset, arena->file_bytes};
  }

  ShareableArenaStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    ShareableArenaStats s;
    for (const std::unique_ptr<Arena>& arena : arenas_) {
      ++s.arenas;
      s.reserved_bytes += static_cast<int64_t>(arena->capacity);
      s.file_bytes += static_cast<int64_t>(arena->file_bytes);
      s.live_blocks += static_cast<int64_t>(arena->live.size());
      for (const auto& [offset, length] : arena->live) {
        s.allocated_bytes += static_cast<int64_t>(length);
      }
      struct stat st {};
      if (fstat(arena->fd, &st) == 0) s.resident_bytes += static_cast<int64_t>(st.st_blocks) * 512;
    }
    return s;
  }

 private:
  // The arena containing address `p` (mu_ held), or null.
  Arena* FindLocked(uintptr_t p) {
    auto it = by_base_.upper_bound(p);
    if (it == by_base_.begin()) return nullptr;
    --it;
    Arena* arena = it->second;
    return p - it->first < arena->capacity ? arena : nullptr;
  }

  // A block of `length` (whole pages) in `arena`: the smallest free range that fits, else at the
  // top (growing the memory file). nullopt if the arena has no room; an error if the file
  // cannot grow. mu_ held.
  absl::StatusOr<std::optional<size_t>> Place(Arena& arena, size_t length) {
    size_t offset = 0;
    auto fit = arena.free_by_size.lower_bound({length, 0});
    if (fit != arena.free_by_size.end()) {
      const auto [free_length, free_offset] = *fit;
      arena.RemoveFree(arena.free_by_offset.find(free_offset));
      if (free_length > length) arena.AddFree(free_offset + length, free_length - length);
      offset = free_offset;
    } else {
      if (length > arena.capacity - arena.top) return std::optional<size_t>();
      offset = arena.top;
      const size_t end = arena.top + length;
      if (end > arena.file_bytes) {
        const size_t grown = std::min(arena.capacity, RoundUp(end, kGrowStep));
        if (ftruncate(arena.fd, static_cast<off_t>(grown)) != 0) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "ftruncate of a shareable arena to ", grown, " bytes: ", std::strerror(errno)));
        }
        arena.file_bytes = grown;
      }
      arena.top = end;
    }
    arena.live.emplace(offset, length);
    return std::optional<size_t>(offset);
  }

  // A new arena with room for `length` bytes (mu_ held). Where the address space is limited
  // (RLIMIT_AS), smaller reservations are tried, down to `length`.
  absl::StatusOr<Arena*> NewArena(size_t length) {
    absl::StatusOr<int64_t> first = ParamHostShareableArenaBytes().Get();
    SL_RETURN_IF_ERROR(first.status());
    size_t capacity = static_cast<size_t>(*first);
    for (size_t i = 0; i < arenas_.size() && capacity < kMaxArenaBytes; ++i) capacity *= 2;
    capacity = RoundUp(std::max(std::min(capacity, kMaxArenaBytes), length), PageSize());
    const int fd = memfd_create("shardline-arena", MFD_CLOEXEC);
    if (fd < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("memfd_create for a shareable arena: ", std::strerror(errno)));
    }
    void* base = MAP_FAILED;
    int error = 0;
    for (;;) {
      base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
      if (base != MAP_FAILED) break;
      error = errno;
      const size_t smaller = RoundUp(capacity / 2, PageSize());
      if (error != ENOMEM || capacity == length || smaller < length) break;
      capacity = std::max(smaller, length);
    }
    if (base == MAP_FAILED) {
      close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("mmap of a shareable arena of ", capacity,
                                                       " bytes: ", std::strerror(error)));
    }
    auto arena = std::make_unique<Arena>();
    arena->id = ++last_id_;
    arena->fd = fd;
    arena->base = static_cast<uint8_t*>(base);
    arena->capacity = capacity;
    Arena* raw = arena.get();
    by_base_.emplace(reinterpret_cast<uintptr_t>(base), raw);
    arenas_.push_back(std::move(arena));
    return raw;
  }

  std::mutex mu_;
  std::vector<std::unique_ptr<Arena>> arenas_;  // oldest first: filled first
  std::map<uintptr_t, Arena*> by_base_;
  uint64_t last_id_ = 0;
};

}  // namespace

absl::StatusOr<void*> AllocateShareable(size_t bytes) {
  SL_CHECK(bytes > 0) << "AllocateShareable: zero bytes";
  if (bytes > kMaxArenaBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        bytes, " shareable bytes: more than the largest arena (", kMaxArenaBytes, " bytes)"));
  }
  return Arenas::Get().Allocate(bytes);
}

void FreeShareable(void* data, size_t bytes) {
  if (data == nullptr) return;
  Arenas::Get().Free(data, bytes);
}

std::optional<ShareableSpan> FindShareable(const void* data, size_t bytes) {
  return Arenas::Get().Find(reinterpret_cast<uintptr_t>(data), bytes);
}

ShareableArenaStats GetShareableArenaStats() { return Arenas::Get().Stats(); }

}  // namespace shardline
