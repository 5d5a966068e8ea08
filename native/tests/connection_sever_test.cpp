// Severing this process's connections to one peer address (connection_sever.hpp), on real
// loopback TCP connections made here: bytes queued before the sever and bytes sent after it
// are never read from the severed socket, nothing else is touched, and the sever is proven
// only where no other socket may carry the peer's bytes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "connection_sever.hpp"
#include "loopback_pair.hpp"

namespace kvxfer {
namespace {

RailSocketAddress rail(const sockaddr_in& a) {
  return RailSocketAddress::from_raw(std::string(reinterpret_cast<const char*>(&a), sizeof a));
}

// This engine's rails, for tests where no listener of ours matters: an address nobody uses.
const std::vector<RailSocketAddress> kNoRails;

// Waits (at most 2 s) until `fd` is readable: data, EOF or an error.
void wait_readable(int fd) {
  pollfd p = {fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 2000), 1);
}

// What one non-blocking read of `fd` gives: the byte count, 0 at EOF, -1 on an error or none.
ssize_t read_once(int fd) {
  char buf[4096];
  return recv(fd, buf, sizeof buf, MSG_DONTWAIT);
}

TEST(ConnectionSever, NoByteIsReadAfterTheSeverNeitherQueuedBeforeNorSentAfter) {
  LoopbackPair c;
  connect_pair(&c);
  const std::string before(3000, 'a'), after(3000, 'b');
  ASSERT_EQ(send(c.accepted, before.data(), before.size(), 0), static_cast<ssize_t>(before.size()));
  wait_readable(c.client);  // queued on our side, unread
  const SeverResult result = sever_tcp_connections_to(rail(c.listen_address), kNoRails);
  EXPECT_EQ(result.severed, 1u);
  EXPECT_TRUE(result.proven);
  EXPECT_LE(read_once(c.client), 0);
  (void)send(c.accepted, after.data(), after.size(), MSG_NOSIGNAL);  // may fail: we shut down
  usleep(50'000);  // gives loopback time to deliver it, were it queued
  EXPECT_LE(read_once(c.client), 0);
}

TEST(ConnectionSever, TouchesNoOtherConnectionAndNoListener) {
  LoopbackPair severed, other;
  connect_pair(&severed);
  connect_pair(&other);
  EXPECT_EQ(sever_tcp_connections_to(rail(severed.listen_address), kNoRails).severed, 1u);
  const std::string message(100, 'x');
  ASSERT_EQ(send(other.accepted, message.data(), message.size(), 0), static_cast<ssize_t>(message.size()));
  wait_readable(other.client);
  EXPECT_EQ(read_once(other.client), static_cast<ssize_t>(message.size()));
  // The severed peer's listener still accepts connections.
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&severed.listen_address), sizeof severed.listen_address), 0);
  close(fd);
}

TEST(ConnectionSever, AWildcardOrNonSocketAddressSeversNothing) {
  LoopbackPair c;
  connect_pair(&c);
  sockaddr_in wildcard = c.listen_address;
  wildcard.sin_addr.s_addr = htonl(INADDR_ANY);
  const SeverResult to_wildcard = sever_tcp_connections_to(rail(wildcard), kNoRails);
  EXPECT_EQ(to_wildcard.severed, 0u);
  EXPECT_FALSE(to_wildcard.proven);  // our connection to that port is not known to be the peer's
  const SeverResult not_a_socket = sever_tcp_connections_to(RailSocketAddress::from_raw("shm-name"), kNoRails);
  EXPECT_EQ(not_a_socket.severed, 0u);
  EXPECT_FALSE(not_a_socket.proven);
  const std::string message(10, 'y');
  ASSERT_EQ(send(c.accepted, message.data(), message.size(), 0), static_cast<ssize_t>(message.size()));
  wait_readable(c.client);
  EXPECT_EQ(read_once(c.client), static_cast<ssize_t>(message.size()));
}

TEST(ConnectionSever, AConnectionOurListenerAcceptedFromThePeersHostIsNotProven) {
  // `c`'s listener is our rail; its accepted connection comes from 127.0.0.1, the host of
  // the peer at `other`'s address, and may be that peer's own (an ephemeral port).
  LoopbackPair c, other;
  connect_pair(&c);
  connect_pair(&other);
  const std::vector<RailSocketAddress> ours = {rail(c.listen_address)};
  const SeverResult result = sever_tcp_connections_to(rail(other.listen_address), ours);
  EXPECT_EQ(result.severed, 1u);
  EXPECT_FALSE(result.proven);
  const std::string message(10, 'z');  // the accepted connection is untouched
  ASSERT_EQ(send(c.client, message.data(), message.size(), 0), static_cast<ssize_t>(message.size()));
  wait_readable(c.accepted);
  EXPECT_EQ(read_once(c.accepted), static_cast<ssize_t>(message.size()));
}

TEST(ConnectionSever, AResetConnectionWithUnreadBytesIsNotProvenAndNoSocketAtAllIs) {
  LoopbackPair c;
  connect_pair(&c);
  sockaddr_in gone = c.listen_address;
  close(c.listener);
  c.listener = -1;
  EXPECT_TRUE(sever_tcp_connections_to(rail(gone), kNoRails).proven);  // our connection: severed
  LoopbackPair reset;
  connect_pair(&reset);
  const std::string unread(1000, 'r');
  ASSERT_EQ(send(reset.accepted, unread.data(), unread.size(), 0), static_cast<ssize_t>(unread.size()));
  wait_readable(reset.client);
  linger abort_on_close = {1, 0};  // close with a reset, as a writer killed with unread input
  ASSERT_EQ(setsockopt(reset.accepted, SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof abort_on_close), 0);
  close(reset.accepted);
  reset.accepted = -1;
  usleep(50'000);
  sockaddr_in nobody = gone;
  nobody.sin_port = 0;  // no socket is connected to it
  EXPECT_FALSE(sever_tcp_connections_to(rail(nobody), kNoRails).proven);  // `reset.client` still holds bytes
  char buf[2000];
  EXPECT_EQ(recv(reset.client, buf, sizeof buf, MSG_DONTWAIT), static_cast<ssize_t>(unread.size()));  // untouched
  EXPECT_TRUE(sever_tcp_connections_to(rail(nobody), kNoRails).proven);  // read: nothing left in it
}

TEST(ConnectionSever, WithoutADescriptorToReadProcSelfFdNothingIsProven) {
  LoopbackPair c;
  connect_pair(&c);
  sockaddr_in nobody = c.listen_address;
  nobody.sin_port = 0;  // no socket is connected to it: proven, when the descriptors can be read
  ASSERT_TRUE(sever_tcp_connections_to(rail(nobody), kNoRails).proven);
  rlimit limit;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  rlimit low = limit;
  low.rlim_cur = 256;  // every descriptor below it taken: opendir("/proc/self/fd") fails
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> taken;
  for (int fd; (fd = dup(c.client)) >= 0;) taken.push_back(fd);
  const SeverResult blind = sever_tcp_connections_to(rail(nobody), kNoRails);
  for (int fd : taken) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_FALSE(blind.proven);
}

}  // namespace
}  // namespace kvxfer
