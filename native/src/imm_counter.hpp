// ImmCounter: arrivals counted per 32-bit immediate. The progress worker is the only
// writer; any thread may read. A fixed open-addressing table of atomics keeps reads and
// increments lock-free; slots are never removed, so a lookup can never race a deletion.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "engine_types.hpp"
#include "rail_group.hpp"

namespace kvxfer {

class ImmCounterTable {
 public:
  explicit ImmCounterTable(size_t capacity_pow2)
      : mask_(capacity_pow2 - 1), slots_(new Slot[capacity_pow2]) {}

  // Counts are kept in fixed point (kImmUnit per unit, see encode_imm); add() takes and
  // returns fixed-point units, get() and consume() whole units. Worker thread only.
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

  // Subtracts what a finished request consumed, keeping arrivals that came after it.
  void consume(uint32_t imm, uint64_t units) {
    Slot* s = find(imm, /*claim=*/false);
    if (s) s->count.fetch_sub(std::min<uint64_t>(units * kImmUnit, s->count.load()), std::memory_order_acq_rel);
  }

  // Forgets everything counted for imm, fractions of sharded writes included. Only for a
  // value no write can still arrive for (its sender finished, failed or timed out).
  void reset(uint32_t imm) {
    Slot* s = find(imm, /*claim=*/false);
    if (s) s->count.store(0, std::memory_order_release);
  }

  uint64_t overflowed() const { return overflowed_.load(std::memory_order_relaxed); }

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
        // Only the worker claims, so a plain store is enough.
        slots_[i].key.store(key, std::memory_order_release);
        return &slots_[i];
      }
    }
    return nullptr;
  }

  const size_t mask_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> overflowed_{0};
};

}  // namespace kvxfer
