// The planner (rail_group.hpp): how a single write is split into ops and sharded across
// rails, how a paged write's pages are coalesced, and the weights its immediates carry.
// Rails are real loopback endpoints of libfabric's tcp provider (planning reads only their
// capabilities: 8 bytes of CQ data, 4 iovs), nothing is posted.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

#include "rail_group.hpp"

namespace kvxfer {
namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;
constexpr uint64_t kLocalBase = 0x10000000, kRemoteBase = 0x70000000;

class Planner : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    PlannerSettings s;  // defaults: shard at 512 KiB, ops of at most 4 MiB
    group_ = std::make_unique<RailGroup>("tcp", "127.0.0.1", 2, s);
  }
  static void TearDownTestSuite() { group_.reset(); }

  void SetUp() override {
    ASSERT_TRUE(group_->weighted_imm()) << "tcp has 8 bytes of CQ data";
    local_.addr = kLocalBase;
    local_.length = 256 * MiB;
    local_.rails.resize(2);
    remote_.length = 256 * MiB;
    remote_.rails = {{kRemoteBase, 11}, {kRemoteBase, 22}};
  }

  WorkBatch batch() {
    WorkBatch b;
    b.transfer = std::make_shared<TransferState>();
    return b;
  }
  static uint32_t imm_of(const RailOp& op) { return static_cast<uint32_t>(op.cq_data); }
  static uint32_t weight_of(const RailOp& op) { return static_cast<uint32_t>(op.cq_data >> 32); }
  static uint64_t total_weight(const WorkBatch& b) {
    uint64_t w = 0;
    for (const auto& op : b.ops) w += weight_of(op);
    return w;
  }

  static std::unique_ptr<RailGroup> group_;
  MemoryRegion local_;
  MemoryDescriptor remote_;
};
std::unique_ptr<RailGroup> Planner::group_;

TEST_F(Planner, SmallSingleWriteIsOneOpOnRailZeroWorthOneUnit) {
  WorkBatch b = batch();
  group_->plan(b, local_, remote_, {SingleWrite{100, 200, 4 * KiB}, 7u});
  ASSERT_EQ(b.ops.size(), 1u);
  const RailOp& op = b.ops[0];
  EXPECT_EQ(op.rail, 0);
  EXPECT_EQ(reinterpret_cast<uint64_t>(op.iov[0].iov_base), kLocalBase + 100);
  EXPECT_EQ(op.rma[0].addr, kRemoteBase + 200);
  EXPECT_EQ(op.rma[0].key, 11u);
  EXPECT_TRUE(op.has_cq_data);
  EXPECT_EQ(imm_of(op), 7u);
  EXPECT_EQ(weight_of(op), kImmUnit);
  EXPECT_EQ(b.ops_remaining, 1u);
  EXPECT_EQ(b.transfer->bytes, 4 * KiB);
}

TEST_F(Planner, LargeSingleWriteIsShardedOverBothRailsOnPageBoundariesAndWeighsOneUnit) {
  WorkBatch b = batch();
  const uint64_t len = 10 * MiB + 123;  // > 4 MiB ops: 3 by size, rounded up to 4 for 2 rails
  group_->plan(b, local_, remote_, {SingleWrite{0, 0, len}, 9u});
  ASSERT_EQ(b.ops.size(), 4u);
  uint64_t next = 0, bytes = 0;
  for (size_t i = 0; i < b.ops.size(); ++i) {
    const RailOp& op = b.ops[i];
    EXPECT_EQ(op.rail, i % 2);
    EXPECT_EQ(op.rma[0].key, i % 2 ? 22u : 11u);
    EXPECT_EQ(reinterpret_cast<uint64_t>(op.iov[0].iov_base), kLocalBase + next) << "gap before op " << i;
    if (i + 1 < b.ops.size()) {
      EXPECT_EQ(op.bytes % (4 * KiB), 0u) << "shard " << i << " splits a page";
    }
    EXPECT_LE(op.bytes, 4 * MiB);
    EXPECT_EQ(imm_of(op), 9u);
    next += op.bytes;
    bytes += op.bytes;
  }
  EXPECT_EQ(bytes, len);
  EXPECT_EQ(total_weight(b), kImmUnit) << "the shards together are one unit";
}

