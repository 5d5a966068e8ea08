// ImmediateTracker's source check (immediate_tracker.hpp): an immediate bound to a peer
// counts only arrivals from that peer's rails, on the rails of ours they write to. A rail
// of ours may accept several senders, or none (a 1-rail peer writing to a 2-rail decoder).
// Arrivals through the same-host immediate ring are checked by the writer engine's id.
#include <gtest/gtest.h>

#include <cstdint>

#include "immediate_tracker.hpp"

namespace kvxfer {
namespace {

uint64_t one_unit(uint32_t imm) { return (static_cast<uint64_t>(kImmUnit) << 32) | imm; }

TEST(ImmediateTracker, ABoundImmediateCountsOnlyTheSendersListedForTheRailItCameInOn) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  // Our rail 0 accepts AV addresses 10 and 12, our rail 1 accepts 11 and 13.
  imms.bind_source(7, {{10, 12}, {11, 13}}, 99);
  imms.on_arrival(one_unit(7), 0, 10);
  imms.on_arrival(one_unit(7), 0, 12);
  imms.on_arrival(one_unit(7), 1, 11);
  imms.on_arrival(one_unit(7), 1, 13);
  EXPECT_EQ(imms.table().get(7), 4u);
  imms.on_arrival(one_unit(7), 0, 11);  // listed, but for the other rail
  imms.on_arrival(one_unit(7), 1, 99);  // another engine
  imms.on_arrival(one_unit(7), 2, 10);  // a rail this binding has no entry for
  EXPECT_EQ(imms.table().get(7), 4u);
  EXPECT_EQ(imms.foreign_dropped(), 3u);
  imms.on_arrival(one_unit(8), 1, 99);  // an unbound immediate counts from anyone
  EXPECT_EQ(imms.table().get(8), 1u);
}

TEST(ImmediateTracker, ARailThePeerDoesNotWriteToCreditsNothingAndUnbindLetsAnyoneCountAgain) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  imms.bind_source(7, {{10}, {}}, 99);  // a 1-rail prefiller writing to a 2-rail decoder
  imms.on_arrival(one_unit(7), 1, 10);
  EXPECT_EQ(imms.table().get(7), 0u);
  EXPECT_EQ(imms.foreign_dropped(), 1u);
  imms.unbind_source(7);
  imms.on_arrival(one_unit(7), 1, 99);
  EXPECT_EQ(imms.table().get(7), 1u);
}

TEST(ImmediateTracker, ABoundImmediateCountsRingArrivalsOnlyFromTheBoundEngine) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  imms.bind_source(7, {{10}}, 99);
  imms.on_ring_arrival(one_unit(7), 99);
  imms.on_ring_arrival(one_unit(7), 98);  // another same-host engine
  EXPECT_EQ(imms.table().get(7), 1u);
  EXPECT_EQ(imms.foreign_dropped(), 1u);
  imms.on_ring_arrival(one_unit(8), 98);  // an unbound immediate counts from anyone
  EXPECT_EQ(imms.table().get(8), 1u);
}

// A decoder counts claimed values only: a sender spraying more distinct values than the
// table has slots takes none of them, and a claim made afterwards still counts.
TEST(ImmediateTracker, ClaimedOnlyDropsUnclaimedValuesWithoutTakingSlotsAndAReleasedSlotIsReused) {
  EventQueue events;
  ImmediateTracker imms(16, events, /*claimed_only=*/true);
  for (uint32_t v = 0x80000000u; v < 0x80000000u + 1000; ++v) imms.on_arrival(one_unit(v), 0, 1);
  EXPECT_EQ(imms.unclaimed_dropped(), 1000u);
  EXPECT_EQ(imms.table().overflowed(), 0u);
  EXPECT_EQ(imms.table().claimed(), 0u);
  for (uint32_t v = 1; v <= 16; ++v) ASSERT_TRUE(imms.claim(v)) << v;
  EXPECT_FALSE(imms.claim(17)) << "16 live claims fill a 16-slot table";
  imms.on_arrival(one_unit(5), 0, 1);
  imms.on_ring_arrival(one_unit(5), 42);
  EXPECT_EQ(imms.table().get(5), 2u);
  imms.release(5);
  imms.on_arrival(one_unit(5), 0, 1);
  EXPECT_EQ(imms.table().get(5), 0u) << "a released value counts again";
  EXPECT_EQ(imms.unclaimed_dropped(), 1001u);
  ASSERT_TRUE(imms.claim(17)) << "the released slot is free again";
  imms.on_arrival(one_unit(17), 0, 1);
  EXPECT_EQ(imms.table().get(17), 1u);
  EXPECT_EQ(imms.table().claimed(), 16u);
}

}  // namespace
}  // namespace kvxfer
