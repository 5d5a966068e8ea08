// Descriptor codec (descriptors.hpp): round trips, and every malformed blob (random bytes,
// truncations, mutations with or without a repaired checksum) is a DescriptorError, never
// another exception, a crash or a name that is not printable ASCII.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "descriptors.hpp"
#include "engine_types.hpp"

namespace kvxfer {
namespace {

EngineAddress sample_address() {
  EngineAddress a;
  a.engine_id = 0x1122334455667788ull;
  a.provider = "tcp";
  a.rail_addresses = {std::string("\x02\x00\x9c\x40\x7f\x00\x00\x01", 8), std::string(16, '\x05')};
  a.same_host.host_key = "b2c6e0e4-boot/pid:[4026531836]";
  a.same_host.pid = 4242;
  a.same_host.table_addr = 0x7f0000001000ull;
  a.same_host.table_fd = 7;
  return a;
}

MemoryDescriptor sample_descriptor() {
  MemoryDescriptor d;
  d.owner = sample_address();
  d.region_id = 3;
  d.addr = 0x7f1234560000ull;
  d.length = 1 << 20;
  d.share_fd = 9;
  d.share_offset = 4096;
  d.rails = {{0x1000, 0xabc}, {0, 0xdef}};
  return d;
}

uint32_t fnv1a(const std::string& s, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(s[i]);
    h *= 16777619u;
  }
  return h;
}

// The blob with its trailing checksum made valid again: reaches the field checks.
std::string with_valid_checksum(std::string blob) {
  if (blob.size() < 4) return blob;
  uint32_t h = fnv1a(blob, blob.size() - 4);
  std::memcpy(&blob[blob.size() - 4], &h, 4);
  return blob;
}

bool printable(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

// Parses as a descriptor: either a DescriptorError or a result whose names are printable.
void expect_refused_or_sane(const std::string& blob) {
  try {
    MemoryDescriptor d = MemoryDescriptor::parse(blob);
    EXPECT_TRUE(printable(d.owner.provider));
    EXPECT_TRUE(printable(d.owner.same_host.host_key));
    EXPECT_EQ(d.rails.size(), d.owner.rail_addresses.size());
  } catch (const DescriptorError&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a DescriptorError: " << typeid(e).name() << ": " << e.what();
  }
}

TEST(Descriptors, AddressAndDescriptorRoundTrip) {
  const EngineAddress a = sample_address();
  EngineAddress b = EngineAddress::parse(a.serialize());
  EXPECT_EQ(b.engine_id, a.engine_id);
  EXPECT_EQ(b.provider, a.provider);
  EXPECT_EQ(b.rail_addresses, a.rail_addresses);
  EXPECT_EQ(b.same_host.host_key, a.same_host.host_key);
  EXPECT_EQ(b.same_host.table_fd, a.same_host.table_fd);

  const MemoryDescriptor d = sample_descriptor();
  MemoryDescriptor e = MemoryDescriptor::parse(d.serialize());
  EXPECT_EQ(e.region_id, d.region_id);
  EXPECT_EQ(e.addr, d.addr);
  EXPECT_EQ(e.length, d.length);
  EXPECT_EQ(e.share_fd, d.share_fd);
  EXPECT_EQ(e.share_offset, d.share_offset);
  ASSERT_EQ(e.rails.size(), 2u);
  EXPECT_EQ(e.rails[1].key, d.rails[1].key);
}

TEST(Descriptors, EveryTruncationAndEveryFlippedByteIsADescriptorError) {
  const std::string blob = sample_descriptor().serialize();
  for (size_t n = 0; n < blob.size(); ++n)
    EXPECT_THROW(MemoryDescriptor::parse(blob.substr(0, n)), DescriptorError) << n;
  for (size_t i = 0; i < blob.size(); ++i) {
    std::string bad = blob;
    bad[i] ^= 0x01;
    EXPECT_THROW(MemoryDescriptor::parse(bad), DescriptorError) << i;
  }
}

TEST(Descriptors, AnAddressIsNotADescriptorNorTheOtherWayRound) {
  EXPECT_THROW(MemoryDescriptor::parse(sample_address().serialize()), DescriptorError);
  EXPECT_THROW(EngineAddress::parse(sample_descriptor().serialize()), DescriptorError);
}

TEST(Descriptors, NamesThatAreNotPrintableAsciiAreRefusedEvenWithAValidChecksum) {
  MemoryDescriptor d = sample_descriptor();
  d.owner.provider = "tc\xff";
  EXPECT_THROW(MemoryDescriptor::parse(d.serialize()), DescriptorError);
  d = sample_descriptor();
  d.owner.provider = "";
  EXPECT_THROW(MemoryDescriptor::parse(d.serialize()), DescriptorError);
  d = sample_descriptor();
  d.owner.same_host.host_key = std::string("boot\x00id", 7);
  EXPECT_THROW(MemoryDescriptor::parse(d.serialize()), DescriptorError);
}

// Seeded fuzz, bounded: random bytes, truncated and mutated valid descriptors, the latter
// with their checksum repaired so the field checks behind it are reached.
TEST(Descriptors, SeededFuzzOnlyEverRaisesDescriptorError) {
  std::mt19937_64 rng(20251123);
  const std::string valid = sample_descriptor().serialize();
  const std::string magic = valid.substr(0, 6);  // "KVXD" + version
  for (int i = 0; i < 20000; ++i) {
    std::string blob;
    switch (i % 4) {
      case 0: {  // random bytes
        blob.resize(rng() % 200);
        for (auto& c : blob) c = static_cast<char>(rng());
        break;
      }
      case 1: {  // random bytes behind a valid magic and version, checksum repaired
        blob = magic;
        blob.resize(6 + rng() % 200);
        for (size_t k = 6; k < blob.size(); ++k) blob[k] = static_cast<char>(rng());
        blob = with_valid_checksum(blob);
        break;
      }
      default: {  // a valid descriptor with 1-4 bytes mutated, maybe truncated, checksum repaired
        blob = valid;
        for (int m = 0, n = 1 + rng() % 4; m < n; ++m) blob[rng() % (blob.size() - 4)] = static_cast<char>(rng());
        if (rng() % 4 == 0) blob.resize(rng() % blob.size());
        blob = with_valid_checksum(blob);
        break;
      }
    }
    expect_refused_or_sane(blob);
    try {
      EngineAddress::parse(blob);
    } catch (const DescriptorError&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "address parse: " << e.what();
    }
    if (HasFailure()) FAIL() << "fuzz case " << i;
  }
}

}  // namespace
}  // namespace kvxfer
