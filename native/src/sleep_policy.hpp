// When and how long the progress worker sleeps (ProgressWorker::sleep_until_work): the
// decisions only, as pure functions of what the worker knows, so they are tested without
// a fabric (native/tests/sleep_policy_test.cpp). The worker does the syscalls.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kvxfer::sleep_policy {

// The longest an idle worker sleeps: bounds how late a deadline is noticed.
constexpr int kMaxSleepMs = 2;
// The longest sleep with no transfer in flight: only bounds how late stop() is noticed.
constexpr int kIdleSleepMs = 50;
// Quiet means no completion, arrival or submission for 2 ms: a prefiller writing once per
// layer (every ~100 ms) must not spin a core between layers, which it did with 250 ms here
// (twice the CPU and TTFT in bench_disagg_prefill). A quiet worker blocks; where its fds
// cannot be trusted (a spurious wake-up, or no wait fd) it looks every 100 us, and every
// 1 ms after a second of silence.
constexpr int64_t kQuietNs = 2'000'000;
constexpr useconds_t kQuietSleepMinUs = 100;
constexpr useconds_t kQuietSleepMaxUs = 1000;
// With at least this many ops in flight, a worker whose fds woke it for nothing (twice in a
// row: nap_after_wake_us) naps kBusyNapUs instead of polling again at once. The pipeline
// holds milliseconds of work then (64 ops of >= 1 KiB, acknowledged in batches), so the nap
// costs no throughput, while the spin it replaces (two epoll_waits a turn, 86 per 16 KiB
// op with 4 KiB pages over net) took the core the target needs on a 2-core machine. A
// single write in flight is never delayed.
constexpr size_t kBusyNapMinInflight = 64;
constexpr useconds_t kBusyNapUs = 20;
// How soon a quiet worker with ops still queued retries posting them when no fd wakes it.
constexpr int kQueuedRetryMs = 1;

// What the worker knows when a round did nothing and its idle spin is over.
struct Idle {
  bool work_waiting = false;    // submissions, control messages or same-host copies to take
  bool ops_queued = false;      // ops on a rail waiting for in-flight room or refused (EAGAIN)
  bool transfers_live = false;  // some transfer has a deadline
  int64_t now_ns = 0;
  int64_t last_activity_ns = 0;   // the last round that did something
  int64_t last_ring_arrival_ns = 0;  // the last round that drained the same-host immediate ring
  size_t ops_in_flight = 0;       // ops posted to the rails and not completed
  // The last idle spell with nothing in flight that outlasted the worker's spin
  // (idle_spin_ns), from the last activity before it to the first after it: how far apart
  // the requests of the current conversation come. 0: none yet.
  int64_t last_long_gap_ns = 0;
  int64_t wake_by_ns = INT64_MAX;  // a caller's deadline (drive_until), else INT64_MAX
};

inline bool quiet(int64_t now_ns, int64_t last_activity_ns) { return now_ns - last_activity_ns > kQuietNs; }

