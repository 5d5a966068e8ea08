#include "send_corking.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>

namespace kvxfer {

void SendCorker::add(const std::string& raw_address, std::vector<RailSocketAddress>* into) {
  if (!enabled_) return;
  auto address = RailSocketAddress::from_raw(raw_address);
  if (!address.valid) return;  // not a socket provider's address (shm)
  into->push_back(address);
  next_scan_ns_ = 0;  // a new peer's connection opens with its first op: look at the next busy round
  retry_ns_ = kFirstRetryNs;
}

void SendCorker::rescan(int64_t now_ns) {
  const size_t had = fds_.size();
  fds_.clear();
  if (locals_.empty() && peers_.empty()) {
    next_scan_ns_ = now_ns + kRescanNs;
    return;
  }
  for_each_tcp_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage* peer) {
    if (!peer) return;  // a listener: it sends nothing
    bool ours = false;
    for (const auto& a : locals_) ours = ours || a.matches(local);
    for (const auto& a : peers_) ours = ours || a.matches(*peer);
    if (ours) fds_.push_back(fd);
  });
  sockets_.store(fds_.size(), std::memory_order_relaxed);
  // Nothing found yet, or something new: look again soon, then less often.
  if (fds_.empty() || fds_.size() != had) {
    next_scan_ns_ = now_ns + retry_ns_;
    retry_ns_ = std::min(retry_ns_ * 4, kRescanNs);
  } else {
    next_scan_ns_ = now_ns + kRescanNs;
  }
}

void SendCorker::set_corked(bool corked) {
  const int on = corked ? 1 : 0;
  // A descriptor closed since the last look fails here, harmlessly; the next look drops it.
  for (int fd : fds_) setsockopt(fd, IPPROTO_TCP, TCP_CORK, &on, sizeof on);
}

}  // namespace kvxfer
