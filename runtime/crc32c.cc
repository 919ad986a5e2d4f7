// CRC-32C two ways, chosen once per process:
//  - x86-64 with SSE4.2: the `crc32` instruction, eight bytes per instruction, three independent
//    streams interleaved over 3 x 8 KiB strides and joined with a zero-extension table (a
//    virtual disk's page cache reads at 2+ GB/s; one stream of `crc32q` is latency-bound at
//    ~8 GB/s, three reach ~20 GB/s);
//  - elsewhere, table-driven "slicing by 8": table[k][b] is the CRC of byte b followed by k zero
//    bytes, so eight table lookups advance the CRC over eight input bytes (~1.5 GB/s per core).

#include "runtime/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

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

#if defined(__x86_64__)

constexpr size_t kStride = 8192;  // bytes per stream in one round of the interleaved loop

// The CRC register after `kStride` zero bytes are fed to register value v, as four byte tables:
// zeros[i][b] is the register after kStride zero bytes from the value b << 8i (the map is linear
// over GF(2), so the four parts xor together).
std::array<std::array<uint32_t, 256>, 4> MakeShiftTables() {
  auto feed_zeros = [](uint32_t c) {
    for (size_t i = 0; i < kStride; ++i) c = (c >> 8) ^ kTables[0][c & 0xFFu];
    return c;
  };
  // Linearity: compute the image of each of the 32 basis bits once, then combine.
  uint32_t basis[32];
  for (int bit = 0; bit < 32; ++bit) basis[bit] = feed_zeros(uint32_t{1} << bit);
  std::array<std::array<uint32_t, 256>, 4> t{};
  for (int i = 0; i < 4; ++i) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if (b & (1u << bit)) v ^= basis[8 * i + bit];
      }
      t[i][b] = v;
    }
  }
  return t;
}

uint32_t ShiftByStride(const std::array<std::array<uint32_t, 256>, 4>& t, uint32_t c) {
  return t[0][c & 0xFFu] ^ t[1][(c >> 8) & 0xFFu] ^ t[2][(c >> 16) & 0xFFu] ^ t[3][c >> 24];
}

__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const void* data,
                                                       size_t size) {
  static const std::array<std::array<uint32_t, 256>, 4> shift = MakeShiftTables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  while (size > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --size;
  }
  // Three streams over consecutive strides: a, b and c' start from 0 (b and c' as if after a
  // zero register), then crc(a|b|c') = shift(shift(a) ^ b) ^ c'.
  while (size >= 3 * kStride) {
    uint64_t c1 = 0;
    uint64_t c2 = 0;
    for (size_t i = 0; i < kStride; i += 8) {
      uint64_t w0;
      uint64_t w1;
      uint64_t w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kStride + i, 8);
      std::memcpy(&w2, p + 2 * kStride + i, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = ShiftByStride(shift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1);
    c = ShiftByStride(shift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c2);
    p += 3 * kStride;
    size -= 3 * kStride;
  }
  while (size >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}

#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  if (sse42) return ExtendSse42(crc, data, size);
#endif
  return Crc32cExtendPortable(crc, data, size);
}

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size) {
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
