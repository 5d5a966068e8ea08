// Immediates at the receiving end: the ImmCounter table, the expectations asyncio awaits
// (expect_imm), and the threads blocked in wait_imm. The worker counts each arrival and,
// once per round, wakes whoever's count was reached; any thread reads counts and waits.
//
// Admission: by default the first arrival of any value claims a table slot for good. A
// decoder instead counts claimed values only (claimed_only): it claims a reservation's
// immediate before handing the reservation out and releases it when the reservation ends,
// and an arrival for any other value is dropped and counted (unclaimed_dropped) without
// touching the table. Immediate-only writes need no memory key, only the engine's address,
// so without this one sender could take every slot and no reservation could ever count.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine_types.hpp"
#include "fd_waiters.hpp"
#include "futex_wait.hpp"
#include "imm_counter.hpp"
#include "imm_waiters.hpp"
#include "rail_group.hpp"
#include "worker_events.hpp"

namespace kvxfer {

class ImmediateTracker {
 public:
  ImmediateTracker(size_t capacity, EventQueue& events, bool claimed_only = false)
      : table_(capacity), events_(events), claimed_only_(claimed_only) {}

  bool claimed_only() const { return claimed_only_; }

  // Worker only: from now on arrivals for imm are counted (claimed_only). False when every
  // table slot is held by another claimed value.
  bool claim(uint32_t imm) { return table_.claim(imm); }
  // Worker only: arrivals for imm are no longer counted and its slot is free again; its
  // sender binding goes too. Expectations still waiting on it end at their deadlines.
  void release(uint32_t imm) {
    sources_.erase(imm);
    table_.release(imm);
  }
  uint64_t unclaimed_dropped() const { return unclaimed_dropped_.load(std::memory_order_relaxed); }

  ImmCounterTable& table() { return table_; }
  const ImmCounterTable& table() const { return table_; }

  // Worker only: from now on `imm` counts only arrivals whose completion names one of
  // `sources[rail]` as sender on the rail they came in on (AV addresses of the rails of the
  // one peer a reservation names that send to that rail: see
  // ProgressWorker::source_addresses); anything else is dropped and counted
  // (foreign_dropped). Only on providers with FI_SOURCE: elsewhere every source reads
  // FI_ADDR_NOTAVAIL.
  // Arrivals through the same-host immediate ring name their writer engine instead: they
  // count only when it is `engine_id`, the same peer's.
  using RailSources = std::vector<std::vector<fi_addr_t>>;
  void bind_source(uint32_t imm, RailSources sources, uint64_t engine_id) {
    sources_[imm] = {engine_id, std::move(sources)};
  }
  void unbind_source(uint32_t imm) { sources_.erase(imm); }
  uint64_t foreign_dropped() const { return foreign_dropped_.load(std::memory_order_relaxed); }

  // Worker only: one arrival on `rail` from `source` (FabricRail::source), checked against
  // its immediate's bound sender, if any, before it is counted.
  void on_arrival(uint64_t cq_data, size_t rail, fi_addr_t source) {
    if (dropped_as_foreign(cq_data, [&](const BoundSender& b) { return sent_by(b.rails, rail, source); }))
      return;
    on_arrival(cq_data);
  }

  // Worker only: one arrival through the same-host immediate ring, written by engine
  // `writer` (ImmRingBoard::drain), checked against its immediate's bound sender, if any.
  void on_ring_arrival(uint64_t cq_data, uint64_t writer) {
    if (dropped_as_foreign(cq_data, [&](const BoundSender& b) { return b.engine_id == writer; })) return;
    on_arrival(cq_data);
  }

