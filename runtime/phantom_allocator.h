// File: runtime/phantom_allocator.h
// -----------------------------------------------------------------------------
// An Allocator that accounts for memory without having any: for the simulator, which runs every
// rank of a large job in one process and needs the memory each would use, not the memory itself.
//
//   std::unique_ptr<Allocator> hbm = CreatePhantomAllocator(Device::Cuda(0), "hbm", 80 << 30);
//   CachingPool pool(*hbm);   // pools, guards and stream-ordered reuse work as on real memory
//   Buffer b = *pool.Allocate(1 << 30, gather_stream);   // no memory is touched
//
// Accounting is the Allocator base's, exactly as for a real allocator of the same requests:
// stats(), peaks, guarded release (ReleaseAfter) and pending blocks. Past `capacity_bytes` of
// live allocations, Allocate fails with ResourceExhausted naming the request, the capacity and
// the bytes in use.
//
// Addresses: Buffer::data() is a non-null address, aligned to 256 bytes, in a range reserved for
// phantom memory (IsPhantomAddress): on x86-64 and AArch64 no mapping can ever be there (the
// addresses are non-canonical or beyond the user address space), so touching one faults at once
// instead of corrupting real memory. Touching phantom memory, reading or writing, is a bug:
// only stream ops that are accounted and never run (a simulated stream's) may name it. Address
// arithmetic is fine: the bytes [data(), data() + size()) of a buffer are its own, and the ranges
// of live buffers never overlap, across every phantom allocator of the process, so code that keys
// on addresses (CachingPool, views into a buffer) behaves as on real memory. A released range may
// be handed out again, as real memory is.
//
// Thread safety: all methods may be called from any thread.

#ifndef SHARDLINE_RUNTIME_PHANTOM_ALLOCATOR_H_
#define SHARDLINE_RUNTIME_PHANTOM_ALLOCATOR_H_

#include <cstddef>
#include <limits>
#include <memory>
#include <string>

#include "runtime/allocator.h"
#include "runtime/device.h"

namespace shardline {

// The alignment of every phantom address.
inline constexpr size_t kPhantomAlignment = 256;

// A phantom allocator for memory of `device` (any device: it is only a label). `capacity_bytes`
// bounds the bytes of live allocations (requested sizes, as stats().current_bytes counts them);
// the default is unlimited, up to the phantom range itself (2^55 bytes live at once).
std::unique_ptr<Allocator> CreatePhantomAllocator(
    Device device, std::string name = "phantom",
    size_t capacity_bytes = std::numeric_limits<size_t>::max());

// Whether `address` lies in the range phantom allocators hand out (for checks that a pointer is
// not one before touching it).
bool IsPhantomAddress(const void* address);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_PHANTOM_ALLOCATOR_H_
