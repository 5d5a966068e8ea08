// ImmCounter: arrivals counted per 32-bit immediate. Several threads write: the progress
// worker adds arrivals (and claims and releases slots), Python threads consume and reset
// counts (consume_imm, reset_imm) at any time, concurrently with the worker and with each
// other; any thread may read. A fixed open-addressing table of atomics keeps every access
// lock-free: slots are claimed by compare-and-swap, counts change only by atomic
// read-modify-write, and a released slot becomes a tombstone that lookups step over, so a
// lookup never races a deletion into a wrong answer for a live value.
//
// Two ways to fill it (ImmediateTracker decides which):
// - add(claim=true): the first arrival of a value claims a slot. Slots are then never
//   released, so the table holds imm_table_capacity distinct values for the engine's life;
//   an arrival for a new value once every slot is taken is dropped, counted in
//   overflowed(), and lost(imm) tells waiters so they fail at once instead of waiting for a
//   count that can never be reached.
// - claim()/release() by the owner of the values (a decoder's live reservations), with
//   add(claim=false): an arrival for a value nobody claimed takes no slot, so a sender
//   cannot fill the table, and a released slot is reusable at once.
//
// Contract for release(): no thread consumes or resets the released value afterwards (its
// slot may already count another value); the decoders release a value only once its
// reservation has ended.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "engine_types.hpp"
#include "rail_group.hpp"

namespace kvxfer {

class ImmCounterTable {
 public:
  explicit ImmCounterTable(size_t capacity_pow2)
      : mask_(capacity_pow2 - 1), slots_(new Slot[capacity_pow2]) {
    if (capacity_pow2 < 2 || (capacity_pow2 & mask_))
      throw EngineError("imm_table_capacity must be a power of two >= 2, got " +
                        std::to_string(capacity_pow2));
  }

  size_t capacity() const { return mask_ + 1; }

  // Counts are kept in fixed point (kImmUnit per unit, see encode_imm); add() takes and
  // returns fixed-point units, get() and consume() whole units. With `claim`, an imm
  // without a slot takes a free one; returns 0 (and counts the arrival as overflowed) when
  // none is free. Without `claim`, returns 0 for an imm without a slot and counts nothing:
  // the caller decides what such an arrival is.
  uint64_t add(uint32_t imm, uint64_t units, bool claim = true) {
    Slot* s = find(imm, claim);
    if (!s) {
      if (claim) overflowed_.fetch_add(1, std::memory_order_relaxed);
      return 0;
    }
    return s->count.fetch_add(units, std::memory_order_acq_rel) + units;
  }

