// File: runtime/crc32c.h
// -----------------------------------------------------------------------------
// CRC-32C (Castagnoli): the checksum of checkpoint blocks and of elastic state transfers. The iSCSI
// / ext4 / SSE4.2 `crc32` polynomial 0x1EDC6F41 (reflected 0x82F63B78), initial value and final xor
// 0xFFFFFFFF, so Crc32c("123456789") == 0xE3069283 — the value every other implementation (Python's
// `crc32c` package, `google-crc32c`) computes for the same bytes.
//
//   uint32_t crc = Crc32c(data, n);
//   uint32_t same = Crc32cExtend(Crc32c(data, k), data + k, n - k);  // in pieces

#ifndef SHARDLINE_RUNTIME_CRC32C_H_
#define SHARDLINE_RUNTIME_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace shardline {

// The CRC-32C of `crc`'s bytes followed by data[0, size): Crc32cExtend(0, ...) == Crc32c(...).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// The same without the SSE4.2 instruction (what non-x86 machines run; for tests).
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size);

// The CRC-32C of data[0, size).
inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CRC32C_H_
