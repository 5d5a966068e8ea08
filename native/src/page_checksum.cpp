// CRC-32C, hardware (SSE4.2, three streams) and portable (slicing-by-8); see the header.
#include "page_checksum.hpp"

#include <cstring>
#include <string>

#include "engine_types.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define KVXFER_CRC32C_X86 1
#endif

namespace kvxfer {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // CRC-32C, reflected

// ---- portable: slicing-by-8 --------------------------------------------------------------

struct SliceTables {
  uint32_t t[8][256];
  SliceTables() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; ++n)
      for (int k = 1; k < 8; ++k) t[k][n] = (t[k - 1][n] >> 8) ^ t[0][t[k - 1][n] & 0xff];
  }
};

const SliceTables& slice_tables() {
  static const SliceTables tables;
  return tables;
}

// Raw register update (no pre/post inversion).
uint32_t raw_portable(uint32_t crc, const uint8_t* p, size_t len) {
  const auto& t = slice_tables().t;
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
    --len;
  }
  while (len >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86-64, aarch64)
    word ^= crc;
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^ t[4][(word >> 24) & 0xff] ^
          t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^ t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
    p += 8;
    len -= 8;
  }
  while (len--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

// ---- "append N zero bytes" as a table-driven linear operator ------------------------------
//
// The CRC register update is linear over GF(2): raw(s, A || B) = shift(raw(s, A), |B|) ^
// raw(0, B), where shift(x, n) feeds n zero bytes. shift for a fixed n is a 32x32 bit
// matrix, applied here with four 256-entry tables (one per byte of x).

struct ZeroShift {
  uint32_t t[4][256];
  explicit ZeroShift(size_t nbytes) {
    uint32_t one_bit[32], op[32], sq[32];
    // Feeding one zero bit: bit 0 of the register folds in the polynomial, the rest shift down.
    one_bit[0] = kPoly;
    for (int n = 1; n < 32; ++n) one_bit[n] = 1u << (n - 1);
    uint32_t byte_op[32];
    std::memcpy(byte_op, one_bit, sizeof byte_op);
    for (int i = 0; i < 3; ++i) {  // 1 bit -> 2 -> 4 -> 8 bits: one zero byte
      square(sq, byte_op);
      std::memcpy(byte_op, sq, sizeof sq);
    }
    for (int n = 0; n < 32; ++n) op[n] = 1u << n;  // identity
    for (size_t rest = nbytes; rest; rest >>= 1) {
      if (rest & 1) {
        uint32_t next[32];
        for (int n = 0; n < 32; ++n) next[n] = times(byte_op, op[n]);
        std::memcpy(op, next, sizeof next);
      }
      square(sq, byte_op);
      std::memcpy(byte_op, sq, sizeof sq);
    }
    for (uint32_t n = 0; n < 256; ++n)
      for (int k = 0; k < 4; ++k) t[k][n] = times(op, n << (8 * k));
  }
  uint32_t apply(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
  static uint32_t times(const uint32_t* mat, uint32_t vec) {
    uint32_t sum = 0;
    for (int n = 0; vec; ++n, vec >>= 1)
      if (vec & 1) sum ^= mat[n];
    return sum;
  }
  static void square(uint32_t* out, const uint32_t* mat) {
    for (int n = 0; n < 32; ++n) out[n] = times(mat, mat[n]);
  }
};

// Stream lengths of the three-way loop: long blocks for pages (KV pages are 4 KiB to a few
// MiB), short ones for the tail so that little is left to a single stream.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

#ifdef KVXFER_CRC32C_X86
const ZeroShift& long_shift() {
  static const ZeroShift s(kLong);
  return s;
}
const ZeroShift& short_shift() {
  static const ZeroShift s(kShort);
  return s;
}

// Three independent streams over consecutive blocks of `block` bytes while 3 blocks are
// left: the crc32 instruction has a latency of 3 cycles and a throughput of 1, so one
// stream uses a third of the unit.
__attribute__((target("sse4.2"))) uint64_t three_way(uint64_t c0, const uint8_t*& p, size_t& len, size_t block,
                                                     const ZeroShift& shift) {
  while (len >= 3 * block) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + block;
    while (p < end) {
      uint64_t a, b, c;
      std::memcpy(&a, p, 8);
      std::memcpy(&b, p + block, 8);
      std::memcpy(&c, p + 2 * block, 8);
      c0 = _mm_crc32_u64(c0, a);
      c1 = _mm_crc32_u64(c1, b);
      c2 = _mm_crc32_u64(c2, c);
      p += 8;
    }
    c0 = shift.apply(static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift.apply(static_cast<uint32_t>(c0)) ^ c2;
    p += 2 * block;
    len -= 3 * block;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t raw_sse42(uint32_t crc, const uint8_t* p, size_t len) {
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(crc, *p++);
    --len;
  }
  uint64_t c0 = three_way(crc, p, len, kLong, long_shift());
  c0 = three_way(c0, p, len, kShort, short_shift());
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
    p += 8;
    len -= 8;
  }
  while (len--) c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
  return static_cast<uint32_t>(c0);
}

bool detect_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef KVXFER_CRC32C_X86
  static const bool has = detect_sse42();
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_portable(const void* data, size_t len, uint32_t crc) {
  return ~raw_portable(~crc, static_cast<const uint8_t*>(data), len);
}

uint32_t crc32c(const void* data, size_t len, uint32_t crc) {
#ifdef KVXFER_CRC32C_X86
  if (crc32c_hardware()) return ~raw_sse42(~crc, static_cast<const uint8_t*>(data), len);
#endif
  return crc32c_portable(data, len, crc);
}

void page_crc32c(const uint8_t* base, uint64_t region_len, uint64_t offset, uint64_t page_bytes,
                 const int64_t* pages, size_t count, uint32_t* out) {
  if (page_bytes == 0) throw BoundsError("page_bytes must be > 0");
  for (size_t i = 0; i < count; ++i) {
    // Checked without overflow: page * page_bytes + offset + page_bytes <= region_len.
    uint64_t page = static_cast<uint64_t>(pages[i]);
    if (pages[i] < 0 || offset > region_len || page_bytes > region_len - offset ||
        page > (region_len - offset - page_bytes) / page_bytes) {
      throw BoundsError("page " + std::to_string(pages[i]) + " of " + std::to_string(page_bytes) +
                        " bytes at offset " + std::to_string(offset) + " lies outside the " +
                        std::to_string(region_len) + "-byte region");
    }
  }
  for (size_t i = 0; i < count; ++i)
    out[i] = crc32c(base + offset + static_cast<uint64_t>(pages[i]) * page_bytes, page_bytes);
}

}  // namespace kvxfer
