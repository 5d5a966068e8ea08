// The progress worker's same-host copies: the queue of same-host writes in submission
// order, run one slice at a time (so a 64 MiB copy never keeps other transfers'
// completions waiting long), and the counters of that path. Queue and slicing are
// worker-thread only; copy_inline may run on any thread (it touches only the copy it is
// given and atomic counters).
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "rail_group.hpp"
#include "rail_stats.hpp"
#include "same_host_path.hpp"

namespace kvxfer {

class SameHostCopyExecutor {
 public:
  // What one step did to the oldest queued write.
  enum class Step {
    kIdle,      // nothing queued
    kProgress,  // copied a slice, more to come
    kCopied,    // its last slice landed: its immediates may be posted now
    kDropped,   // its transfer had already failed (or timed out): nothing copied
    kFailed,    // a slice failed: `why` says why
  };
  struct Outcome {
    Step step = Step::kIdle;
    WorkBatch* batch = nullptr;  // the write the step was about (unless kIdle); dequeued
                                 // unless kProgress
    std::string why;
  };

  // Queues a batch whose `copy` is set; the batch stays owned by its tracker.
  void enqueue(WorkBatch* batch) { queue_.push_back(batch); }
  bool empty() const { return queue_.empty(); }
  // Copies one slice of the oldest queued write.
  Outcome step();
  // Copies all of one write on the calling thread. Returns "" or why it failed.
  std::string copy_inline(SameHostCopy& copy);

  const RailStats& stats() const { return stats_; }

 private:
  std::string copy_slice(SameHostCopy& copy);  // one slice, counted in stats_

  std::deque<WorkBatch*> queue_;  // in submission order
  RailStats stats_;
};

}  // namespace kvxfer
