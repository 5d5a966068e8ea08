// The deadline tracker (deadline_tracker.hpp): owns accepted batches, expires them in
// deadline order no more often than its check interval, keeps expired ones alive until
// released, and frees a batch when it is released from either list.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "deadline_tracker.hpp"

namespace kvxfer {
namespace {

std::unique_ptr<WorkBatch> new_batch(uint64_t id) {
  auto b = std::make_unique<WorkBatch>();
  b->transfer = std::make_shared<TransferState>();
  b->transfer->id = id;
  return b;
}

std::vector<uint64_t> expire_ids(DeadlineTracker& t, int64_t now) {
  std::vector<uint64_t> ids;
  t.expire_due(now, [&](WorkBatch* b) { ids.push_back(b->transfer->id); });
  return ids;
}

TEST(DeadlineTracker, TrackSetsTheDeadlineFromTheTimeout) {
  DeadlineTracker t(/*timeout_ns=*/100, /*check_interval_ns=*/0);
  WorkBatch* b = t.track(new_batch(1), 40);
  EXPECT_EQ(b->transfer->deadline_ns, 140);
  EXPECT_EQ(t.live_count(), 1u);
}

TEST(DeadlineTracker, ExpiresOnlyBatchesPastTheirDeadlineOldestFirst) {
  DeadlineTracker t(100, 0);
  t.track(new_batch(1), 0);
  t.track(new_batch(2), 10);
  t.track(new_batch(3), 20);
  EXPECT_TRUE(expire_ids(t, 99).empty());
  EXPECT_EQ(expire_ids(t, 110), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(t.live_count(), 1u);
  EXPECT_EQ(t.expired_count(), 2u);
  // An expired batch is not reported again.
  EXPECT_EQ(expire_ids(t, 500), (std::vector<uint64_t>{3}));
  EXPECT_TRUE(expire_ids(t, 1000).empty());
}

TEST(DeadlineTracker, LooksAtMostOncePerCheckInterval) {
  DeadlineTracker t(100, /*check_interval_ns=*/50);
  t.track(new_batch(1), 0);
  EXPECT_TRUE(expire_ids(t, 60).empty());    // looked at 60: not due yet
  EXPECT_TRUE(expire_ids(t, 105).empty());   // due, but the next look is at 110
  EXPECT_EQ(expire_ids(t, 110), (std::vector<uint64_t>{1}));
}

TEST(DeadlineTracker, ExpiredBatchesStayAliveUntilReleased) {
  DeadlineTracker t(100, 0);
  WorkBatch* b = t.track(new_batch(1), 0);
  std::weak_ptr<TransferState> alive = b->transfer;
  expire_ids(t, 200);
  EXPECT_FALSE(alive.expired()) << "its ops may still be on the fabric";
  t.release(b);
  EXPECT_TRUE(alive.expired());
  EXPECT_TRUE(t.empty());
}

TEST(DeadlineTracker, ReleaseFreesALiveBatchAndIgnoresUnknownOnes) {
  DeadlineTracker t(100, 0);
  WorkBatch* a = t.track(new_batch(1), 0);
  t.track(new_batch(2), 0);
  std::weak_ptr<TransferState> alive = a->transfer;
  t.release(a);
  EXPECT_TRUE(alive.expired());
  WorkBatch stranger;
  t.release(&stranger);  // not tracked: nothing happens
  EXPECT_EQ(t.live_count(), 1u);
  EXPECT_EQ(expire_ids(t, 100), (std::vector<uint64_t>{2}));
}

TEST(DeadlineTracker, ForEachVisitsLiveThenExpired) {
  DeadlineTracker t(100, 0);
  t.track(new_batch(1), 0);
  t.track(new_batch(2), 500);
  expire_ids(t, 150);
  std::vector<uint64_t> seen;
  t.for_each([&](WorkBatch* b) { seen.push_back(b->transfer->id); });
  EXPECT_EQ(seen, (std::vector<uint64_t>{2, 1}));
}

}  // namespace
}  // namespace kvxfer
