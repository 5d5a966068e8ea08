// TcpCongestionSetter: which sockets of the process it switches, and what it leaves alone.
#include "tcp_congestion.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace kvxfer {
namespace {

std::string congestion_of(int fd) {
  char name[32] = {};
  socklen_t len = sizeof name - 1;
  EXPECT_EQ(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len), 0);
  return name;
}

std::string system_default() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_congestion_control");
  std::string name;
  f >> name;
  return name;
}

// An algorithm other than the system's default, so that a switch is visible.
std::string another_algorithm() { return system_default() == "reno" ? "cubic" : "reno"; }

std::string raw_of(int fd, bool peer) {
  sockaddr_in a = {};
  socklen_t len = sizeof a;
  if (peer)
    getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
  else
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return std::string(reinterpret_cast<const char*>(&a), sizeof a);
}

// A loopback listener with one accepted connection: what a socket provider's rail holds.
struct Connection {
  int listener = -1, client = -1, accepted = -1;
  Connection() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(listener, 4);
    socklen_t len = sizeof a;
    getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    client = socket(AF_INET, SOCK_STREAM, 0);
    connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a);
    accepted = accept(listener, nullptr, nullptr);
  }
  ~Connection() {
    for (int fd : {listener, client, accepted}) close(fd);
  }
};

TEST(TcpCongestion, ARailsLocalAddressSwitchesItsListenerAndItsAcceptedConnectionsOnly) {
  Connection ours, other;
  ASSERT_GE(ours.accepted, 0);
  const std::string before = congestion_of(other.listener);
  TcpCongestionSetter setter(another_algorithm());
  std::vector<bool> found;
  setter.apply({RailSocketAddress::from_raw(raw_of(ours.listener, false))}, {}, &found);
  EXPECT_EQ(found, std::vector<bool>{true});
  EXPECT_EQ(congestion_of(ours.listener), another_algorithm());
  EXPECT_EQ(congestion_of(ours.accepted), another_algorithm());
  EXPECT_EQ(congestion_of(ours.client), before);  // its local port is an ephemeral one
  for (int fd : {other.listener, other.client, other.accepted}) EXPECT_EQ(congestion_of(fd), before);
  EXPECT_EQ(setter.sockets_set(), 2u);
  // A second pass finds them switched already and counts nothing.
  setter.apply({RailSocketAddress::from_raw(raw_of(ours.listener, false))}, {}, &found);
  EXPECT_EQ(setter.sockets_set(), 2u);
}

TEST(TcpCongestion, APeersAddressSwitchesTheConnectionToItOnly) {
  Connection ours, other;
  const std::string before = congestion_of(other.client);
  TcpCongestionSetter setter(another_algorithm());
  std::vector<bool> found;
  setter.apply({}, {RailSocketAddress::from_raw(raw_of(ours.client, true))}, &found);
  EXPECT_EQ(found, std::vector<bool>{true});
  EXPECT_EQ(congestion_of(ours.client), another_algorithm());
  EXPECT_EQ(congestion_of(ours.listener), before);  // not connected: no peer to match
  EXPECT_EQ(congestion_of(other.client), before);
  EXPECT_EQ(setter.sockets_set(), 1u);
}

TEST(TcpCongestion, AnAlgorithmTheKernelRefusesIsCountedAndNothingChanges) {
  Connection ours;
  const std::string before = congestion_of(ours.listener);
  TcpCongestionSetter setter("no-such-cc");
  std::vector<bool> found;
  setter.apply({RailSocketAddress::from_raw(raw_of(ours.listener, false))}, {}, &found);
  EXPECT_EQ(setter.refused(), 2u);
  EXPECT_EQ(setter.sockets_set(), 0u);
  EXPECT_EQ(congestion_of(ours.listener), before);
}

TEST(TcpCongestion, ARefusedAlgorithmGivesWayToTheNextOneForEverySocketAfter) {
  Connection ours;
  TcpCongestionSetter setter("no-such-cc," + another_algorithm());
  std::vector<bool> found;
  setter.apply({RailSocketAddress::from_raw(raw_of(ours.listener, false))}, {}, &found);
  EXPECT_EQ(congestion_of(ours.listener), another_algorithm());
  EXPECT_EQ(congestion_of(ours.accepted), another_algorithm());
  EXPECT_EQ(setter.sockets_set(), 2u);
  EXPECT_EQ(setter.refused(), 0u);
}

TEST(TcpCongestion, WatchedAddressesAreLookedForUntilFoundAndNonSocketAddressesAreIgnored) {
  Connection ours;
  TcpCongestionSetter setter(another_algorithm());
  setter.watch_peer("fi_shm://1234", 0);  // a shm address: nothing to look for
  setter.watch_peer(raw_of(ours.client, true), 0);
  setter.poll(0);
  EXPECT_EQ(congestion_of(ours.client), another_algorithm());
  // Found: later polls look no more, so a connection opened to it afterwards keeps its own.
  const std::string peer = raw_of(ours.client, true);
  int late = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(late, reinterpret_cast<const sockaddr*>(peer.data()), sizeof(sockaddr_in)), 0);
  setter.poll(TcpCongestionSetter::kMaxRetryNs * 2);
  EXPECT_NE(congestion_of(late), another_algorithm());
  close(late);
  TcpCongestionSetter off("");  // the system's choice: nothing is ever looked at
  off.watch_local(raw_of(ours.listener, false), 0);
  off.poll(0);
  EXPECT_EQ(off.sockets_set() + off.refused(), 0u);
}

TEST(TcpCongestion, AddressesMatchByFamilyPortAndAddressWithWildcards) {
  auto v4 = [](const char* ip, uint16_t port) {
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, ip, &a.sin_addr);
    return std::string(reinterpret_cast<const char*>(&a), sizeof a);
  };
  auto storage = [](const std::string& raw) {
    sockaddr_storage s = {};
    memcpy(&s, raw.data(), raw.size());
    return s;
  };
  auto rail = RailSocketAddress::from_raw(v4("127.0.0.1", 4000));
  ASSERT_TRUE(rail.valid);
  EXPECT_TRUE(rail.matches(storage(v4("127.0.0.1", 4000))));
  EXPECT_TRUE(rail.matches(storage(v4("0.0.0.0", 4000))));
  EXPECT_FALSE(rail.matches(storage(v4("127.0.0.1", 4001))));
  EXPECT_FALSE(rail.matches(storage(v4("10.0.0.1", 4000))));
  EXPECT_FALSE(RailSocketAddress::from_raw("short").valid);
  EXPECT_FALSE(RailSocketAddress::from_raw(std::string(64, '\x7f')).valid);
}

}  // namespace
}  // namespace kvxfer
