// CRC-32C (Castagnoli) of KV pages: the end-to-end integrity check of a KV push.
//
// The prefiller checksums each (layer, page) it pushes and the decoder checks the pages
// that landed before it admits the request (docs/architecture.md, "KV integrity"). CRC-32C
// because x86-64 has an instruction for it (SSE4.2 crc32, 1 per cycle, latency 3): three
// independent streams keep the unit busy, and the three partial CRCs are combined with a
// precomputed "append N zero bytes" operator. Without SSE4.2 (or on another ISA) a
// slicing-by-8 table gives the same values, slower.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvxfer {

// Standard CRC-32C of `len` bytes (init and final xor 0xffffffff): crc32c("123456789") is
// 0xe3069283. Pass a previous result as `crc` to continue it over more bytes.
uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0);

// The same value computed with tables only (reference for tests and benchmarks).
uint32_t crc32c_portable(const void* data, size_t len, uint32_t crc = 0);

// True when crc32c() uses the SSE4.2 instruction on this CPU.
bool crc32c_hardware();

// Checksums of `count` pages of one layer: page i covers bytes
// [offset + pages[i] * page_bytes, + page_bytes) of a region of `region_len` bytes at
// `base`. Throws BoundsError (before reading anything) if one lies outside the region.
void page_crc32c(const uint8_t* base, uint64_t region_len, uint64_t offset, uint64_t page_bytes,
                 const int64_t* pages, size_t count, uint32_t* out);

}  // namespace kvxfer
