// Blocking waits on a 32-bit atomic word with a deadline (Linux futex), so threads that
// wait for a transfer or an immediate count sleep without a mutex on the worker's path.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

namespace kvxfer {

inline int64_t monotonic_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Sleeps while *word == expected, at most until deadline_ns (monotonic). Spurious wake-ups
// are fine: callers re-check their condition in a loop.
inline void futex_wait_until(std::atomic<uint32_t>* word, uint32_t expected, int64_t deadline_ns) {
  int64_t left = deadline_ns - monotonic_ns();
  if (left <= 0) return;
  struct timespec ts;
  ts.tv_sec = left / 1000000000LL;
  ts.tv_nsec = left % 1000000000LL;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace kvxfer
