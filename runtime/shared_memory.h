// File: runtime/shared_memory.h
// -----------------------------------------------------------------------------
// Host memory that other processes on this machine can map. Shareable memory is sub-allocated
// from a few *arenas*: each arena is one anonymous memory file (memfd) mapped MAP_SHARED into
// this process. A peer that may read this process's memory (the same ptrace permission
// process_vm_readv needs) duplicates an arena's file descriptor with pidfd_getfd and maps the
// arena (as far as its file reaches, again when it grows), after which it copies or reduces
// straight out of any block in it with ordinary loads — no system call per transfer and no pinning,
// which on a machine whose memory bandwidth is the limit is the difference between the kernel's
// copy (about two thirds of memcpy here) and memcpy itself.
//
//   SL_ASSIGN_OR_RETURN(void* p, AllocateShareable(bytes));
//   if (std::optional<ShareableSpan> span = FindShareable(p + off, len)) { ...send span... }
//   FreeShareable(p, bytes);
//
// Shareable memory is explicit: a plain HostAllocator gives private memory;
// CreateShareableHostAllocator (runtime/allocator.h) takes its allocations of at least
// SHARDLINE_HOST_SHAREABLE_BYTES from here, and a communicator hands out such an allocator for
// the memory it moves (Communicator::CreateHostAllocatorForTransfers: the ucx backend's). The
// ucx backend maps its local peers' arenas (collectives/ucx) and falls back to process_vm_readv
// for memory that is not shareable.
//
// Arenas. The first arena reserves SHARDLINE_HOST_SHAREABLE_ARENA_BYTES (8 GiB) of address
// space and each further one twice the previous one's (at least the request), so a process
// holds a handful of arenas — one file descriptor each, and one mapping per arena on each peer
// that reads it — however many blocks it allocates. Only the memory file's pages that blocks
// use are memory: the file grows with the highest block (never shrinks, so that a peer's
// mapping is never cut short) and its reservation costs only address space. Blocks are
// page-aligned, whole pages, zero-filled; freed blocks are reused (best fit, neighbours merged).
// Arenas live as long as the process.
//
// Freeing is real: FreeShareable punches the block's pages out of the memory file
// (FALLOC_FL_PUNCH_HOLE), which returns them to the kernel at once, even while peers map the
// arena — a peer that reads a freed block afterwards (only possible after a failed collective)
// reads zeros. So the memory the shareable arenas hold is what their live blocks use
// (ShareableArenaStats().resident_bytes), and an allocator that frees a block really frees it.
//
// One property differs from private memory: a forked child shares these pages with its parent
// instead of copying them on write (which is why shareable memory is opt-in).
//
// Thread safety: all functions may be called from any thread.

#ifndef SHARDLINE_RUNTIME_SHARED_MEMORY_H_
#define SHARDLINE_RUNTIME_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "runtime/config.h"

namespace shardline {

// SHARDLINE_HOST_SHAREABLE_BYTES: allocations of at least this many bytes from a shareable host
// allocator are shareable (0: none).
const Param<int64_t>& ParamHostShareableBytes();
// SHARDLINE_HOST_SHAREABLE_ARENA_BYTES: the address space the first arena reserves.
const Param<int64_t>& ParamHostShareableArenaBytes();

// Where a span of shareable memory lives: enough for a peer to map it.
struct ShareableSpan {
  uint64_t region_id = 0;   // the arena's id: unique among this process's arenas, never reused
  int fd = -1;              // the arena's memory file in this process
  size_t region_bytes = 0;  // the arena's reserved length (what a peer maps)
  size_t offset = 0;        // of the span's first byte within the arena
  size_t file_bytes = 0;    // the memory file's length now (>= offset + the span's length)
};

// `bytes` (> 0) of zero-filled, page-aligned shareable memory from an arena (a new arena if
// none has room). ResourceExhausted naming the system call if no arena can be created or grown
// (memory file or address space exhausted).
absl::StatusOr<void*> AllocateShareable(size_t bytes);

// Returns memory from AllocateShareable (`bytes` as allocated) to its arena; its pages go back
// to the kernel at once. A pointer that is not the start of a live block is a bug (checked).
void FreeShareable(void* data, size_t bytes);

// The arena holding all of [data, data + bytes), if it is shareable memory of this process.
std::optional<ShareableSpan> FindShareable(const void* data, size_t bytes);

struct ShareableArenaStats {
  int64_t arenas = 0;           // = file descriptors held
  int64_t reserved_bytes = 0;   // address space reserved
  int64_t file_bytes = 0;       // length of the memory files (the blocks' high-water mark)
  int64_t live_blocks = 0;      // blocks allocated and not freed
  int64_t allocated_bytes = 0;  // their bytes (whole pages)
  // Pages the memory files hold (st_blocks): the live blocks' touched pages, plus any page of a
  // freed block that a peer read after it was freed.
  int64_t resident_bytes = 0;
};
// The process's arenas, now.
ShareableArenaStats GetShareableArenaStats();

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_SHARED_MEMORY_H_
