// ImmCounter: arrivals counted per 32-bit immediate. Several threads write: the progress
// worker adds arrivals (and claims slots for new values), Python threads consume and reset
// counts (consume_imm, reset_imm) at any time, concurrently with the worker and with each
// other; any thread may read. A fixed open-addressing table of atomics keeps every access
// lock-free: slots are claimed by compare-and-swap, counts change only by atomic
// read-modify-write, and slots are never removed, so a lookup can never race a deletion.
//
// The table is fixed in size (imm_table_capacity distinct values for the engine's life).
// An arrival for a new value once every slot is taken cannot be counted: it is dropped,
// counted in overflowed(), and lost(imm) tells waiters so they fail at once instead of
// waiting for a count that can never be reached.
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
  // returns fixed-point units, get() and consume() whole units. Returns 0 (and counts
  // the arrival as overflowed) when imm has no slot and none is free.
  uint64_t add(uint32_t imm, uint64_t units) {
    Slot* s = find(imm, /*claim=*/true);
    if (!s) {
      overflowed_.fetch_add(1, std::memory_order_relaxed);
      return 0;
    }
    return s->count.fetch_add(units, std::memory_order_acq_rel) + units;
  }

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
  // already dropped) and imm holds no slot. Exact, because slots are never freed: such an
  // imm had its arrivals, if any, dropped, and every later one will be too.
  bool lost(uint32_t imm) const {
    return overflowed() > 0 && !const_cast<ImmCounterTable*>(this)->find(imm, /*claim=*/false);
  }

 private:
  struct Slot {
    std::atomic<uint64_t> key{0};  // imm + 1; 0 marks an empty slot
    std::atomic<uint64_t> count{0};
  };

  Slot* find(uint32_t imm, bool claim) {
    const uint64_t key = static_cast<uint64_t>(imm) + 1;
    size_t i = (imm * 0x9E3779B1u) & mask_;
    for (size_t probe = 0; probe <= mask_; ++probe, i = (i + 1) & mask_) {
      uint64_t k = slots_[i].key.load(std::memory_order_acquire);
      if (k == key) return &slots_[i];
      if (k == 0) {
        if (!claim) return nullptr;
        // Today only the worker claims, but a compare-and-swap costs nothing next to the
        // completion that brought the arrival, and keeps two claimers from taking one slot.
        if (slots_[i].key.compare_exchange_strong(k, key, std::memory_order_acq_rel)) return &slots_[i];
        if (k == key) return &slots_[i];  // another thread claimed it for the same value
      }
    }
    return nullptr;
  }

  const size_t mask_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> overflowed_{0};
};

}  // namespace kvxfer
