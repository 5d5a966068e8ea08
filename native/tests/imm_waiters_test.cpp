// ImmWaiters (imm_waiters.hpp): the worker wakes a wait_imm caller only once its own count
// is reached, never on arrivals that leave it short, and every waiter when the engine stops.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "imm_waiters.hpp"

namespace kvxfer {
namespace {

TEST(ImmWaiters, WakesOnlyTheWaitersWhoseCountIsReached) {
  ImmWaiters w;
  const int a = w.claim(7, 3), b = w.claim(7, 10), c = w.claim(8, 1);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  ASSERT_GE(c, 0);
  const uint32_t wa = w.word(a).load(), wb = w.word(b).load(), wc = w.word(c).load();
  // imm 7 stands at 5: the waiter of 3 may go, the waiter of 10 and the one on 8 stay asleep.
  w.wake_ready([](uint32_t imm, uint64_t count) { return imm == 7 && count <= 5; });
  EXPECT_NE(w.word(a).load(), wa);
  EXPECT_EQ(w.word(b).load(), wb);
  EXPECT_EQ(w.word(c).load(), wc);
}

TEST(ImmWaiters, ReleasedSlotsAreNotWokenAndAreReused) {
  ImmWaiters w;
  const int a = w.claim(1, 1);
  ASSERT_GE(a, 0);
  w.release(a);
  const uint32_t before = w.word(a).load();
  w.wake_ready([](uint32_t, uint64_t) { return true; });
  EXPECT_EQ(w.word(a).load(), before);
  EXPECT_EQ(w.claim(2, 2), a);
}

TEST(ImmWaiters, TableFullReturnsMinusOneAndStopWakesEveryone) {
  ImmWaiters w;
  std::vector<int> slots;
  for (size_t i = 0; i < ImmWaiters::kSlots; ++i) slots.push_back(w.claim(static_cast<uint32_t>(i), 1));
  for (int s : slots) ASSERT_GE(s, 0);
  EXPECT_EQ(w.claim(99, 1), -1);
  std::vector<uint32_t> before;
  for (int s : slots) before.push_back(w.word(s).load());
  w.wake_all();
  for (size_t i = 0; i < slots.size(); ++i) EXPECT_NE(w.word(slots[i]).load(), before[i]);
}

TEST(ImmWaiters, ASleepingWaiterWakesWhenItsCountArrives) {
  ImmWaiters w;
  std::atomic<uint64_t> counter{0};
  const int slot = w.claim(5, 4);
  ASSERT_GE(slot, 0);
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    // The wait_imm loop, with a 10 s bound: a missed wake fails the test instead of hanging.
    const int64_t deadline = monotonic_ns() + 10'000'000'000LL;
    for (;;) {
      uint32_t seen = w.word(slot).load(std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (counter.load() >= 4 || monotonic_ns() >= deadline) break;
      futex_wait_until(&w.word(slot), seen, deadline);
    }
    done = counter.load() >= 4;
  });
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    counter.fetch_add(1);
    w.wake_ready([&](uint32_t, uint64_t count) { return counter.load() >= count; });
  }
  waiter.join();
  EXPECT_TRUE(done.load());
}

}  // namespace
}  // namespace kvxfer
