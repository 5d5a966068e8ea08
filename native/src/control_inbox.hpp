// Received control messages (engine.send/recv) that the application has not read yet,
// bounded in count and bytes: beyond either bound a message is dropped and counted, since
// a peer that sends to an application that never calls recv must not grow this process
// without end. The worker offers; any thread takes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "bounded_queue.hpp"
#include "engine_types.hpp"
#include "futex_wait.hpp"

namespace kvxfer {

// Engine-wide counters, not tied to a rail. Written by the worker, read by anyone.
struct EngineStats {
  std::atomic<uint64_t> inbox_dropped_messages{0}, inbox_dropped_bytes{0};
  // What the inbox holds now (recv takes away, the worker adds).
  std::atomic<uint64_t> inbox_messages{0}, inbox_bytes{0};
  // Immediates through same-host immediate rings: sent by this engine, received by it, and
  // sent over the fabric instead because a peer's lane was full or its engine closed.
  std::atomic<uint64_t> imm_ring_sent{0}, imm_ring_received{0}, imm_ring_fallbacks{0};
  // Times the progress worker came out of a sleep (an fd woke it or its timeout ran out):
  // what an idle engine costs, in wake-ups. Written by the worker only.
  std::atomic<uint64_t> worker_wakeups{0};
};

class ControlInbox {
 public:
  ControlInbox(size_t max_messages, size_t max_bytes, EngineStats& stats)
      : max_messages_(max_messages), max_bytes_(max_bytes), stats_(stats), queue_(pow2_at_least(max_messages)) {
    if (max_messages == 0 || max_bytes == 0) throw EngineError("inbox_max_messages and inbox_max_bytes must be > 0");
  }
  ~ControlInbox() {
    std::string* msg;
    while (queue_.try_pop(msg)) delete msg;
  }
  ControlInbox(const ControlInbox&) = delete;
  ControlInbox& operator=(const ControlInbox&) = delete;

  // Worker only. Only this thread adds, so the check below cannot be raced past the
  // bounds. The totals grow before the push and shrink after take's pop, so they never
  // fall below what the queue holds (and never wrap below zero).
  void offer(const char* data, size_t len) {
    const bool room = stats_.inbox_messages.load(std::memory_order_acquire) < max_messages_ &&
                      stats_.inbox_bytes.load(std::memory_order_acquire) + len <= max_bytes_;
    if (room) {
      stats_.inbox_messages.fetch_add(1, std::memory_order_acq_rel);
      stats_.inbox_bytes.fetch_add(len, std::memory_order_acq_rel);
      auto* msg = new std::string(data, len);
      if (queue_.try_push(msg)) {
        seq_.fetch_add(1, std::memory_order_seq_cst);
        futex_wake_all(&seq_);
        return;
      }
      delete msg;
      stats_.inbox_messages.fetch_sub(1, std::memory_order_acq_rel);
      stats_.inbox_bytes.fetch_sub(len, std::memory_order_acq_rel);
    }
    // The application is not reading: drop, and say so in the stats.
    stats_.inbox_dropped_messages.fetch_add(1, std::memory_order_relaxed);
    stats_.inbox_dropped_bytes.fetch_add(len, std::memory_order_relaxed);
  }

  bool empty() const { return queue_.empty(); }

  // Any thread: the oldest message, or nullopt at the deadline or once `stopping`.
  std::optional<std::string> take(int64_t deadline_ns, const std::atomic<bool>& stopping) {
    for (;;) {
      uint32_t seq = seq_.load(std::memory_order_seq_cst);
      std::string* msg;
      if (queue_.try_pop(msg)) {
        std::string out = std::move(*msg);
        delete msg;
        stats_.inbox_bytes.fetch_sub(out.size(), std::memory_order_relaxed);
        stats_.inbox_messages.fetch_sub(1, std::memory_order_relaxed);
        return out;
      }
      if (monotonic_ns() >= deadline_ns || stopping.load()) return std::nullopt;
      futex_wait_until(&seq_, seq, std::min(deadline_ns, monotonic_ns() + 100'000'000));
    }
  }

  // Wakes every thread blocked in take (the engine is stopping).
  void wake_all() {
    seq_.fetch_add(1);
    futex_wake_all(&seq_);
  }

 private:
  static size_t pow2_at_least(size_t n) {
    size_t p = 2;
    while (p < n) p <<= 1;
    return p;
  }

  size_t max_messages_, max_bytes_;
  EngineStats& stats_;
  BoundedQueue<std::string*> queue_;
  std::atomic<uint32_t> seq_{0};
};

}  // namespace kvxfer
