// Table-driven CRC-32C, eight bytes per step ("slicing by 8"): table[k][b] is the CRC of byte b
// followed by k zero bytes, so eight table lookups advance the CRC over eight input bytes at
// once. Portable C++ (no SSE4.2 instruction), about 1-2 GB/s per core: faster than the disks it
// checks.

#include "scheduler/checkpoint/crc32c.h"

#include <array>
#include <cstring>

namespace shardline {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    t[0][b] = crc;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    // Little-endian assembly of the next eight bytes, whatever the host's byte order.
    const uint32_t lo = (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24) ^
                        c;
    c = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
        kTables[4][lo >> 24] ^ kTables[3][p[4]] ^ kTables[2][p[5]] ^ kTables[1][p[6]] ^
        kTables[0][p[7]];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFFu];
  return ~c;
}

}  // namespace shardline