  // Worker only: one arrival's CQ data (the immediate and what it is worth, encode_imm).
  void on_arrival(uint64_t cq_data) {
    uint32_t imm = static_cast<uint32_t>(cq_data);
    uint32_t weight = static_cast<uint32_t>(cq_data >> 32);
    if (weight == kTrafficOnlyWeight) return;  // a write without an immediate: traffic only
    // A peer whose provider has 4-byte CQ data sends no weight: each arrival is one unit.
    const uint64_t counted = table_.add(imm, weight ? weight : kImmUnit, /*claim=*/!claimed_only_);
    if (counted == 0 && claimed_only_) {
      // Nobody waits on an unclaimed value: no wake-up, so a flood costs only this.
      unclaimed_dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    uint64_t total = counted / kImmUnit;
    arrived_ = true;  // also when dropped: blocked waiters must look at it
    if (expectations_.empty()) return;
    if (total == 0 && table_.lost(imm)) {
      fail_expectations(imm);
      return;
    }
    auto it = expectations_.find(imm);
    if (it == expectations_.end()) return;
    auto& list = it->second;
    for (size_t i = 0; i < list.size();) {
      if (total >= list[i].count) {
        events_.push({EventKind::kImmReached, list[i].token, 0});
        list[i] = list.back();
        list.pop_back();
      } else {
        ++i;
      }
    }
    if (list.empty()) expectations_.erase(it);
  }

  // Worker only: report `token` once count units of imm arrived (at once if they have).
  void expect(uint32_t imm, uint64_t count, uint64_t token) {
    if (table_.get(imm) >= count)
      events_.push({EventKind::kImmReached, token, 0});
    else if (table_.lost(imm))
      events_.push({EventKind::kImmReached, token, static_cast<uint32_t>(TransferStatus::kFailed)});
    else
      expectations_[imm].push_back({count, token});
  }

  // Worker only, once per round: wakes the waiters that arrivals of this round concern.
  void after_round() {
    if (!arrived_) return;
    arrived_ = false;
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (unslotted_waiters_.load(std::memory_order_seq_cst)) futex_wake_all(&epoch_);
    fd_waiters_.wake_all();
    waiters_.wake_ready([this](uint32_t imm, uint64_t count) { return done(imm, count); });
  }

  // Any thread but the worker: true once count units of imm arrived, false at the deadline
  // or once `stopping`; throws ImmCounterOverflow when imm cannot be counted.
  bool wait(uint32_t imm, uint64_t count, int64_t deadline_ns, const std::atomic<bool>& stopping) {
    const int slot = waiters_.claim(imm, count);
    // Without a slot (all taken) this waiter is woken on every arrival round instead.
    std::atomic<uint32_t>& word = slot >= 0 ? waiters_.word(slot) : epoch_;
    if (slot < 0) unslotted_waiters_.fetch_add(1, std::memory_order_seq_cst);
    // Arrivals wake us whether or not they were counted, so a drop wakes us too.
    bool reached = false;
    const auto reached_or_lost = [&] {
      reached = table_.get(imm) >= count;
      return reached || table_.lost(imm);
    };
    const bool ended = sleep_until(word, reached_or_lost, deadline_ns, stopping);
    if (slot >= 0)
      waiters_.release(slot);
    else
      unslotted_waiters_.fetch_sub(1, std::memory_order_seq_cst);
    if (ended && !reached) throw_lost(imm, count);
    return reached;
  }

  // wait_any's answer when one of its watched fds reported its peer's close first.
  static constexpr int kWatchedFdClosed = -2;

  // Any thread but the worker: blocks until one of `wanted` (immediate, count) is reached
  // (or its arrivals are being dropped) and returns its index; -1 at the deadline or once
  // `stopping`; kWatchedFdClosed as soon as one of `watched` (sockets) reports its peer's
  // close or an error, unless a pair is reached too. Woken on every arrival round, not once
  // per pair: a decode instance with many loads pending sleeps here until the first of them
  // is complete, whichever it is, or until a prefiller it waits on is gone.
  int wait_any(const std::vector<std::pair<uint32_t, uint64_t>>& wanted, int64_t deadline_ns,
               const std::atomic<bool>& stopping, const std::vector<int>& watched = {}) {
    int found = -1;
    if (!watched.empty()) {
      const int slot = fd_waiters_.claim();
      if (slot >= 0) {
        found = wait_any_or_closed(wanted, deadline_ns, stopping, watched);
        fd_waiters_.release(slot);
        return found;
      }
    }
    // Without fds, or with every fd-waiter slot taken: on the epoch futex, in slices short
    // enough to look at the fds between them.
    unslotted_waiters_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      const int64_t until = watched.empty() ? deadline_ns : std::min(deadline_ns, monotonic_ns() + kFdLookNs);
      if (sleep_until(epoch_, [&] { return (found = first_done(wanted)) >= 0; }, until, stopping) ||
          until >= deadline_ns || stopping.load())
        break;
      if (FdWaiters::any_closed(watched)) {
        found = kWatchedFdClosed;
        break;
      }
    }
    unslotted_waiters_.fetch_sub(1, std::memory_order_seq_cst);
    return found;
  }

  // Whether a waiter of count units of imm may stop waiting: they arrived, or its arrivals
  // are being dropped (the table is full).
  bool done(uint32_t imm, uint64_t count) const { return table_.get(imm) >= count || table_.lost(imm); }
  // The index of the first of `wanted` that is done, -1 if none.
  int first_done(const std::vector<std::pair<uint32_t, uint64_t>>& wanted) const {
    for (size_t i = 0; i < wanted.size(); ++i)
      if (done(wanted[i].first, wanted[i].second)) return static_cast<int>(i);
    return -1;
  }

  [[noreturn]] void throw_lost(uint32_t imm, uint64_t count) const {
    throw ImmCounterOverflow(
        "imm " + std::to_string(imm) + ": " + std::to_string(table_.get(imm)) + " of " + std::to_string(count) +
        " arrived, and no more can be counted: the immediate table is full (" +
        std::to_string(table_.capacity()) + " distinct values, imm_table_capacity) and " +
        std::to_string(table_.overflowed()) + " arrivals were dropped");
  }