TEST_F(Planner, WriteWithoutImmediateCarriesTheTrafficOnlyWeight) {
  WorkBatch b = batch();
  group_->plan(b, local_, remote_, {SingleWrite{0, 0, 64 * KiB}, std::nullopt});
  ASSERT_EQ(b.ops.size(), 1u);
  EXPECT_TRUE(b.ops[0].has_cq_data);
  EXPECT_EQ(weight_of(b.ops[0]), kTrafficOnlyWeight);
}

TEST_F(Planner, OutOfBoundsWriteIsRefusedBeforeAnyOpIsPlanned) {
  WorkBatch b = batch();
  EXPECT_THROW(group_->plan(b, local_, remote_, {SingleWrite{0, remote_.length - 1, 2}, 1u}), BoundsError);
  EXPECT_TRUE(b.ops.empty());
}

TEST_F(Planner, PagedWriteCoalescesPagesAdjacentOnBothSidesIntoOneSegment) {
  WorkBatch b = batch();
  // One rail's share each: pages 0..3 go to rail 0, 4..7 to rail 1. Both runs are adjacent
  // on both sides, so each rail's share is one op with one segment.
  std::vector<int64_t> src(8), dst(8);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 10);
  group_->plan(b, local_, remote_, {PagedWrite{{src.data(), 8}, {dst.data(), 8}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u});
  ASSERT_EQ(b.ops.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    const RailOp& op = b.ops[r];
    EXPECT_EQ(op.rail, r);
    EXPECT_EQ(op.iov_count, 1u);
    EXPECT_EQ(op.bytes, 16 * KiB);
    EXPECT_EQ(op.rma[0].addr, kRemoteBase + (10 + 4 * r) * 4 * KiB);
    EXPECT_EQ(weight_of(op), 4 * kImmUnit) << "one unit per page";
  }
}

