// The completion counter (completion_counter.hpp): counts finished and failed transfers,
// keeps the first failure's reason, and wakes a waiter for "at least n finished" from
// another thread, or lets it go at its deadline.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "completion_counter.hpp"

namespace kvxfer {
namespace {

constexpr int64_t kMs = 1'000'000;

TEST(CompletionCounter, CountsFinishedAndFailedAndKeepsTheFirstError) {
  CompletionCounter c;
  c.add_submitted(4);
  c.on_finish(true, "");
  c.on_finish(false, "first reason");
  c.on_finish(false, "second reason");
  EXPECT_EQ(c.submitted(), 4u);
  EXPECT_EQ(c.finished(), 3u);
  EXPECT_EQ(c.failed(), 2u);
  EXPECT_EQ(c.first_error(), "first reason");
}

TEST(CompletionCounter, WaitReturnsAtOnceWhenReachedAndFalseAtTheDeadline) {
  CompletionCounter c;
  c.on_finish(true, "");
  EXPECT_TRUE(c.wait_at_least(1, monotonic_ns()));
  const int64_t start = monotonic_ns();
  EXPECT_FALSE(c.wait_at_least(2, start + 20 * kMs));
  EXPECT_GE(monotonic_ns() - start, 20 * kMs);
}

TEST(CompletionCounter, AWaiterPastItsSpinIsWokenByAnotherThreadsFinish) {
  CompletionCounter c;
  std::thread finisher([&c] {
    // Well past kWaitSpinNs, so the waiter sleeps on the futex and must be woken.
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    for (int i = 0; i < 3; ++i) c.on_finish(true, "");
  });
  const int64_t start = monotonic_ns();
  EXPECT_TRUE(c.wait_at_least(3, start + 5'000 * kMs));
  EXPECT_LT(monotonic_ns() - start, 2'000 * kMs) << "woken by the finishes, not the deadline";
  finisher.join();
}

// Waits until `c` has a sleeper whose count is not reached (it lowered wake_at_).
void wait_for_a_sleeper(CompletionCounter& c, uint64_t n) {
  const int64_t give_up = monotonic_ns() + 5'000 * kMs;
  // The waiter spins kWaitSpinNs first; past that, with the count short, it sleeps.
  while (monotonic_ns() < give_up && !c.has_sleeper_for(n)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(c.has_sleeper_for(n)) << "the waiter never went to sleep";
}

TEST(CompletionCounter, FinishesShortOfTheSleepersCountWakeNobody) {
  CompletionCounter c;
  bool reached = false;
  std::thread waiter([&c, &reached] { reached = c.wait_at_least(100, monotonic_ns() + 5'000 * kMs); });
  wait_for_a_sleeper(c, 100);
  for (int i = 0; i < 99; ++i) c.on_finish(true, "");
  EXPECT_EQ(c.wakes(), 0u) << "a finish short of the count woke the sleeper";
  c.on_finish(true, "");
  waiter.join();
  EXPECT_TRUE(reached);
  EXPECT_EQ(c.wakes(), 1u);
}

TEST(CompletionCounter, SleepersWithDifferentCountsAreEachWokenAtTheirOwn) {
  CompletionCounter c;
  std::atomic<int> done{0};
  std::thread low([&] { EXPECT_TRUE(c.wait_at_least(10, monotonic_ns() + 5'000 * kMs)); done.fetch_add(1); });
  wait_for_a_sleeper(c, 10);
  std::thread high([&] { EXPECT_TRUE(c.wait_at_least(20, monotonic_ns() + 5'000 * kMs)); done.fetch_add(1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the high waiter's spin
  int64_t start = monotonic_ns();
  for (int i = 0; i < 10; ++i) c.on_finish(true, "");
  low.join();
  // Both wait 5 s at most: a waiter that returns only then was woken by its deadline.
  EXPECT_LT(monotonic_ns() - start, 2'000 * kMs) << "the waiter for 10 was not woken by the 10th finish";
  EXPECT_EQ(done.load(), 1) << "the waiter for 20 returned at 10";
  wait_for_a_sleeper(c, 20);  // woken with the low one, it went back to sleep for its own count
  start = monotonic_ns();
  for (int i = 0; i < 10; ++i) c.on_finish(true, "");
  high.join();
  EXPECT_LT(monotonic_ns() - start, 2'000 * kMs) << "the waiter for 20 was not woken by the 20th finish";
  EXPECT_EQ(done.load(), 2);
}

}  // namespace
}  // namespace kvxfer
