#include "tcp_congestion.hpp"

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace kvxfer {

RailSocketAddress RailSocketAddress::from_raw(const std::string& raw) {
  RailSocketAddress a;
  if (raw.size() < sizeof(sa_family_t) || raw.size() > sizeof a.addr) return a;
  std::memcpy(&a.addr, raw.data(), raw.size());
  const bool v4 = a.addr.ss_family == AF_INET && raw.size() >= sizeof(sockaddr_in);
  const bool v6 = a.addr.ss_family == AF_INET6 && raw.size() >= sizeof(sockaddr_in6);
  a.valid = v4 || v6;
  return a;
}

bool RailSocketAddress::matches(const sockaddr_storage& other) const {
  if (!valid || other.ss_family != addr.ss_family) return false;
  if (addr.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
    const auto& b = reinterpret_cast<const sockaddr_in&>(other);
    if (a.sin_port != b.sin_port) return false;
    return a.sin_addr.s_addr == b.sin_addr.s_addr || a.sin_addr.s_addr == htonl(INADDR_ANY) ||
           b.sin_addr.s_addr == htonl(INADDR_ANY);
  }
  const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
  const auto& b = reinterpret_cast<const sockaddr_in6&>(other);
  if (a.sin6_port != b.sin6_port) return false;
  return std::memcmp(&a.sin6_addr, &b.sin6_addr, sizeof a.sin6_addr) == 0 ||
         IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) || IN6_IS_ADDR_UNSPECIFIED(&b.sin6_addr);
}

TcpCongestionSetter::TcpCongestionSetter(const std::string& algorithms) {
  size_t start = 0;
  while (start <= algorithms.size()) {
    size_t comma = algorithms.find(',', start);
    if (comma == std::string::npos) comma = algorithms.size();
    if (comma > start) algorithms_.push_back(algorithms.substr(start, comma - start));
    start = comma + 1;
  }
}

void TcpCongestionSetter::watch_local(const std::string& raw_address, int64_t now_ns) {
  watch(raw_address, true, now_ns);
}

void TcpCongestionSetter::watch_peer(const std::string& raw_address, int64_t now_ns) {
  watch(raw_address, false, now_ns);
}

void TcpCongestionSetter::watch(const std::string& raw_address, bool local, int64_t now_ns) {
  if (!enabled()) return;
  auto address = RailSocketAddress::from_raw(raw_address);
  if (!address.valid) return;  // not a socket provider's address
  pending_.push_back({address, local, now_ns + kGiveUpNs});
  // A new connection is looked for at the next round, after the op that opens it.
  next_look_ns_ = now_ns;
  retry_ns_ = kFirstRetryNs;
}

void TcpCongestionSetter::look(int64_t now_ns) {
  std::vector<RailSocketAddress> locals, peers;
  for (const auto& w : pending_) (w.local ? locals : peers).push_back(w.address);
  std::vector<bool> found;
  apply(locals, peers, &found);
  size_t li = 0, pi = 0;
  std::vector<Watched> still;
  for (auto& w : pending_) {
    const bool seen = w.local ? found[li++] : found[locals.size() + pi++];
    if (!seen && now_ns < w.give_up_ns) still.push_back(w);
  }
  pending_.swap(still);
  next_look_ns_ = now_ns + retry_ns_;
  retry_ns_ = std::min(retry_ns_ * 4, kMaxRetryNs);
}

void TcpCongestionSetter::set_preferred(int fd) {
  char now[32] = {};
  socklen_t now_len = sizeof now - 1;
  const bool known = getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, now, &now_len) == 0;
  for (size_t i = first_allowed_; i < algorithms_.size(); ++i) {
    const std::string& name = algorithms_[i];
    if (known && name == now) return;  // switched already (or the system's choice is ours)
    if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0) {
      sockets_set_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (errno != EPERM && errno != ENOENT) break;  // this socket's trouble, not the name's
    first_allowed_ = i + 1;  // not for this process: the next socket starts after it
  }
  refused_.fetch_add(1, std::memory_order_relaxed);
}

bool for_each_tcp_socket(const std::function<void(int fd, const sockaddr_storage& local,
                                                 const sockaddr_storage* peer)>& visit) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return false;
  const int dir_fd = dirfd(dir);
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dir_fd) continue;
    struct stat st;
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int protocol = 0;
    socklen_t len = sizeof protocol;
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0 || protocol != IPPROTO_TCP)
      continue;
    sockaddr_storage local = {}, peer = {};
    socklen_t local_len = sizeof local, peer_len = sizeof peer;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    const bool connected = getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0;
    visit(static_cast<int>(fd), local, connected ? &peer : nullptr);
  }
  closedir(dir);
  return true;
}

void TcpCongestionSetter::apply(const std::vector<RailSocketAddress>& locals,
                                const std::vector<RailSocketAddress>& peers, std::vector<bool>* found) {
  found->assign(locals.size() + peers.size(), false);
  for_each_tcp_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage* peer) {
    bool ours = false;
    for (size_t i = 0; i < locals.size(); ++i)
      if (locals[i].matches(local)) ours = (*found)[i] = true;
    for (size_t i = 0; peer && i < peers.size(); ++i)
      if (peers[i].matches(*peer)) ours = (*found)[locals.size() + i] = true;
    if (ours) set_preferred(fd);
  });
}

}  // namespace kvxfer