  // Worker only: takes a slot for imm (counting from zero) unless it has one. False when
  // every slot is held by another value.
  bool claim(uint32_t imm) {
    if (find(imm, /*claim=*/false)) return true;
    if (!find(imm, /*claim=*/true)) return false;
    claimed_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Worker only: gives imm's slot back (its count is forgotten); later arrivals for imm
  // find no slot. A no-op for an imm without one.
  void release(uint32_t imm) {
    const uint64_t key = static_cast<uint64_t>(imm) + 1;
    size_t i = home(imm);
    for (size_t probe = 0; probe <= mask_; ++probe, i = (i + 1) & mask_) {
      const uint64_t k = slots_[i].key.load(std::memory_order_acquire);
      if (k == 0) return;
      if (k != key) continue;
      slots_[i].count.store(0, std::memory_order_release);
      slots_[i].key.store(kTombstone, std::memory_order_release);
      claimed_.fetch_sub(1, std::memory_order_relaxed);
      // A tombstone followed by an empty slot ends no probe chain any more: empty it, and
      // the tombstones before it, so lookups of absent values (every dropped arrival) stay
      // short however many values came and went.
      for (size_t j = i; slots_[(j + 1) & mask_].key.load(std::memory_order_acquire) == 0 &&
                         slots_[j].key.load(std::memory_order_acquire) == kTombstone;
           j = (j - 1) & mask_)
        slots_[j].key.store(0, std::memory_order_release);
      return;
    }
  }

  // Values holding a slot through claim() and not yet released.
  uint64_t claimed() const { return claimed_.load(std::memory_order_relaxed); }

  uint64_t get(uint32_t imm) const {
    const Slot* s = const_cast<ImmCounterTable*>(this)->find(imm, /*claim=*/false);
    return s ? s->count.load(std::memory_order_acquire) / kImmUnit : 0;
  }

  // Subtracts what a finished request consumed, keeping arrivals that came after it. Never
  // below zero: one compare-and-swap over the value it read, so a concurrent consume or
  // reset cannot make it subtract what is no longer there (and wrap around).
  void consume(uint32_t imm, uint64_t units) {
    Slot* s = find(imm, /*claim=*/false);
    if (!s) return;
    const uint64_t want = units > UINT64_MAX / kImmUnit ? UINT64_MAX : units * kImmUnit;
    uint64_t cur = s->count.load(std::memory_order_acquire);
    while (!s->count.compare_exchange_weak(cur, cur - std::min(want, cur), std::memory_order_acq_rel,
                                           std::memory_order_acquire)) {
    }
  }

  // Forgets everything counted for imm, fractions of sharded writes included. Only for a
  // value no write can still arrive for (its sender finished, failed or timed out). The
  // slot stays claimed for imm.
  void reset(uint32_t imm) {
    Slot* s = find(imm, /*claim=*/false);
    if (s) s->count.store(0, std::memory_order_release);
  }

  uint64_t overflowed() const { return overflowed_.load(std::memory_order_relaxed); }

  // True when arrivals for imm cannot be counted: the table is full (an arrival was
  // already dropped) and imm holds no slot. Exact while slots are never released (the
  // add(claim=true) way): such an imm had its arrivals, if any, dropped, and every later
  // one will be too. The claim() way never overflows.
  bool lost(uint32_t imm) const {
    return overflowed() > 0 && !const_cast<ImmCounterTable*>(this)->find(imm, /*claim=*/false);
  }

 private:
  struct Slot {
    std::atomic<uint64_t> key{0};  // imm + 1; 0 marks an empty slot, kTombstone a released one
    std::atomic<uint64_t> count{0};
  };
  // Never imm + 1 for a 32-bit imm.
  static constexpr uint64_t kTombstone = UINT64_MAX;

  size_t home(uint32_t imm) const { return (imm * 0x9E3779B1u) & mask_; }

  // imm's slot; with `claim`, a free one taken for it when it has none (the first
  // tombstone on its probe chain, else the empty slot that ends the chain).
  Slot* find(uint32_t imm, bool claim) {
    const uint64_t key = static_cast<uint64_t>(imm) + 1;
    size_t i = home(imm);
    Slot* reusable = nullptr;
    for (size_t probe = 0; probe <= mask_; ++probe, i = (i + 1) & mask_) {
      uint64_t k = slots_[i].key.load(std::memory_order_acquire);
      if (k == key) return &slots_[i];
      if (k == kTombstone) {
        if (!reusable) reusable = &slots_[i];
        continue;
      }
      if (k == 0) {
        if (!claim) return nullptr;
        return take(reusable ? reusable : &slots_[i], key);
      }
    }
    return claim && reusable ? take(reusable, key) : nullptr;
  }

  // Only the worker claims and releases, but a compare-and-swap costs nothing next to the
  // completion that brought the arrival, and keeps two claimers from taking one slot.
  Slot* take(Slot* s, uint64_t key) {
    uint64_t k = s->key.load(std::memory_order_acquire);
    if ((k == 0 || k == kTombstone) && s->key.compare_exchange_strong(k, key, std::memory_order_acq_rel))
      return s;
    return k == key ? s : nullptr;  // another thread claimed it for the same value, or lost a race
  }

  const size_t mask_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> overflowed_{0};
  std::atomic<uint64_t> claimed_{0};
};

}  // namespace kvxfer
