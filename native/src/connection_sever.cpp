#include "connection_sever.hpp"

#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace kvxfer {
namespace {

// Same family and IP; a wildcard IP on the peer's side is the same as any (unknown host).
bool same_host(const sockaddr_storage& peer, const sockaddr_storage& other) {
  if (peer.ss_family != other.ss_family) return false;
  if (peer.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(peer);
    const auto& y = reinterpret_cast<const sockaddr_in&>(other);
    return x.sin_addr.s_addr == y.sin_addr.s_addr || x.sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (peer.ss_family != AF_INET6) return false;
  const auto& x = reinterpret_cast<const sockaddr_in6&>(peer);
  const auto& y = reinterpret_cast<const sockaddr_in6&>(other);
  return std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0 || IN6_IS_ADDR_UNSPECIFIED(&x.sin6_addr);
}

uint16_t port_of(const sockaddr_storage& a) {
  return a.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(a).sin_port
                                : reinterpret_cast<const sockaddr_in6&>(a).sin6_port;
}

bool is_wildcard(const sockaddr_storage& a) {
  return a.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr == htonl(INADDR_ANY)
                                : IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr);
}

// Exactly the peer's address: its host (not a wildcard) and port.
bool same_address(const sockaddr_storage& peer, const sockaddr_storage& other) {
  if (peer.ss_family != AF_INET && peer.ss_family != AF_INET6) return false;
  return !is_wildcard(peer) && same_host(peer, other) && port_of(peer) == port_of(other);
}

// Reads and drops what the receive queue holds. Bounded: after shutdown(SHUT_RDWR) nothing
// new is queued, so at most one receive buffer's worth is read.
void discard_received(int fd) {
  char scrap[64 * 1024];
  for (;;) {
    const ssize_t n = recv(fd, scrap, sizeof scrap, MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    return;  // 0 (EOF), EAGAIN (empty) or an error (reset): no byte left to read
  }
}

bool is_listener(int fd) {
  int listening = 0;
  socklen_t len = sizeof listening;
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening;
}

// Bytes a read would still return (FIONREAD: for TCP, what the receive queue holds).
int queued_bytes(int fd) {
  int n = 0;
  return ioctl(fd, FIONREAD, &n) == 0 ? n : 0;
}

}  // namespace

SeverResult sever_tcp_connections_to(const RailSocketAddress& peer, const std::vector<RailSocketAddress>& ours) {
  SeverResult result;
  if (!peer.valid) return result;
  // A peer that names no host (bound to a wildcard): our connection to it shows the host's
  // real address, which nothing here can match.
  result.proven = !is_wildcard(peer.addr);
  const bool looked = for_each_tcp_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage* remote) {
    if (!remote) {
      // A listener, or a connection already reset whose peer the kernel no longer names:
      // harmless unless bytes are left in it for the provider to read.
      if (!is_listener(fd) && queued_bytes(fd) > 0) result.proven = false;
      return;
    }
    if (same_address(peer.addr, *remote)) {
      // ENOTCONN: the connection went meanwhile; its queue is drained all the same.
      (void)shutdown(fd, SHUT_RDWR);
      discard_received(fd);
      ++result.severed;
      return;
    }
    if (!same_host(peer.addr, *remote)) return;
    for (const auto& rail : ours)
      if (rail.matches(local)) result.proven = false;  // accepted from the peer's host: maybe the peer's
  });
  // Without /proc/self/fd (not mounted, no descriptor left) no socket was seen: no proof.
  if (!looked) result.proven = false;
  return result;
}

}  // namespace kvxfer
