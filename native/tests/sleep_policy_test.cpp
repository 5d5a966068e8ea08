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
  s.ops_in_flight = 4;                // even with ops in flight
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
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 99 * kMs, 1, true), 0u);  // busy, shallow: poll again
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 99 * kMs, kBusyNapMinInflight, true), kBusyNapUs);
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 97 * kMs, 0, true), kQuietSleepMinUs);
  EXPECT_EQ(nap_after_wake_us(2000 * kMs, 0, 0, true), kQuietSleepMaxUs);
}

TEST(SleepPolicy, AWakeUpAfterARealOneIsNeverDelayed) {
  // The first arrival after a quiet spell on a poll set that speaks only of work.
  EXPECT_EQ(nap_after_wake_us(2000 * kMs, 0, 0, false), 0u);
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 97 * kMs, 0, false), 0u);
  EXPECT_EQ(nap_after_wake_us(100 * kMs, 99 * kMs, kBusyNapMinInflight, false), 0u);
}

TEST(SleepPolicy, NothingInFlightShortlyAfterActivityLooksAndOpsInFlightLetItBlock) {
  // Between the requests of a conversation: look (0) until the engine went quiet.
  Idle s = idle_at(100 * kMs, 99 * kMs);
  EXPECT_EQ(block_timeout_ms(s), 0);
  s.transfers_live = true;  // a transfer accepted, its ops not posted yet
  EXPECT_EQ(block_timeout_ms(s), 0);
  // Ops in flight: their completions wake the worker, so it blocks.
  s.ops_in_flight = 1;
  EXPECT_EQ(block_timeout_ms(s), kMaxSleepMs);
  // Quiet with nothing in flight: block as an idle engine does.
  s = idle_at(100 * kMs, 97 * kMs);
  EXPECT_EQ(block_timeout_ms(s), kIdleSleepMs);
}

TEST(SleepPolicy, RequestsComingFurtherApartThanTheQuietSpellAreNotLookedFor) {
  Idle s = idle_at(100 * kMs, 99 * kMs);
  s.last_long_gap_ns = 1 * kMs;  // writes 1 ms apart: the next is likely within the look
  EXPECT_EQ(block_timeout_ms(s), 0);
  s.last_long_gap_ns = 5 * kMs;  // 5 ms apart: looking 2 ms would find nothing
  EXPECT_EQ(block_timeout_ms(s), kIdleSleepMs);
  s.last_ring_arrival_ns = 99 * kMs;  // the same for a same-host ring's arrivals
  EXPECT_EQ(block_timeout_ms(s), kIdleSleepMs);
  s.last_long_gap_ns = 1 * kMs;
  EXPECT_EQ(block_timeout_ms(s), 0);
}

TEST(SleepPolicy, RailsWithoutAWaitFdArePolledOftenOnlyWhileTheEngineIsBusy) {
  // Busy (activity 1 ms ago), or told to only look: every 20 us, as before.
  EXPECT_EQ(pause_without_wait_fd_us(100 * kMs, 99 * kMs, kMaxSleepMs), kBusyPollWithoutFdUs);
  EXPECT_EQ(pause_without_wait_fd_us(100 * kMs, 0, 0), kBusyPollWithoutFdUs);
  // Quiet: 100 us, then 1 ms after a second of silence (an idle shm engine no longer looks
  // 50,000 times a second).
  EXPECT_EQ(pause_without_wait_fd_us(100 * kMs, 97 * kMs, kIdleSleepMs), kQuietSleepMinUs);
  EXPECT_EQ(pause_without_wait_fd_us(2000 * kMs, 0, kIdleSleepMs), kQuietSleepMaxUs);
  // Never past the policy's timeout.
  EXPECT_EQ(pause_without_wait_fd_us(2000 * kMs, 0, 1), 1000u);
}

}  // namespace
}  // namespace kvxfer::sleep_policy
