#include "deadline_tracker.hpp"

namespace kvxfer {

WorkBatch* DeadlineTracker::track(std::unique_ptr<WorkBatch> batch, int64_t now_ns) {
  batch->transfer->deadline_ns = now_ns + timeout_ns_;
  WorkBatch* key = batch.get();
  live_.push_back(std::move(batch));
  where_[key] = {&live_, std::prev(live_.end())};
  return key;
}

void DeadlineTracker::release(WorkBatch* batch) {
  auto it = where_.find(batch);
  if (it == where_.end()) return;
  auto [owner, position] = it->second;
  where_.erase(it);
  owner->erase(position);  // frees the batch
}

}  // namespace kvxfer
