#include "connection_sever.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace kvxfer {
namespace {

bool same_address(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr &&
           x.sin_addr.s_addr != htonl(INADDR_ANY);
  }
  if (a.ss_family != AF_INET6) return false;
  const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
  const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
  return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0 &&
         !IN6_IS_ADDR_UNSPECIFIED(&x.sin6_addr);
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

}  // namespace

size_t sever_tcp_connections_to(const RailSocketAddress& peer) {
  if (!peer.valid) return 0;
  size_t severed = 0;
  for_each_tcp_socket([&](int fd, const sockaddr_storage&, const sockaddr_storage* remote) {
    if (!remote || !same_address(peer.addr, *remote)) return;
    // ENOTCONN: the connection was already gone; its queue is drained all the same.
    (void)shutdown(fd, SHUT_RDWR);
    discard_received(fd);
    ++severed;
  });
  return severed;
}

}  // namespace kvxfer