// How long the worker may block on its fds (ms, 0: only look); -1: it must not block.
//
// Queued ops wait for in-flight room or were refused by the provider (EAGAIN: that peer's
// queue is full, or its connection is not up yet). In a busy stream either clears within
// microseconds and the worker must retry at once (net moves the data only while the worker
// polls). But a peer first contacted while frozen never completes net's handshake, and one
// frozen mid-stream holds its ops and slots: those stay queued until their deadline, and
// retrying them at once spun the worker at a full core for that long (an abort message to
// a frozen decoder: 6 s) on the cores the other peers' traffic and the prefill compute
// need. So queued ops keep the worker awake only until nothing has happened for kQuietNs;
// then it sleeps as a quiet worker does, at most kQueuedRetryMs at a time.
//
// A same-host peer's immediates arrive in shared memory (same_host_imm_ring.hpp), and
// reach a blocked worker only through an eventfd write and its thread's wake-up: 30-50 us
// on this VM, as long as the copy of a 1 MiB write. A streaming peer's next immediate is
// likely that close, so until the ring went quiet the worker only looks (0; the worker
// yields meanwhile), even with ops in flight, unless arrivals have been coming further
// apart than that (see below). Measured, 4 KiB writes 1 ms apart: looking 2 ms, 32-35 us
// and 1.2 ms CPU per write; 200 us, 102-112 us and 0.36 ms; not at all, 113-129 us and
// 0.22 ms (benchmarks/README.md).
inline int block_timeout_ms(const Idle& s) {
  if (s.work_waiting) return -1;
  if (!quiet(s.now_ns, s.last_ring_arrival_ns) && s.last_long_gap_ns <= kQuietNs) return 0;
  if (s.ops_queued && !quiet(s.now_ns, s.last_activity_ns)) return -1;
  // Nothing in flight shortly after the last completion, arrival or submission, while the
  // requests of this conversation have been coming less than kQuietNs apart (the next
  // write of a layer-by-layer push, the next arrival at a target): a blocked worker's
  // wake-up costs 50-100 us on this VM, once per hop, so it looks until the engine went
  // quiet. 4 KiB writes 1 ms apart, net: 25 us p50 looking, 140-210 us blocking after
  // idle_spin_us (30 us), at 1.1 and 0.2 ms of CPU per write. Requests further apart than
  // that would only be looked for in vain (5 ms apart: 4.4 ms of CPU per write for both
  // processes, against 0.45 blocking), so then it blocks. With ops in flight it blocks
  // after idle_spin_us too: their completions wake it, and in a deep stream a looking
  // worker only takes the core the other threads need (net, 4 KiB writes, 256 in flight:
  // 0.75 GB/s looking 2 ms against 0.88 blocking, one run). Once quiet it blocks either
  // way: an idle engine wakes 20 times a second.
  if (s.ops_in_flight == 0 && !quiet(s.now_ns, s.last_activity_ns) && s.last_long_gap_ns <= kQuietNs) return 0;
  // Deadlines need a look every few ms only while transfers are live; an engine with
  // nothing in flight sleeps longer (new work and arrivals wake it through the fds).
  int timeout_ms = s.transfers_live ? kMaxSleepMs : kIdleSleepMs;
  if (s.ops_queued) timeout_ms = std::min(timeout_ms, kQueuedRetryMs);
  if (s.wake_by_ns != INT64_MAX) {
    // A caller's deadline: rounded up, so the last millisecond is slept, not spun.
    int64_t left_ms = (s.wake_by_ns - s.now_ns + 999'999) / 1'000'000;
    timeout_ms = static_cast<int>(std::clamp<int64_t>(left_ms, 0, timeout_ms));
  }
  return timeout_ms;
}

// How long to nap (us; 0: none) after the fds woke the worker, but not a submitter.
//
// A provider fd that stays readable with nothing to do (libfabric 1.17 net's CQ wait fd,
// before the worker slept on its socket poll set instead: provider_poll_set.hpp) makes
// epoll return at once. So once a wake-up proved spurious (the round after it did
// nothing), the next ones nap: in growing steps after a quiet spell, and 20 us with a deep
// pipeline in a busy stream. A wake-up after a real one is never delayed: on a poll set
// that speaks only of work, a 100 us nap before the first arrival after a quiet spell
// was 100 us on its latency. Incoming writes without immediates are arrivals too.
inline useconds_t nap_after_wake_us(int64_t now_ns, int64_t last_activity_ns, size_t ops_in_flight,
                                    bool last_wake_was_spurious) {
  if (!last_wake_was_spurious) return 0;
  if (quiet(now_ns, last_activity_ns))
    return now_ns - last_activity_ns > 1'000'000'000 ? kQuietSleepMaxUs : kQuietSleepMinUs;
  return ops_in_flight >= kBusyNapMinInflight ? kBusyNapUs : 0;
}

// How long a worker pauses between looks at rails that have no wait fd (shm: libfabric
// 1.17 gives its CQ none), in us. Nothing tells it when such a rail has work, so it looks
// every kBusyPollWithoutFdUs while the engine is busy or the policy said only look
// (timeout_ms 0), as it always did; once quiet, as rarely as a spurious wake-up's nap
// (100 us, 1 ms after a second of silence), within timeout_ms. Before, it looked every
// 20 us for good: an idle shm engine with one connection used half a core (measured).
// Submitters and same-host immediates still cut a pause short through the worker's fds.
constexpr useconds_t kBusyPollWithoutFdUs = 20;
inline useconds_t pause_without_wait_fd_us(int64_t now_ns, int64_t last_activity_ns, int timeout_ms) {
  if (timeout_ms <= 0 || !quiet(now_ns, last_activity_ns)) return kBusyPollWithoutFdUs;
  const useconds_t quiet_pause = nap_after_wake_us(now_ns, last_activity_ns, 0, true);
  return std::min<useconds_t>(quiet_pause, static_cast<useconds_t>(timeout_ms) * 1000);
}

}  // namespace kvxfer::sleep_policy
