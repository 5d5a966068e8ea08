// The completion counter (completion_counter.hpp): counts finished and failed transfers,
// keeps the first failure's reason, and wakes a waiter for "at least n finished" from
// another thread, or lets it go at its deadline.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvxfer
