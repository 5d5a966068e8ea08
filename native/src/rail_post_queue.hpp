// Ops waiting to be posted on one rail, and that rail's inflight budget: the submission
// half of the progress worker, apart from libfabric so it is tested without a fabric
// (native/tests/rail_post_queue_test.cpp). The worker owns one per rail and is its only
// user, so nothing here locks.
//
// Posting keeps each peer's order, and a peer whose provider queue is full (EAGAIN: it
// stopped reading, is frozen, dead or slow) is stepped over for the rest of the pass, so it
// does not hold up every other peer's writes on the rail until its own ops expire.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_errno.h>

#include <cstddef>
#include <deque>
#include <string>

#include "rail_group.hpp"

namespace kvxfer {

class RailPostQueue {
 public:
  // Peers answering EAGAIN that one pass remembers; beyond them the pass stops.
  static constexpr size_t kMaxBlockedPeers = 8;
  // Ops of blocked peers one pass steps over; beyond them the pass stops, so a long queue
  // behind a stuck peer costs a bounded amount per turn.
  static constexpr size_t kMaxSkippedPerPass = 256;

  explicit RailPostQueue(size_t max_inflight) : max_inflight_(max_inflight) {}

  void push(RailOp* op) { queue_.push_back(op); }
  bool empty() const { return queue_.empty(); }
  size_t queued() const { return queue_.size(); }
  // Posted ops not yet completed (nor expired).
  size_t inflight() const { return inflight_; }

  // Posts queued ops in order while the budget allows.
  //   post(op) -> ssize_t: 0 posted (the op then holds a budget slot until release),
  //     -FI_EAGAIN that peer's queue is full (the op stays queued), other < 0 an error;
  //   unposted(op, why) for an op that leaves the queue unposted: `why` is null when its
  //     transfer had already failed, else the post error.
  // True if anything was posted or left the queue.
  template <class Post, class Unposted>
  bool post_ready(Post&& post, Unposted&& unposted) {
    bool did = false;
    fi_addr_t blocked[kMaxBlockedPeers];
    size_t n_blocked = 0;
    size_t skipped = 0;
    auto is_blocked = [&](fi_addr_t dest) {
      for (size_t i = 0; i < n_blocked; ++i)
        if (blocked[i] == dest) return true;
      return false;
    };
    auto it = queue_.begin();
    while (it != queue_.end() && inflight_ < max_inflight_) {
      RailOp* op = *it;
      if (op->batch->failed) {
        // Its transfer already failed or timed out: never post the rest of it.
        it = queue_.erase(it);
        unposted(op, static_cast<const std::string*>(nullptr));
        did = true;
        continue;
      }
      if (is_blocked(op->dest)) {
        if (++skipped > kMaxSkippedPerPass) break;
        ++it;
        continue;
      }
      ssize_t rc = post(op);
      if (rc == -FI_EAGAIN) {
        // This peer's queue is full: completions are read, then it is retried; the other
        // peers go now.
        if (n_blocked == kMaxBlockedPeers) break;
        blocked[n_blocked++] = op->dest;
        ++it;
        continue;
      }
      it = queue_.erase(it);
      did = true;
      if (rc != 0) {
        std::string why = std::string("posting failed: ") + fi_strerror(static_cast<int>(-rc));
        unposted(op, &why);
        continue;
      }
      op->holds_slot = true;
      ++inflight_;
    }
    return did;
  }

  // Gives back the budget slot of a posted op: it completed, or its transfer expired (ops
  // to a dead peer may never complete, and holding their slots would stall every other
  // peer on the rail once a dead peer had used up the budget). Idempotent.
  void release(RailOp* op) {
    if (!op->holds_slot) return;
    op->holds_slot = false;
    --inflight_;
  }

 private:
  std::deque<RailOp*> queue_;
  size_t inflight_ = 0;
  size_t max_inflight_;
};

}  // namespace kvxfer
