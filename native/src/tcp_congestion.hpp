// The TCP congestion control of the connections a socket provider (tcp, net) opens for
// kvxfer's rails. libfabric creates those sockets itself and offers no option for it, so
// the progress worker finds them among this process's descriptors by address and sets
// TCP_CONGESTION on them.
//
// Why: under BBR without the fq qdisc (this machine's set-up), TCP paces
// every connection itself with a high-resolution timer per burst. The engine keeps its
// sockets' send queues full, so its connections ran at the pacing rate: net, 16 KiB pages
// at random indices, 1.4-1.5 GB/s, with 43% of the sending thread in the pacing timer's
// unlock, against 3.7-4.0 GB/s under cubic (bench_engine.py, alternated three times;
// switching the two sockets of a running pair moved it from one figure to the other). A
// busy-polling bare loop never fills its queue and runs at 2.3-2.4 GB/s under either.
//
// What is matched: a TCP socket whose local address is one of this engine's rails (the
// listener; connections it accepts inherit the listener's choice), or whose peer is a rail
// address of a peer this engine sends to (its connection appears with the first op
// posted). Nothing else in the process is touched.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvxfer {

// A provider's raw rail address as a socket address; `valid` is false for addresses that
// are not an AF_INET / AF_INET6 sockaddr (shm and other non-socket providers).
struct RailSocketAddress {
  sockaddr_storage addr = {};
  bool valid = false;
  static RailSocketAddress from_raw(const std::string& raw);
  // Same family, port and IP; a wildcard IP (0.0.0.0, ::) on either side matches any.
  bool matches(const sockaddr_storage& other) const;
};

// Calls `visit` for every TCP socket among this process's descriptors, with its local
// address and its peer's (nullptr for a socket that is not connected: a listener). False
// where /proc/self/fd could not be read (then nothing was visited).
bool for_each_tcp_socket(const std::function<void(int fd, const sockaddr_storage& local,
                                                 const sockaddr_storage* peer)>& visit);

class TcpCongestionSetter {
 public:
  // How long a watched address is looked for before it is given up (a peer inserted only
  // to tell senders apart never gets a connection from us), and the first and longest
  // pause between two looks: each look reads every descriptor of the process.
  static constexpr int64_t kGiveUpNs = 10'000'000'000LL;
  static constexpr int64_t kFirstRetryNs = 1'000'000;
  static constexpr int64_t kMaxRetryNs = 500'000'000;

  // `algorithms`: names from /proc/sys/net/ipv4/tcp_available_congestion_control, comma
  // separated, in order of preference: a socket gets the first one the kernel lets this
  // process set (an unprivileged one may set only tcp_allowed_congestion_control, which
  // by default is reno and the system's default). Empty leaves every socket as it is.
  explicit TcpCongestionSetter(const std::string& algorithms);

  bool enabled() const { return !algorithms_.empty(); }
  // This engine's rail address: its listener (and so every connection it accepts).
  void watch_local(const std::string& raw_address, int64_t now_ns);
  // A peer rail this engine posts to: the connection the provider opens to it.
  void watch_peer(const std::string& raw_address, int64_t now_ns);
  // Worker only: looks for the watched addresses' sockets when a look is due (one branch
  // otherwise) and sets an algorithm on every one found.
  void poll(int64_t now_ns) {
    if (!pending_.empty() && now_ns >= next_look_ns_) look(now_ns);
  }

  // Sockets switched to one of the algorithms, and sockets the kernel let have none of
  // them (all outside tcp_allowed_congestion_control for an unprivileged process). Any
  // thread may read them.
  uint64_t sockets_set() const { return sockets_set_.load(std::memory_order_relaxed); }
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

  // One pass over /proc/self/fd: sets an algorithm on TCP sockets whose local address
  // matches one of `locals` or whose peer matches one of `peers`; marks found[i] for
  // every address (locals first, then peers) that some socket matched. Public for tests.
  void apply(const std::vector<RailSocketAddress>& locals, const std::vector<RailSocketAddress>& peers,
             std::vector<bool>* found);

 private:
  struct Watched {
    RailSocketAddress address;
    bool local = false;
    int64_t give_up_ns = 0;
  };
  void watch(const std::string& raw_address, bool local, int64_t now_ns);
  void look(int64_t now_ns);
  // Sets the first algorithm the kernel allows on `fd` (counted), unless it has it.
  void set_preferred(int fd);

  std::vector<std::string> algorithms_;
  size_t first_allowed_ = 0;  // algorithms before it were refused: not tried again
  std::vector<Watched> pending_;
  int64_t next_look_ns_ = 0;
  int64_t retry_ns_ = kFirstRetryNs;
  std::atomic<uint64_t> sockets_set_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace kvxfer
