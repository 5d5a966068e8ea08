// A real loopback TCP connection for the tests of socket-walking code (send_corking,
// connection_sever): a listener on 127.0.0.1, a client connected to it and the accepted end.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvxfer {

struct LoopbackPair {
  int listener = -1, client = -1, accepted = -1;
  sockaddr_in listen_address = {};
  ~LoopbackPair() {
    for (int fd : {listener, client, accepted})
      if (fd >= 0) close(fd);
  }
};

// Fills `c` with a listener on an ephemeral loopback port and one connection to it, both
// ends open (a gtest assertion fails the calling test otherwise).
inline void connect_pair(LoopbackPair* c) {
  c->listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  c->listen_address.sin_family = AF_INET;
  c->listen_address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(c->listener, reinterpret_cast<sockaddr*>(&c->listen_address), sizeof c->listen_address), 0);
  socklen_t len = sizeof c->listen_address;
  ASSERT_EQ(getsockname(c->listener, reinterpret_cast<sockaddr*>(&c->listen_address), &len), 0);
  ASSERT_EQ(listen(c->listener, 4), 0);
  c->client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(connect(c->client, reinterpret_cast<sockaddr*>(&c->listen_address), sizeof c->listen_address), 0);
  c->accepted = accept4(c->listener, nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(c->accepted, 0);
}

}  // namespace kvxfer
