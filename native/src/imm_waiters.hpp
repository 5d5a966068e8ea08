// Threads blocked in wait_imm, each waiting for one (immediate, count). The progress worker
// wakes a waiter only once its count is reached (or its arrivals are being dropped, or the
// engine stops), not on every round that counted an arrival: a decoder waiting for a
// request's N pages used to be woken, rescheduled and put back to sleep once per completion
// batch, two futex calls and a context switch per few pages on a 2-core machine (4,221
// futex calls for 2,278 arrivals over net with 4 KiB pages, the target's largest syscall
// cost).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "futex_wait.hpp"

namespace kvxfer {

class ImmWaiters {
 public:
  // Threads that may wait at once with a targeted wake; more fall back to being woken on
  // every arrival round (ProgressWorker::wait_imm), still correct, only slower.
  static constexpr size_t kSlots = 64;

  // Claims a slot for a waiter of (imm, count); -1 when every slot is taken.
  int claim(uint32_t imm, uint64_t count) {
    for (size_t i = 0; i < kSlots; ++i) {
      Slot& s = slots_[i];
      uint32_t free = kFree;
      if (!s.state.compare_exchange_strong(free, kFilling, std::memory_order_acq_rel)) continue;
      s.imm.store(imm, std::memory_order_relaxed);
      s.count.store(count, std::memory_order_relaxed);
      // seq_cst publication pairs with the worker's seq_cst scan (see wake_ready).
      s.state.store(kWaiting, std::memory_order_seq_cst);
      active_.fetch_add(1, std::memory_order_seq_cst);
      return static_cast<int>(i);
    }
    return -1;
  }

  void release(int slot) {
    active_.fetch_sub(1, std::memory_order_seq_cst);
    slots_[slot].state.store(kFree, std::memory_order_release);
  }

  // The slot's futex word. A waiter loads it, then (after a seq_cst fence) reads the count,
  // and sleeps only while the word still holds what it loaded.
  std::atomic<uint32_t>& word(int slot) { return slots_[slot].wake; }

  // Worker: after a round that counted arrivals. `ready(imm, count)` says whether a waiter
  // of that count may stop waiting. The counter updates came before this call; the fence
  // orders them before the scan, so a waiter that read the old count is seen here.
  template <class Ready>
  void wake_ready(Ready&& ready) {
    if (active_.load(std::memory_order_seq_cst) == 0) return;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (auto& s : slots_) {
      if (s.state.load(std::memory_order_seq_cst) != kWaiting) continue;
      if (!ready(s.imm.load(std::memory_order_relaxed), s.count.load(std::memory_order_relaxed))) continue;
      s.wake.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(&s.wake);
    }
  }

  // Wakes every waiter (the engine is stopping).
  void wake_all() {
    for (auto& s : slots_) {
      s.wake.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(&s.wake);
    }
  }

 private:
  static constexpr uint32_t kFree = 0, kFilling = 1, kWaiting = 2;
  struct Slot {
    std::atomic<uint32_t> state{kFree};
    std::atomic<uint32_t> imm{0};
    std::atomic<uint64_t> count{0};
    std::atomic<uint32_t> wake{0};
  };
  std::array<Slot, kSlots> slots_;
  std::atomic<uint32_t> active_{0};
};

}  // namespace kvxfer
