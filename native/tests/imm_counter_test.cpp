// ImmCounterTable (imm_counter.hpp): per-value counts in fixed point, overflow that is
// counted and reported, and correct counts with several writers at once (the worker adds
// while Python threads consume and reset).
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "imm_counter.hpp"

namespace kvxfer {
namespace {

TEST(ImmCounter, CountsEachValueSeparatelyInWholeUnits) {
  ImmCounterTable t(64);
  t.add(7, 3 * kImmUnit);
  t.add(8, kImmUnit);
  t.add(7, kImmUnit);
  EXPECT_EQ(t.get(7), 4u);
  EXPECT_EQ(t.get(8), 1u);
  EXPECT_EQ(t.get(9), 0u);
  EXPECT_EQ(t.overflowed(), 0u);
}

TEST(ImmCounter, ShardsOfOneWriteCountOneUnitOnlyOnceAllArrived) {
  ImmCounterTable t(64);
  const uint32_t n = 3;  // weights as plan_write gives them: the last takes the remainder
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(t.get(5), 0u) << "counted before shard " << i;
    t.add(5, kImmUnit / n + (i + 1 == n ? kImmUnit % n : 0));
  }
  EXPECT_EQ(t.get(5), 1u);
}

TEST(ImmCounter, ConsumeKeepsLaterArrivalsAndResetForgetsFractions) {
  ImmCounterTable t(64);
  t.add(1, 5 * kImmUnit + kImmUnit / 2);
  t.consume(1, 3);
  EXPECT_EQ(t.get(1), 2u);
  t.consume(1, 100);  // never below zero
  EXPECT_EQ(t.get(1), 0u);
  t.add(1, kImmUnit / 2);
  t.reset(1);
  t.add(1, kImmUnit / 2);
  EXPECT_EQ(t.get(1), 0u) << "reset kept a fraction";
}

TEST(ImmCounter, ArrivalsBeyondCapacityAreCountedAsOverflowsAndTheirValuesLost) {
  ImmCounterTable t(16);
  for (uint32_t imm = 0; imm < 16; ++imm) t.add(imm, kImmUnit);
  EXPECT_EQ(t.overflowed(), 0u);
  EXPECT_FALSE(t.lost(100)) << "nothing was dropped yet";
  EXPECT_EQ(t.add(100, kImmUnit), 0u);
  EXPECT_EQ(t.add(101, kImmUnit), 0u);
  EXPECT_EQ(t.overflowed(), 2u);
  EXPECT_TRUE(t.lost(100));
  EXPECT_TRUE(t.lost(999)) << "no slot can ever count it";
  EXPECT_FALSE(t.lost(3)) << "values with a slot keep counting";
  t.add(3, kImmUnit);
  EXPECT_EQ(t.get(3), 2u);
}

TEST(ImmCounter, ArrivalsWithoutClaimCountOnlyForClaimedValues) {
  ImmCounterTable t(16);
  EXPECT_EQ(t.add(3, kImmUnit, /*claim=*/false), 0u);
  EXPECT_EQ(t.get(3), 0u);
  EXPECT_EQ(t.overflowed(), 0u) << "an unclaimed value is not an overflow";
  ASSERT_TRUE(t.claim(3));
  EXPECT_EQ(t.add(3, kImmUnit, /*claim=*/false), kImmUnit);
  EXPECT_TRUE(t.claim(3)) << "claiming a held value again keeps its count";
  EXPECT_EQ(t.get(3), 1u);
  EXPECT_EQ(t.claimed(), 1u);
}

// Values come and go for the engine's whole life (one per reservation): released slots must
// be reusable, and a value released while others share its probe chain must not hide them.
// The hash keeps the low bits' order, so values 16 apart share a home slot in a 16-slot table
// and form one long chain.
TEST(ImmCounter, ReleasedSlotsAreReusedForeverAndNeverHideValuesFurtherAlongAChain) {
  ImmCounterTable t(16);
  const auto value = [](uint32_t round, uint32_t k) { return round * 1024 + k * 16; };
  for (uint32_t round = 0; round < 1000; ++round) {
    for (uint32_t k = 0; k < 12; ++k) ASSERT_TRUE(t.claim(value(round, k))) << "round " << round << " k " << k;
    for (uint32_t k = 0; k < 12; ++k) t.add(value(round, k), (k + 1) * kImmUnit, /*claim=*/false);
    // Release every other value: the rest must keep their counts, further along the chain too.
    for (uint32_t k = 0; k < 12; k += 2) t.release(value(round, k));
    for (uint32_t k = 1; k < 12; k += 2) ASSERT_EQ(t.get(value(round, k)), k + 1) << "round " << round << " k " << k;
    for (uint32_t k = 0; k < 12; k += 2) ASSERT_EQ(t.get(value(round, k)), 0u) << k;
    for (uint32_t k = 1; k < 12; k += 2) t.release(value(round, k));
    ASSERT_EQ(t.claimed(), 0u);
  }
  EXPECT_EQ(t.overflowed(), 0u);
}

TEST(ImmCounter, CapacityThatIsNotAPowerOfTwoIsRefused) {
  EXPECT_THROW(ImmCounterTable(24), EngineError);
  EXPECT_THROW(ImmCounterTable(1), EngineError);
}

// Python threads consume concurrently with each other and with the worker's arrivals: two
// consumers that both read "1 unit left" must not both subtract it (a load followed by a
// separate subtract wrapped the count to ~2^48 units). Consumers outpace the one adder, so
// the count sits at 0 or 1 unit and every arrival is raced for.
TEST(ImmCounter, ConcurrentConsumersAndResetsNeverWrapTheCountBelowZero) {
  ImmCounterTable t(64);
  t.add(9, 0);  // claim the slot up front
  constexpr int kConsumers = 3;
  constexpr uint64_t kArrivals = 2'000'000;
  std::atomic<bool> adding{true}, wrapped{false};
  std::vector<std::thread> threads;
  for (int k = 0; k < kConsumers; ++k)
    threads.emplace_back([&, k] {
      for (uint64_t n = 0; adding.load(std::memory_order_relaxed) && !wrapped.load(std::memory_order_relaxed); ++n) {
        if (k == 0 && n % 64 == 0)
          t.reset(9);
        else
          t.consume(9, 1);
        if (t.get(9) > kArrivals) wrapped = true;
      }
    });
  for (uint64_t i = 0; i < kArrivals && !wrapped.load(std::memory_order_relaxed); ++i) t.add(9, kImmUnit);
  adding = false;
  for (auto& th : threads) th.join();
  EXPECT_FALSE(wrapped) << "the count wrapped below zero";
  EXPECT_LE(t.get(9), kArrivals);
}

TEST(ImmCounter, ConcurrentAddersOfManyValuesGetOneSlotPerValueAndExactCounts) {
  ImmCounterTable t(1024);
  constexpr int kThreads = 4, kValues = 500, kRepeats = 20;
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k)
    threads.emplace_back([&] {
      for (int rep = 0; rep < kRepeats; ++rep)
        for (uint32_t v = 0; v < kValues; ++v) t.add(v, kImmUnit);
    });
  for (auto& th : threads) th.join();
  for (uint32_t v = 0; v < kValues; ++v) ASSERT_EQ(t.get(v), uint64_t(kThreads * kRepeats)) << v;
  EXPECT_EQ(t.overflowed(), 0u);
}

}  // namespace
}  // namespace kvxfer
