// Events the progress worker reports to asyncio (transfer done, immediate count reached):
// a bounded queue plus an eventfd that asyncio loops watch. The worker pushes and flushes;
// any thread takes.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "bounded_queue.hpp"
#include "engine_types.hpp"

namespace kvxfer {

enum class EventKind : uint32_t { kTransferDone = 1, kImmReached = 2 };

struct EngineEvent {
  EventKind kind;
  uint64_t token;   // transfer id, or the token given to expect_imm
  // TransferStatus for transfers; for kImmReached 0, or kFailed when the immediate's
  // arrivals were dropped (ImmCounterTable::lost) and the count can never be reached.
  uint32_t status;
};

class EventQueue {
 public:
  EventQueue() {
    fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd_ < 0) throw EngineError("eventfd failed");
  }
  ~EventQueue() {
    if (fd_ >= 0) close(fd_);
  }
  EventQueue(const EventQueue&) = delete;
  EventQueue& operator=(const EventQueue&) = delete;

  int fd() const { return fd_; }

  // Worker only. A full queue spills into an unbounded overflow rather than lose an event:
  // a lost completion would leave an awaiting coroutine hanging.
  void push(const EngineEvent& e) {
    if (!overflow_.empty() || !events_.try_push(e)) overflow_.push_back(e);
    pending_ = true;
  }
  bool pending() const { return pending_ || !overflow_.empty(); }

  // Worker only: once per poll round, not per event (fewer wake-ups for asyncio).
  void flush() {
    while (!overflow_.empty() && events_.try_push(overflow_.front())) overflow_.pop_front();
    if (pending_) {
      uint64_t one = 1;
      ssize_t ignored = write(fd_, &one, sizeof one);
      (void)ignored;
      pending_ = false;
    }
  }

  // Any thread.
  std::vector<EngineEvent> take() {
    uint64_t drained;
    ssize_t ignored = read(fd_, &drained, sizeof drained);
    (void)ignored;
    std::vector<EngineEvent> out;
    EngineEvent e;
    while (events_.try_pop(e)) out.push_back(e);
    return out;
  }

 private:
  BoundedQueue<EngineEvent> events_{1 << 16};
  std::deque<EngineEvent> overflow_;  // worker only
  bool pending_ = false;              // worker only
  int fd_ = -1;
};

}  // namespace kvxfer