  // Wakes every blocked waiter (the engine is stopping).
  void wake_all() {
    epoch_.fetch_add(1);
    futex_wake_all(&epoch_);
    fd_waiters_.wake_all();
    waiters_.wake_all();
  }

 private:
  // A sleeping waiter looks again at least this often, so a wake it missed costs at most
  // this much (close() also wakes every word).
  static constexpr int64_t kRecheckNs = 100'000'000;
  // How long a waiter yields before its first futex sleep. Waking a thread whose CPU went
  // idle costs 15-25 us on this VM: a same-host write's immediate, counted 0.4 us after the
  // write completed while the waiter's CPU was kept busy, was counted 14-26 us after it in
  // half the runs where the waiter slept at once. A long wait (a decoder's whole prefill)
  // pays at most this much CPU for it, once.
  static constexpr int64_t kWaitSpinNs = 50'000;
  // How often a waiter with watched fds but no fd-waiter slot looks at them.
  static constexpr int64_t kFdLookNs = 1'000'000;

  // wait_any for a thread registered in fd_waiters_: sleeps in ppoll on its eventfd (written
  // after every arrival round) and on `watched`.
  int wait_any_or_closed(const std::vector<std::pair<uint32_t, uint64_t>>& wanted, int64_t deadline_ns,
                         const std::atomic<bool>& stopping, const std::vector<int>& watched) {
    for (;;) {
      FdWaiters::drain();  // first: a round counted after this wakes the ppoll below
      std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with after_round's wake
      const int found = first_done(wanted);
      if (found >= 0) return found;
      const int64_t now = monotonic_ns();
      if (now >= deadline_ns || stopping.load()) return -1;
      if (FdWaiters::sleep(watched, std::min(deadline_ns, now + kRecheckNs)) == FdWaiters::Woken::kFdClosed) {
        const int reached = first_done(wanted);  // a count reached meanwhile still wins
        return reached >= 0 ? reached : kWatchedFdClosed;
      }
    }
  }

  // Sleeps on `word` until `ready()` (true) or the deadline or `stopping` (false). The
  // worker bumps `word` after counting a round, so reading it before `ready()` means a
  // round that lands in between ends the sleep at once.
  template <class Ready>
  static bool sleep_until(std::atomic<uint32_t>& word, Ready ready, int64_t deadline_ns,
                          const std::atomic<bool>& stopping) {
    const int64_t spin_until = std::min(deadline_ns, monotonic_ns() + kWaitSpinNs);
    while (!ready() && !stopping.load() && monotonic_ns() < spin_until) sched_yield();
    for (;;) {
      uint32_t seen = word.load(std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with after_round's wakes
      if (ready()) return true;
      if (monotonic_ns() >= deadline_ns || stopping.load()) return false;
      futex_wait_until(&word, seen, std::min(deadline_ns, monotonic_ns() + kRecheckNs));
    }
  }

  struct Expectation {
    uint64_t count;
    uint64_t token;
  };
  // True, and counted (foreign_dropped), when the immediate of `cq_data` is bound to a
  // sender and `from_bound_sender(binding)` says this arrival did not come from it.
  template <class FromBoundSender>
  bool dropped_as_foreign(uint64_t cq_data, FromBoundSender from_bound_sender) {
    if (sources_.empty()) return false;
    auto it = sources_.find(static_cast<uint32_t>(cq_data));
    if (it == sources_.end() || from_bound_sender(it->second)) return false;
    foreign_dropped_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // Whether `source` is one of the senders bound for `rail` (see bind_source).
  static bool sent_by(const RailSources& sources, size_t rail, fi_addr_t source) {
    if (rail >= sources.size()) return false;
    for (fi_addr_t allowed : sources[rail])
      if (allowed == source) return true;
    return false;
  }
  // Ends every expectation of imm with kFailed: its arrivals are being dropped.
  void fail_expectations(uint32_t imm) {
    auto it = expectations_.find(imm);
    if (it == expectations_.end()) return;
    for (const auto& e : it->second)
      events_.push({EventKind::kImmReached, e.token, static_cast<uint32_t>(TransferStatus::kFailed)});
    expectations_.erase(it);
  }

  ImmCounterTable table_;
  EventQueue& events_;
  std::unordered_map<uint32_t, std::vector<Expectation>> expectations_;  // worker only
  struct BoundSender {
    uint64_t engine_id;
    RailSources rails;
  };
  std::unordered_map<uint32_t, BoundSender> sources_;                    // worker only: bound senders
  std::atomic<uint64_t> foreign_dropped_{0};
  const bool claimed_only_;
  std::atomic<uint64_t> unclaimed_dropped_{0};
  bool arrived_ = false;                                                 // worker only
  std::atomic<uint32_t> epoch_{0};  // bumped by every arrival round: for unslotted waiters
  std::atomic<uint32_t> unslotted_waiters_{0};
  FdWaiters fd_waiters_;  // threads waiting on fds too (wait_any with watched fds)
  ImmWaiters waiters_;
};

}  // namespace kvxfer
