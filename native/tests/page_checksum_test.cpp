// CRC-32C known answers (RFC 3720 B.4, the "123456789" check value) and agreement of the
// three-way hardware loop with the portable tables at every length and alignment where
// the loop changes shape (short tail, one and several 256- and 8192-byte blocks).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "page_checksum.hpp"

using kvxfer::crc32c;
using kvxfer::crc32c_portable;

TEST(Crc32c, KnownAnswers) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xe3069283u);
  EXPECT_EQ(crc32c_portable(check.data(), check.size()), 0xe3069283u);
  std::vector<uint8_t> buf(32, 0x00);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x8a9136aau);  // RFC 3720: 32 bytes of zeros
  std::fill(buf.begin(), buf.end(), 0xff);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x62a8ab43u);  // 32 bytes of ones
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x46dd794eu);  // incrementing
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(31 - i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x113fdb5cu);  // decrementing
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareLoopEqualsPortableAtEveryShape) {
  std::mt19937_64 rng(12);
  std::vector<uint8_t> buf(3 * 8192 * 2 + 3 * 256 * 3 + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const size_t lengths[] = {0, 1, 7, 8, 9, 255, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1,
                            2 * 3 * 8192 + 3 * 256 + 5, buf.size() - 8};
  for (size_t len : lengths) {
    for (size_t align = 0; align < 8; align += 3) {
      if (align + len > buf.size()) continue;
      EXPECT_EQ(crc32c(buf.data() + align, len), crc32c_portable(buf.data() + align, len))
          << "length " << len << " alignment " << align;
    }
  }
}

TEST(Crc32c, ContinuesOverSplits) {
  std::vector<uint8_t> buf(100000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31 + 7);
  uint32_t whole = crc32c(buf.data(), buf.size());
  uint32_t part = crc32c(buf.data(), 40000);
  EXPECT_EQ(crc32c(buf.data() + 40000, buf.size() - 40000, part), whole);
}

TEST(Crc32c, OneFlippedBitChangesThePageChecksum) {
  std::vector<uint8_t> page(65536, 0x5a);
  uint32_t before = crc32c(page.data(), page.size());
  page[40000] ^= 0x10;
  EXPECT_NE(crc32c(page.data(), page.size()), before);
}

TEST(PageCrc32c, ChecksumsEachPageAndRefusesPagesOutsideTheRegion) {
  const uint64_t page_bytes = 4096, offset = 2 * page_bytes;
  std::vector<uint8_t> region(10 * page_bytes);
  for (size_t i = 0; i < region.size(); ++i) region[i] = static_cast<uint8_t>(i / page_bytes + i);
  const int64_t pages[] = {3, 0, 7};
  uint32_t out[3];
  kvxfer::page_crc32c(region.data(), region.size(), offset, page_bytes, pages, 3, out);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(out[i], crc32c(region.data() + offset + pages[i] * page_bytes, page_bytes)) << i;
  const int64_t past_end[] = {8};  // offset + 8 pages + one page > 10 pages
  EXPECT_THROW(kvxfer::page_crc32c(region.data(), region.size(), offset, page_bytes, past_end, 1, out),
               kvxfer::BoundsError);
  const int64_t negative[] = {-1};
  EXPECT_THROW(kvxfer::page_crc32c(region.data(), region.size(), offset, page_bytes, negative, 1, out),
               kvxfer::BoundsError);
}
