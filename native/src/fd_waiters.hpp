// Threads that wait for immediates and, at the same time, for a peer's socket to close
// (ImmediateTracker::wait_any with watched fds). A futex cannot wait on a socket, so such
// a thread sleeps in ppoll() on the sockets and on an eventfd of its own, which the worker
// writes after each arrival round while the thread is registered here.
//
// Why: a decode instance's idle wait must end the moment a killed prefiller's liveness
// connection closes, without waking up now and then to look (each wake-up costs the
// instance's one core a context switch, and enough of them starved etcd on a loaded
// machine), and without a thread of its own to watch the sockets.
//
// Each thread's eventfd is made on its first such wait and kept for the thread's life: the
// worker may still write to an fd it read from a slot the thread just released, and an fd
// that was never closed cannot be someone else's by then. A stale count only makes the
// thread's next ppoll return once more.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "futex_wait.hpp"

namespace kvxfer {

class FdWaiters {
 public:
  // What a wait with watched fds ended on.
  enum class Woken { kRound, kFdClosed, kTimedOut };
  // What a watched socket reports when its peer closed it, reset it, or it failed. Not
  // POLLIN: bytes a peer sends are not a close, and unread they would end every sleep.
  static constexpr short kAsked = POLLRDHUP;
  static constexpr short kClosed = POLLRDHUP | POLLHUP | POLLERR | POLLNVAL;

  FdWaiters() {
    for (auto& slot : slots_) slot.store(-1, std::memory_order_relaxed);
  }

  // This thread's eventfd (made once, never closed); -1 if the kernel refused one.
  static int thread_wake_fd() {
    thread_local const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return fd;
  }

  // Registers this thread's eventfd; the slot, or -1 when every slot is taken (or there is
  // no eventfd): the caller then waits without fds.
  int claim() {
    const int fd = thread_wake_fd();
    if (fd < 0) return -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      int free = -1;
      if (slots_[i].compare_exchange_strong(free, fd, std::memory_order_seq_cst)) {
        registered_.fetch_add(1, std::memory_order_seq_cst);
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  void release(int slot) {
    slots_[slot].store(-1, std::memory_order_seq_cst);
    registered_.fetch_sub(1, std::memory_order_seq_cst);
  }

  // Worker only, after a round's counts are stored: wakes every registered thread.
  void wake_all() {
    if (registered_.load(std::memory_order_seq_cst) == 0) return;
    const uint64_t one = 1;
    for (auto& slot : slots_) {
      const int fd = slot.load(std::memory_order_seq_cst);
      if (fd >= 0) {
        ssize_t ignored = write(fd, &one, sizeof one);
        (void)ignored;
      }
    }
  }

  // The registered thread: clears its eventfd, so that a round written from now on wakes
  // the ppoll below. Call before looking at the counts.
  static void drain() {
    uint64_t count;
    ssize_t ignored = read(thread_wake_fd(), &count, sizeof count);
    (void)ignored;
  }

  // The registered thread: sleeps until a round is written to its eventfd, one of
  // `watched` reports its peer's close or an error, or `until_ns` (monotonic).
  static Woken sleep(const std::vector<int>& watched, int64_t until_ns) {
    std::vector<struct pollfd> fds;
    fds.reserve(watched.size() + 1);
    fds.push_back({thread_wake_fd(), POLLIN, 0});
    for (int fd : watched) fds.push_back({fd, kAsked, 0});
    const int64_t left = until_ns - monotonic_ns();
    if (left <= 0) return Woken::kTimedOut;
    struct timespec ts = {static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
    const int n = ppoll(fds.data(), fds.size(), &ts, nullptr);
    if (n <= 0) return Woken::kTimedOut;  // a signal (EINTR) too: the caller looks again
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents & kClosed) return Woken::kFdClosed;
    return Woken::kRound;
  }

  // Any thread: whether one of `watched` reports its peer's close or an error now.
  static bool any_closed(const std::vector<int>& watched) {
    if (watched.empty()) return false;
    std::vector<struct pollfd> fds;
    fds.reserve(watched.size());
    for (int fd : watched) fds.push_back({fd, kAsked, 0});
    if (poll(fds.data(), fds.size(), 0) <= 0) return false;
    for (const auto& p : fds)
      if (p.revents & kClosed) return true;
    return false;
  }

 private:
  // One per thread that waits with fds at once: a decode instance's worker thread is one.
  static constexpr size_t kSlots = 4;
  std::array<std::atomic<int>, kSlots> slots_;
  std::atomic<uint32_t> registered_{0};
};

}  // namespace kvxfer
