// The progress worker's sleep decisions (sleep_policy.hpp): when it may block, for how long,
// and how long it naps after a wake-up with nothing to do.
#include <gtest/gtest.h>

#include "sleep_policy.hpp"

namespace kvxfer::sleep_policy {
namespace {

constexpr int64_t kMs = 1'000'000;

Idle idle_at(int64_t now_ns, int64_t last_activity_ns) {
  Idle s;
  s.now_ns = now_ns;
  s.last_activity_ns = last_activity_ns;
  return s;
}

TEST(SleepPolicy, AnIdleEngineSleepsLongAndOneWithLiveTransfersLooksAtDeadlinesOften) {
  Idle s = idle_at(100 * kMs, 0);
  EXPECT_EQ(block_timeout_ms(s), kIdleSleepMs);
  s.transfers_live = true;
  EXPECT_EQ(block_timeout_ms(s), kMaxSleepMs);
  s.work_waiting = true;
  EXPECT_EQ(block_timeout_ms(s), -1);
}

TEST(SleepPolicy, ARecentSameHostRingArrivalKeepsTheWorkerLookingUntilTheRingWentQuiet) {
  Idle s = idle_at(100 * kMs, 99 * kMs);
  s.last_ring_arrival_ns = 99 * kMs;  // 1 ms ago: a streaming same-host writer
  EXPECT_EQ(block_timeout_ms(s), 0);
  s.last_ring_arrival_ns = 97 * kMs;  // 3 ms ago: quiet, sleep as usual
  EXPECT_EQ(block_timeout_ms(s), kIdleSleepMs);
  s.work_waiting = true;
  EXPECT_EQ(block_timeout_ms(s), -1);
}

TEST(SleepPolicy, QueuedOpsKeepTheWorkerAwakeOnlyUntilTheRailWentQuiet) {
  // Activity 1 ms ago: a busy stream whose peer queue filled for a moment; retry at once.
  Idle s = idle_at(100 * kMs, 99 * kMs);
  s.ops_queued = true;
  s.transfers_live = true;
  EXPECT_EQ(block_timeout_ms(s), -1);
  // Nothing for 3 ms: a refused peer (frozen, never connected); sleep, retry within 1 ms.
  s.last_activity_ns = 97 * kMs;
  EXPECT_EQ(block_timeout_ms(s), kQueuedRetryMs);
  s.transfers_live = false;
  EXPECT_EQ(block_timeout_ms(s), kQueuedRetryMs);
}

TEST(SleepPolicy, ACallersDeadlineIsRoundedUpAndNeverOverslept) {
  Idle s = idle_at(100 * kMs, 0);
  s.wake_by_ns = 100 * kMs + kMs / 2;  // half a millisecond left: sleep it, do not spin it
  EXPECT_EQ(block_timeout_ms(s), 1);
  s.wake_by_ns = 100 * kMs + 30 * kMs;
  EXPECT_EQ(block_timeout_ms(s), 30);
  s.wake_by_ns = 99 * kMs;  // already past
  EXPECT_EQ(block_timeout_ms(s), 0);
}

TEST(SleepPolicy, SpuriousWakeUpsNapLongerTheQuieterTheEngine) {
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 99 * kMs, 1), 0u);  // busy, shallow: poll again
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 99 * kMs, kBusyNapMinInflight), kBusyNapUs);
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 97 * kMs, 0), kQuietSleepMinUs);
  EXPECT_EQ(nap_after_wake_us(2000 * kMs, 0, 0), kQuietSleepMaxUs);
}

}  // namespace
}  // namespace kvxfer::sleep_policy
