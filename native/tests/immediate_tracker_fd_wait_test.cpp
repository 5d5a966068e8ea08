// ImmediateTracker::wait_any with watched sockets (fd_waiters.hpp): the wait ends when a
// watched TCP connection's peer closes it, when an arrival round reaches a wanted count,
// or at its deadline; bytes the peer sends do not end it. More threads than fd-waiter
// slots wait on the epoch futex in slices and still see the close.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "immediate_tracker.hpp"

namespace kvxfer {
namespace {

uint64_t one_unit(uint32_t imm) { return (static_cast<uint64_t>(kImmUnit) << 32) | imm; }

// A connected TCP pair over loopback: {ours, the peer's}, as a decoder's liveness
// connection and the keeper's end of it.
std::pair<int, int> tcp_pair() {
  const int server = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  EXPECT_EQ(bind(server, reinterpret_cast<sockaddr*>(&addr), len), 0);
  EXPECT_EQ(listen(server, 1), 0);
  EXPECT_EQ(getsockname(server, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int ours = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(connect(ours, reinterpret_cast<sockaddr*>(&addr), len), 0);
  const int peer = accept(server, nullptr, nullptr);
  close(server);
  return {ours, peer};
}

constexpr int64_t kSecond = 1'000'000'000;
const std::vector<std::pair<uint32_t, uint64_t>> kWanted = {{7, 1}};

TEST(ImmediateTrackerFdWait, APeersCloseEndsTheWaitBeforeItsDeadline) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  std::atomic<bool> stopping{false};
  auto [ours, peer] = tcp_pair();
  std::thread closer([peer = peer] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    close(peer);
  });
  const int64_t deadline = monotonic_ns() + 10 * kSecond;
  EXPECT_EQ(imms.wait_any(kWanted, deadline, stopping, {ours}), ImmediateTracker::kWatchedFdClosed);
  EXPECT_LT(monotonic_ns(), deadline);
  closer.join();
  close(ours);
}

TEST(ImmediateTrackerFdWait, AnArrivalRoundWakesAWaiterThatWatchesSockets) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  std::atomic<bool> stopping{false};
  auto [ours, peer] = tcp_pair();
  std::atomic<int> found{-3};
  std::thread waiter([&, fd = ours] { found = imms.wait_any(kWanted, monotonic_ns() + 10 * kSecond, stopping, {fd}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  imms.on_arrival(one_unit(7));  // as the worker counts a round, then wakes its waiters
  imms.after_round();
  waiter.join();
  EXPECT_EQ(found.load(), 0);
  close(ours);
  close(peer);
}

TEST(ImmediateTrackerFdWait, BytesFromThePeerDoNotEndTheWait) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  std::atomic<bool> stopping{false};
  auto [ours, peer] = tcp_pair();
  ASSERT_EQ(write(peer, "k", 1), 1);  // the keeper's one byte, unread here
  EXPECT_EQ(imms.wait_any(kWanted, monotonic_ns() + kSecond / 10, stopping, {ours}), -1);
  close(ours);
  close(peer);
}

TEST(ImmediateTrackerFdWait, WaitersBeyondTheSlotsSeeTheCloseToo) {
  EventQueue events;
  ImmediateTracker imms(64, events);
  std::atomic<bool> stopping{false};
  auto [ours, peer] = tcp_pair();
  constexpr int kWaiters = 6;  // more than FdWaiters' slots: the rest wait on the futex
  std::vector<int> found(kWaiters, -3);
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i)
    waiters.emplace_back([&, i, fd = ours] { found[i] = imms.wait_any(kWanted, monotonic_ns() + 10 * kSecond, stopping, {fd}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  close(peer);
  for (auto& w : waiters) w.join();
  for (int i = 0; i < kWaiters; ++i) EXPECT_EQ(found[i], ImmediateTracker::kWatchedFdClosed) << "waiter " << i;
  close(ours);
}

}  // namespace
}  // namespace kvxfer
