// The progress worker's deadlines: owns every batch from the moment the worker accepts it
// until its last part finished, and says which ones ran past their transfer's deadline.
// Worker-thread only (no locks): one owner thread per fabric domain.
//
// Two lists: live batches in deadline order (every batch gets the same timeout at
// acceptance, so appending keeps the order and expiry only ever looks at the front), and
// expired ones, whose transfer already failed but whose posted ops may still complete: the
// memory libfabric holds a context of must outlive the op.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <utility>

#include "rail_group.hpp"

namespace kvxfer {

class DeadlineTracker {
 public:
  // timeout_ns: how long an accepted batch may take; check_interval_ns: how often
  // expire_due looks (the scan is cheap, the clock reads around it are not free).
  DeadlineTracker(int64_t timeout_ns, int64_t check_interval_ns)
      : timeout_ns_(timeout_ns), check_interval_ns_(check_interval_ns) {}
  DeadlineTracker(const DeadlineTracker&) = delete;
  DeadlineTracker& operator=(const DeadlineTracker&) = delete;

  // Takes the batch, sets its transfer's deadline to now + timeout; returns the batch.
  WorkBatch* track(std::unique_ptr<WorkBatch> batch, int64_t now_ns);
  // Frees a batch that finished, live or expired; a batch not tracked is ignored.
  void release(WorkBatch* batch);
  // Moves every live batch whose deadline is at or before now_ns to the expired list and
  // calls on_expired(batch) for each, at most once per check interval. Returns how many.
  template <typename OnExpired>
  size_t expire_due(int64_t now_ns, OnExpired&& on_expired);
  // Calls fn(batch) for every batch still held, live then expired.
  template <typename Fn>
  void for_each(Fn&& fn) const;

  bool empty() const { return live_.empty() && expired_.empty(); }
  size_t live_count() const { return live_.size(); }
  size_t expired_count() const { return expired_.size(); }
  int64_t timeout_ns() const { return timeout_ns_; }

 private:
  using BatchList = std::list<std::unique_ptr<WorkBatch>>;

  int64_t timeout_ns_;
  int64_t check_interval_ns_;
  int64_t next_check_ns_ = 0;
  BatchList live_;     // in deadline order
  BatchList expired_;  // timed out, ops maybe still on the fabric
  std::unordered_map<WorkBatch*, std::pair<BatchList*, BatchList::iterator>> where_;
};

template <typename OnExpired>
size_t DeadlineTracker::expire_due(int64_t now_ns, OnExpired&& on_expired) {
  if (now_ns < next_check_ns_) return 0;
  next_check_ns_ = now_ns + check_interval_ns_;
  size_t n = 0;
  while (!live_.empty() && live_.front()->transfer->deadline_ns <= now_ns) {
    WorkBatch* batch = live_.front().get();
    expired_.splice(expired_.end(), live_, live_.begin());
    where_[batch] = {&expired_, std::prev(expired_.end())};
    on_expired(batch);
    ++n;
  }
  return n;
}

template <typename Fn>
void DeadlineTracker::for_each(Fn&& fn) const {
  for (const auto* list : {&live_, &expired_})
    for (const auto& batch : *list) fn(batch.get());
}

}  // namespace kvxfer
