// File: runtime/shared_memory.h
// -----------------------------------------------------------------------------
// Host memory that other processes on this machine can map. A shareable region is an anonymous
// memory file (memfd) mapped MAP_SHARED into this process; a peer that may read this process's
// memory (the same ptrace permission process_vm_readv needs) duplicates the file descriptor
// with pidfd_getfd and maps the region itself, after which it copies or reduces straight out of
// it with ordinary loads — no system call per transfer and no pinning, which on a machine whose
// memory bandwidth is the limit is the difference between the kernel's copy (about two thirds of
// memcpy here) and memcpy itself.
//
//   SL_ASSIGN_OR_RETURN(void* p, AllocateShareable(bytes));
//   if (std::optional<ShareableSpan> span = FindShareable(p + off, len)) { ...send span... }
//   FreeShareable(p, bytes);
//
// HostAllocator takes its allocations of at least SHARDLINE_HOST_SHAREABLE_BYTES from here
// (0: never), so the flat buffers and the collective benchmarks' buffers are shareable; the ucx
// backend maps its local peers' regions (collectives/ucx) and falls back to process_vm_readv
// for memory that is not.
//
// Two properties differ from private memory: a forked child shares these pages with its parent
// instead of copying them on write, and a peer's mapping keeps a region's pages alive after this
// process frees it until the peer unmaps it (the ucx backend keeps a bounded cache of mappings).
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

// SHARDLINE_HOST_SHAREABLE_BYTES: host allocations of at least this many bytes are shareable.
const Param<int64_t>& ParamHostShareableBytes();

// Where a span of shareable memory lives: enough for a peer to map it.
struct ShareableSpan {
  uint64_t region_id = 0;   // unique among this process's regions, never reused
  int fd = -1;              // the region's memory file in this process
  size_t region_bytes = 0;  // the region's length (what a peer maps)
  size_t offset = 0;        // of the span's first byte within the region
};

// `bytes` (> 0) of zero-filled, page-aligned shareable memory. Every live region holds one file
// descriptor; at most a quarter of RLIMIT_NOFILE's soft limit are used, so that the rest of the
// process never runs out. ResourceExhausted beyond that, or naming the system call if the memory
// file cannot be created or mapped.
absl::StatusOr<void*> AllocateShareable(size_t bytes);

// Returns memory from AllocateShareable (`bytes` as allocated).
void FreeShareable(void* data, size_t bytes);

// The region holding all of [data, data + bytes), if it is shareable memory of this process.
std::optional<ShareableSpan> FindShareable(const void* data, size_t bytes);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_SHARED_MEMORY_H_
