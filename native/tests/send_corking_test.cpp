// TCP_CORK around bursts of sends (send_corking.hpp), on real loopback TCP connections made
// here: which sockets are found (the connections a rail's listener accepted and the ones to
// a watched peer, never a listener or an unrelated connection), and that a corked burst
// leaves as one segment when uncorked.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_segs_out (glibc's lacks it)
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "send_corking.hpp"
#include "loopback_pair.hpp"

namespace kvxfer {
namespace {

std::string raw(const sockaddr_in& a) { return std::string(reinterpret_cast<const char*>(&a), sizeof a); }

int corked(int fd) {
  int on = -1;
  socklen_t len = sizeof on;
  EXPECT_EQ(getsockopt(fd, IPPROTO_TCP, TCP_CORK, &on, &len), 0);
  return on;
}

TEST(SendCorking, FindsTheAcceptedAndTheOpenedConnectionsAndNothingElse) {
  LoopbackPair ours_in, ours_out, unrelated;
  connect_pair(&ours_in);
  connect_pair(&ours_out);
  connect_pair(&unrelated);
  SendCorker corker(true);
  EXPECT_TRUE(corker.idle());
  corker.add_local(raw(ours_in.listen_address));   // our rail: what its listener accepted
  corker.add_peer(raw(ours_out.listen_address));   // a peer's rail: our connection to it
  corker.rescan(0);
  EXPECT_EQ(corker.sockets(), 2u);
  EXPECT_FALSE(corker.idle());
  {
    CorkedBurst burst(corker, true);
    EXPECT_EQ(corked(ours_in.accepted), 1);
    EXPECT_EQ(corked(ours_out.client), 1);
    EXPECT_EQ(corked(ours_in.client), 0);    // the far end of our accepted connection
    EXPECT_EQ(corked(ours_out.accepted), 0);  // the peer's end
    EXPECT_EQ(corked(unrelated.client), 0);
    EXPECT_EQ(corked(unrelated.accepted), 0);
  }
  EXPECT_EQ(corked(ours_in.accepted), 0);  // uncorked when the burst ends
  EXPECT_EQ(corked(ours_out.client), 0);
  {
    CorkedBurst not_this_time(corker, false);
    EXPECT_EQ(corked(ours_out.client), 0);
  }
}

TEST(SendCorking, OffOrWithoutSocketAddressesItFindsNothing) {
  LoopbackPair c;
  connect_pair(&c);
  SendCorker off(false);
  off.add_local(raw(c.listen_address));
  off.rescan(0);
  EXPECT_TRUE(off.idle());
  EXPECT_EQ(off.sockets(), 0u);
  SendCorker shm_like(true);
  shm_like.add_peer("fi_shm://1234");  // not a sockaddr: ignored
  shm_like.rescan(0);
  EXPECT_TRUE(shm_like.idle());
}

TEST(SendCorking, ABurstOfSmallSendsLeavesTogetherWhenUncorked) {
  LoopbackPair c;
  connect_pair(&c);
  int nodelay = 1;  // as libfabric's providers set it: each send would leave at once
  ASSERT_EQ(setsockopt(c.client, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof nodelay), 0);
  SendCorker corker(true);
  corker.add_peer(raw(c.listen_address));
  corker.rescan(0);
  ASSERT_EQ(corker.sockets(), 1u);
  auto segments_out = [&] {
    tcp_info info = {};
    socklen_t len = sizeof info;
    EXPECT_EQ(getsockopt(c.client, IPPROTO_TCP, TCP_INFO, &info, &len), 0);
    return info.tcpi_segs_out;
  };
  const char byte = 'k';
  const unsigned before = segments_out();
  {
    CorkedBurst burst(corker, true);
    for (int i = 0; i < 32; ++i) ASSERT_EQ(send(c.client, &byte, 1, 0), 1);
    EXPECT_EQ(segments_out(), before);  // held while corked
  }
  EXPECT_EQ(segments_out() - before, 1u);  // 32 sends, one segment
  const unsigned uncorked_before = segments_out();
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(send(c.client, &byte, 1, 0), 1);
    usleep(1000);  // each acknowledged before the next: nothing to join
  }
  EXPECT_EQ(segments_out() - uncorked_before, 4u);
  char sink[36];
  EXPECT_EQ(recv(c.accepted, sink, sizeof sink, MSG_WAITALL), 36);
}

}  // namespace
}  // namespace kvxfer
