// One counter that many transfers finish into, so a caller with thousands of writes in
// flight waits for "at least n finished" in one call instead of one handle per write (a
// GIL round trip each from Python). Transfers submitted with a counter bump it when they
// finish, from whichever thread finishes them (the progress worker, or the submitter for
// inline same-host copies). No locks: the counts are atomics, the first error is written
// once by the thread that wins a flag, and waiters sleep on a futex word that is bumped
// only when the count reaches the lowest count a sleeper waits for. Waking a waiter for
// every finish cost a deep 4 KiB stream over net 4,000 wake-ups a second; each preempted
// the progress thread on a 2-core machine.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "futex_wait.hpp"

namespace kvxfer {

class CompletionCounter {
 public:
  // How long a waiter yields before it sleeps: about one small write's round trip here,
  // so a window that drains steadily is followed without a futex sleep per wake-up.
  static constexpr int64_t kWaitSpinNs = 50'000;

  // Called for every transfer submitted with this counter, before it can finish.
  void add_submitted(uint64_t n) { submitted_.fetch_add(n, std::memory_order_relaxed); }
  // Called once per transfer when it finishes; ok false for failed or timed out.
  void on_finish(bool ok, const std::string& why) {
    if (!ok) {
      failed_.fetch_add(1, std::memory_order_relaxed);
      uint32_t expected = 0;
      if (error_state_.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
        first_error_ = why;
        error_state_.store(2, std::memory_order_release);
      }
    }
    // failed_ before finished_: a waiter that sees n finished sees their failures too.
    const uint64_t done = finished_.fetch_add(1, std::memory_order_seq_cst) + 1;
    // finished_ is stored before wake_at_ is read, and a sleeper stores wake_at_ before it
    // reads finished_ (all seq_cst): one of the two sees the other, so no wake is lost.
    if (done >= wake_at_.load(std::memory_order_seq_cst)) wake_sleepers();
  }

  uint64_t submitted() const { return submitted_.load(std::memory_order_relaxed); }
  // Times sleepers were woken (for tests: a finish short of every sleeper's count wakes none).
  uint64_t wakes() const { return wakes_.load(std::memory_order_relaxed); }
  // True while a sleeper waits for a count of n or less that is not reached (for tests).
  bool has_sleeper_for(uint64_t n) const {
    return wake_at_.load(std::memory_order_seq_cst) <= n && finished() < n;
  }
  uint64_t finished() const { return finished_.load(std::memory_order_acquire); }
  uint64_t failed() const { return failed_.load(std::memory_order_acquire); }
  // The first failure's reason ("" if none yet, or while it is being written).
  std::string first_error() const {
    return error_state_.load(std::memory_order_acquire) == 2 ? first_error_ : std::string();
  }

  // True once at least n transfers finished, false at the deadline. Yields for up to
  // kWaitSpinNs, then sleeps until the count reaches n (or a lower count another sleeper
  // waits for: then it sleeps again) or the deadline.
  bool wait_at_least(uint64_t n, int64_t deadline_ns) {
    if (finished() >= n) return true;
    const int64_t spin_until = std::min(deadline_ns, monotonic_ns() + kWaitSpinNs);
    while (finished() < n && monotonic_ns() < spin_until) sched_yield();
    for (;;) {
      uint32_t seen = seq_.load(std::memory_order_seq_cst);
      if (finished() >= n) return true;
      if (monotonic_ns() >= deadline_ns) return false;
      lower_wake_at(n);
      if (finished() < n) futex_wait_until(&seq_, seen, deadline_ns);
    }
  }

 private:
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> finished_{0};
  std::atomic<uint64_t> failed_{0};
  static constexpr uint64_t kNoSleeper = UINT64_MAX;

  // Makes wake_at_ at most n (the lowest count any sleeper waits for).
  void lower_wake_at(uint64_t n) {
    uint64_t at = wake_at_.load(std::memory_order_seq_cst);
    while (n < at && !wake_at_.compare_exchange_weak(at, n, std::memory_order_seq_cst)) {
    }
  }
  // Wakes every sleeper; those still short of their count lower wake_at_ again and sleep.
  void wake_sleepers() {
    wake_at_.store(kNoSleeper, std::memory_order_seq_cst);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    wakes_.fetch_add(1, std::memory_order_relaxed);
    futex_wake_all(&seq_);
  }

  std::atomic<uint32_t> seq_{0};  // futex word: bumped when sleepers are woken
  std::atomic<uint64_t> wake_at_{kNoSleeper};  // lowest count a sleeper waits for
  std::atomic<uint64_t> wakes_{0};
  std::atomic<uint32_t> error_state_{0};  // 0 none, 1 being written, 2 first_error_ readable
  std::string first_error_;
};

}  // namespace kvxfer
