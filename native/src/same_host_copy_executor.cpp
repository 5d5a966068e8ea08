#include "same_host_copy_executor.hpp"

namespace kvxfer {

std::string SameHostCopyExecutor::copy_slice(SameHostCopy& copy) {
  uint64_t copied = 0;
  std::string why = copy.run_slice(&copied);
  if (copied) {
    // A copy is posted and completed in one step.
    stats_.ops_posted.fetch_add(1, std::memory_order_relaxed);
    stats_.bytes_posted.fetch_add(copied, std::memory_order_relaxed);
    stats_.ops_completed.fetch_add(1, std::memory_order_relaxed);
    stats_.bytes_completed.fetch_add(copied, std::memory_order_relaxed);
  }
  if (!why.empty()) stats_.completion_errors.fetch_add(1, std::memory_order_relaxed);
  return why;
}

std::string SameHostCopyExecutor::copy_inline(SameHostCopy& copy) {
  std::string why;
  while (why.empty() && !copy.done()) why = copy_slice(copy);
  return why;
}

SameHostCopyExecutor::Outcome SameHostCopyExecutor::step() {
  Outcome out;
  if (queue_.empty()) return out;
  out.batch = queue_.front();
  if (out.batch->failed) {
    queue_.pop_front();
    out.step = Step::kDropped;
    return out;
  }
  out.why = copy_slice(*out.batch->copy);
  if (!out.why.empty()) {
    queue_.pop_front();
    out.step = Step::kFailed;
  } else if (out.batch->copy->done()) {
    queue_.pop_front();
    out.step = Step::kCopied;
  } else {
    out.step = Step::kProgress;
  }
  return out;
}

}  // namespace kvxfer