TEST_F(Planner, PagedWriteGathersScatteredPagesIntoSegmentsUpToTheIovLimit) {
  WorkBatch b = batch();
  // 6 pages, none adjacent to the previous on the remote side: on one rail's share of 3
  // pages each, 3 segments fit into one op (iov limit 4).
  std::vector<int64_t> src = {0, 1, 2, 3, 4, 5}, dst = {9, 3, 7, 1, 5, 11};
  group_->plan(b, local_, remote_, {PagedWrite{{src.data(), 6}, {dst.data(), 6}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u});
  ASSERT_EQ(b.ops.size(), 2u);
  EXPECT_EQ(b.ops[0].iov_count, 3u);
  EXPECT_EQ(b.ops[0].rma[1].addr, kRemoteBase + 3 * 4 * KiB);
  EXPECT_EQ(total_weight(b), 6 * kImmUnit);

  WorkBatch many = batch();
  std::vector<int64_t> s(20), d(20);
  for (int i = 0; i < 20; ++i) s[i] = i, d[i] = 2 * i;  // every page its own segment
  group_->plan(many, local_, remote_, {PagedWrite{{s.data(), 20}, {d.data(), 20}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u});
  for (const auto& op : many.ops) EXPECT_LE(op.iov_count, kMaxIov);
  EXPECT_EQ(many.ops.size(), 6u) << "10 pages per rail in ops of at most 4 segments: 3 per rail";
  EXPECT_EQ(total_weight(many), 20 * kImmUnit);
}

TEST_F(Planner, PagedRunsStopAtMaxCoalesceBytes) {
  WorkBatch b = batch();
  const size_t n = 2 * 64;  // 64 pages of 128 KiB per rail: 8 MiB, two 4 MiB ops per rail
  std::vector<int64_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  group_->plan(b, local_, remote_, {PagedWrite{{p.data(), n}, {p.data(), n}, 128 * KiB, 128 * KiB, 128 * KiB, 0, 0}, 5u});
  EXPECT_EQ(b.ops.size(), 4u);
  for (const auto& op : b.ops) EXPECT_LE(op.bytes, 4 * MiB);
  EXPECT_EQ(total_weight(b), n * kImmUnit);
}

TEST_F(Planner, ImmediateOnlyWorthMoreThanOneOpCanCarryIsSplit) {
  WorkBatch b = batch();
  group_->plan_imm_only(b, 3u, kMaxPagesPerOp + 5);
  ASSERT_EQ(b.ops.size(), 2u);
  EXPECT_EQ(weight_of(b.ops[0]), kMaxPagesPerOp * kImmUnit);
  EXPECT_EQ(weight_of(b.ops[1]), 5 * kImmUnit);
  EXPECT_THROW(group_->plan_imm_only(b, 3u, 0), BoundsError);
}

TEST_F(Planner, OneRequestTypeCountsWhatEachVariantAddsAtTheReceiver) {
  // Through plan(): a request's ops together carry exactly request.units() units.
  std::vector<int64_t> src = {0, 2, 4}, dst = {1, 3, 5};
  const TransferRequest requests[] = {
      {SingleWrite{0, 0, 3 * MiB}, 4u},
      {PagedWrite{{src.data(), 3}, {dst.data(), 3}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 4u},
      {ImmOnly{kMaxPagesPerOp + 2}, 4u},
  };
  const uint64_t expected_units[] = {1, 3, kMaxPagesPerOp + 2};
  for (size_t i = 0; i < 3; ++i) {
    WorkBatch b = batch();
    group_->plan(b, local_, remote_, requests[i]);
    EXPECT_EQ(requests[i].units(), expected_units[i]) << "request " << i;
    EXPECT_EQ(total_weight(b), expected_units[i] * kImmUnit) << "request " << i;
  }
  WorkBatch b = batch();
  EXPECT_THROW(group_->plan(b, local_, remote_, {ImmOnly{1}, std::nullopt}), BoundsError)
      << "an immediate-only request without an immediate";
}

}  // namespace

TEST_F(Planner, WindowedDescriptorUsesEachWindowsKeyAndRefusesBytesOutsideThem) {
  // Two windows (pages 0-3 and 8-9), each with its own keys per rail and its own base.
  MemoryDescriptor windowed = remote_;
  windowed.rails.clear();
  windowed.windows = {{0, 4 * 4 * KiB, {{0x1000, 101}, {0x1000, 102}}},
                      {8 * 4 * KiB, 2 * 4 * KiB, {{0x9000, 201}, {0x9000, 202}}}};
  std::vector<int64_t> src = {0, 1, 2, 3}, dst = {2, 3, 8, 9};
  WorkBatch b = batch();
  group_->plan(b, local_, windowed, {PagedWrite{{src.data(), 1}, {dst.data() + 2, 1}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u});
  ASSERT_EQ(b.ops.size(), 1u);
  EXPECT_EQ(b.ops[0].rma[0].key, 201u);
  EXPECT_EQ(b.ops[0].rma[0].addr, 0x9000u);  // offsets count from the window's start
  // Pages 3 and 8: rail 0 takes page 3 (first window, its rail-0 key), rail 1 page 8
  // (second window, its rail-1 key); no op mixes the two windows.
  WorkBatch c = batch();
  group_->plan(c, local_, windowed, {PagedWrite{{src.data(), 2}, {dst.data() + 1, 2}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u});
  uint64_t keys_seen = 0;
  for (const auto& op : c.ops)
    for (size_t k = 0; k < op.iov_count; ++k) keys_seen += op.rma[k].key;
  EXPECT_EQ(keys_seen, 101u + 202u);
  // A page in the gap, or a single write running past a window's end: refused.
  std::vector<int64_t> gap = {5};
  WorkBatch d = batch();
  EXPECT_THROW(group_->plan(d, local_, windowed, {PagedWrite{{src.data(), 1}, {gap.data(), 1}, 4 * KiB, 4 * KiB, 4 * KiB, 0, 0}, 5u}),
               BoundsError);
  EXPECT_THROW(group_->plan(d, local_, windowed, {SingleWrite{0, 3 * 4 * KiB, 2 * 4 * KiB}, 1u}), BoundsError);
}

}  // namespace kvxfer
