// TCP_CORK around the progress worker's bursts of sends on a socket provider's connections.
//
// Why: libfabric's net and tcp providers send each operation with its own sendmsg, and on
// an idle path the kernel puts each into a segment of its own. A stream of 4 KiB writes
// with delivery-complete then cost two segments per write, the write and its 16-byte
// acknowledgement, each built, sent, received and acknowledged by TCP on its own: 2.1
// segments per write, 0.96-1.0 GB/s with both processes' kernels busy. Corked for the
// length of a burst (the ops one round posts, or the acknowledgements a poll makes the
// provider send while writes arrive in bursts), a burst leaves as a few full segments when
// it is uncorked: 0.22 segments per write and 2.09-2.22 GB/s (benchmarks/README.md,
// "Corked bursts"). A lone write is not corked, so its latency pays nothing.
//
// Which sockets: connected TCP sockets whose local address is one of this engine's rails
// (connections its listeners accepted) or whose peer is a rail this engine sends to (the
// connections it opened), found among the process's descriptors as tcp_congestion.hpp
// finds them. A busy worker looks again for connections opened or closed since (soon after
// a new address or connection, then every kRescanNs); an idle one does not look. A
// descriptor the provider closed and the process reused for another TCP socket before that
// look would be corked for one burst (microseconds) and uncorked; nothing else outside the
// engine is touched.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "tcp_congestion.hpp"

namespace kvxfer {

class SendCorker {
 public:
  // A busy worker looks again after kFirstRetryNs, growing 4x a look up to kRescanNs while
  // it finds nothing new (a connection opens with a peer's first op, and a short stream must
  // not end before its connection is found), then every kRescanNs.
  static constexpr int64_t kFirstRetryNs = 1'000'000;
  static constexpr int64_t kRescanNs = 200'000'000;

  explicit SendCorker(bool enabled) : enabled_(enabled) {}

  // Nothing to cork: off, or no connection found (yet).
  bool idle() const { return !enabled_ || fds_.empty(); }
  // This engine's rail address (the connections its listener accepts) and a peer rail it
  // sends to (the connection the provider opens to it); the next rescan looks for them.
  void add_local(const std::string& raw_address) { add(raw_address, &locals_); }
  void add_peer(const std::string& raw_address) { add(raw_address, &peers_); }
  // Worker only, after a busy round: re-reads the process's descriptors when a look is due.
  void maybe_rescan(int64_t now_ns) {
    if (enabled_ && now_ns >= next_scan_ns_) rescan(now_ns);
  }
  // Worker only: TCP_CORK on (true) or off on every connection found.
  void set_corked(bool corked);
  // Connections found at the last look. Any thread may read it.
  uint64_t sockets() const { return sockets_.load(std::memory_order_relaxed); }
  // One look now. Public for tests.
  void rescan(int64_t now_ns);

 private:
  void add(const std::string& raw_address, std::vector<RailSocketAddress>* into);

  bool enabled_;
  std::vector<RailSocketAddress> locals_, peers_;
  std::vector<int> fds_;
  int64_t next_scan_ns_ = 0;
  int64_t retry_ns_ = kFirstRetryNs;
  std::atomic<uint64_t> sockets_{0};
};

// Corks a SendCorker's connections for one scope (a burst of sends), if `when`.
class CorkedBurst {
 public:
  CorkedBurst(SendCorker& corker, bool when) : corker_(when && !corker.idle() ? &corker : nullptr) {
    if (corker_) corker_->set_corked(true);
  }
  ~CorkedBurst() {
    if (corker_) corker_->set_corked(false);
  }
  CorkedBurst(const CorkedBurst&) = delete;
  CorkedBurst& operator=(const CorkedBurst&) = delete;

 private:
  SendCorker* corker_;
};

}  // namespace kvxfer
