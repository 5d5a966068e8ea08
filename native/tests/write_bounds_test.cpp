// Bounds checks (write_bounds.hpp): every range inside both regions passes, anything else
// is a BoundsError naming the side, and no choice of numbers wraps around 64 bits.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine_types.hpp"
#include "write_bounds.hpp"

namespace kvxfer {
namespace {

constexpr uint64_t kMax = UINT64_MAX;

TEST(WriteBounds, RangesInsideBothRegionsPass) {
  EXPECT_NO_THROW(check_write_bounds(0, 4096, 0, 4096, 4096));
  EXPECT_NO_THROW(check_write_bounds(4095, 4096, 0, 1, 1));
  EXPECT_NO_THROW(check_write_bounds(10, 100, 20, 100, 80));
}

TEST(WriteBounds, ZeroLengthIsRefused) {
  EXPECT_THROW(check_write_bounds(0, 10, 0, 10, 0), BoundsError);
}

TEST(WriteBounds, SourceAndDestinationOverrunsNameTheirSide) {
  try {
    check_write_bounds(1, 4096, 0, 8192, 4096);
    FAIL() << "no BoundsError";
  } catch (const BoundsError& e) {
    EXPECT_NE(std::string(e.what()).find("source range"), std::string::npos) << e.what();
  }
  try {
    check_write_bounds(0, 8192, 4097, 8192, 4096);
    FAIL() << "no BoundsError";
  } catch (const BoundsError& e) {
    EXPECT_NE(std::string(e.what()).find("destination range"), std::string::npos) << e.what();
  }
}

TEST(WriteBounds, OffsetsNearTwoToTheSixtyFourDoNotWrapAround) {
  EXPECT_THROW(check_write_bounds(kMax, 4096, 0, 4096, 1), BoundsError);
  EXPECT_THROW(check_write_bounds(0, 4096, kMax - 1, 4096, 2), BoundsError);
  EXPECT_THROW(check_write_bounds(1, kMax, 0, kMax, kMax), BoundsError);
}

TEST(PagedBounds, PagesInsideBothRegionsPass) {
  std::vector<int64_t> src = {0, 3, 1}, dst = {7, 0, 2};
  EXPECT_NO_THROW(check_paged_bounds(src.data(), dst.data(), 3, 4096, 4096, 4096, 0, 0, 4 * 4096, 8 * 4096));
  // Strides wider than a page, with offsets.
  EXPECT_NO_THROW(check_paged_bounds(src.data(), dst.data(), 3, 1000, 2000, 3000, 500, 10, 4 * 2000, 8 * 3000));
}

TEST(PagedBounds, TheLastPageMayEndExactlyAtTheRegionEnd) {
  std::vector<int64_t> src = {3}, dst = {1};
  EXPECT_NO_THROW(check_paged_bounds(src.data(), dst.data(), 1, 4096, 4096, 4096, 0, 0, 4 * 4096, 2 * 4096));
  src = {4};
  EXPECT_THROW(check_paged_bounds(src.data(), dst.data(), 1, 4096, 4096, 4096, 0, 0, 4 * 4096, 2 * 4096),
               BoundsError);
}

TEST(PagedBounds, BadPagesNameTheFirstBadPosition) {
  std::vector<int64_t> src = {0, 1, 2}, dst = {0, 9, 1};
  try {
    check_paged_bounds(src.data(), dst.data(), 3, 4096, 4096, 4096, 0, 0, 16 * 4096, 4 * 4096);
    FAIL() << "no BoundsError";
  } catch (const BoundsError& e) {
    EXPECT_NE(std::string(e.what()).find("destination page 9 at position 1"), std::string::npos) << e.what();
  }
}

TEST(PagedBounds, NegativeIndicesOverlappingStridesAndEmptyListsAreRefused) {
  std::vector<int64_t> ok = {0}, neg = {-1};
  EXPECT_THROW(check_paged_bounds(neg.data(), ok.data(), 1, 64, 64, 64, 0, 0, 4096, 4096), BoundsError);
  EXPECT_THROW(check_paged_bounds(ok.data(), ok.data(), 1, 64, 32, 64, 0, 0, 4096, 4096), BoundsError);
  EXPECT_THROW(check_paged_bounds(ok.data(), ok.data(), 1, 0, 64, 64, 0, 0, 4096, 4096), BoundsError);
  EXPECT_THROW(check_paged_bounds(ok.data(), ok.data(), 0, 64, 64, 64, 0, 0, 4096, 4096), BoundsError);
}

TEST(PagedBounds, HugeIndexTimesStrideDoesNotWrapAround) {
  // 2^52 * 2^12 = 2^64 would wrap to 0 with a naive multiplication.
  std::vector<int64_t> huge = {int64_t(1) << 52}, ok = {0};
  EXPECT_THROW(check_paged_bounds(huge.data(), ok.data(), 1, 4096, 4096, 4096, 0, 0, 1 << 20, 1 << 20),
               BoundsError);
  EXPECT_THROW(check_paged_bounds(ok.data(), ok.data(), 1, 4096, 4096, 4096, kMax - 10, 0, 1 << 20, 1 << 20),
               BoundsError);
}

}  // namespace
}  // namespace kvxfer
