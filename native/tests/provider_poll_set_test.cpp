// Which fd the progress worker blocks on (provider_poll_set.hpp): the provider's socket poll
// set when the CQ's wait fd is an epoll set of one nested poll set and signal sockets (the
// shape of libfabric 1.17's net, whose signal is never cleared), the wait fd itself for any
// other shape. The sets here are built by hand in the same shapes.
#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "provider_poll_set.hpp"

namespace kvxfer {
namespace {

// Closes what a test opened, whatever it asserts.
struct Fds {
  std::vector<int> fds;
  int keep(int fd) {
    fds.push_back(fd);
    return fd;
  }
  ~Fds() {
    for (int fd : fds) close(fd);
  }
};

int epoll_of(Fds& fds, const std::vector<int>& members) {
  int ep = fds.keep(epoll_create1(EPOLL_CLOEXEC));
  for (int fd : members) {
    struct epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    EXPECT_EQ(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev), 0);
  }
  return ep;
}

// The read end of a new socketpair (a libfabric fd_signal); *write_end gets the other.
int signal_socket(Fds& fds, int* write_end = nullptr) {
  int pair[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  fds.keep(pair[1]);
  if (write_end) *write_end = pair[1];
  return fds.keep(pair[0]);
}

TEST(ProviderPollSet, ListsTheMembersOfAnEpollSetAndNothingForOtherFds) {
  Fds fds;
  int a = signal_socket(fds), b = signal_socket(fds);
  int ep = epoll_of(fds, {a, b});
  std::vector<int> members = epoll_members(ep);
  ASSERT_EQ(members.size(), 2u);
  EXPECT_TRUE((members[0] == a && members[1] == b) || (members[0] == b && members[1] == a));
  EXPECT_TRUE(epoll_members(a).empty());  // a socket, not a set
  EXPECT_TRUE(epoll_members(-1).empty());
}

TEST(ProviderPollSet, TheNetShapeSleepsOnTheNestedPollSetNotOnTheNeverClearedSignal) {
  Fds fds;
  int progress_signal = signal_socket(fds);
  int sockets = epoll_of(fds, {progress_signal});  // the domain's poll set of sockets
  int cq_signal_writer = -1;
  int cq_signal = signal_socket(fds, &cq_signal_writer);
  int cq_wait = epoll_of(fds, {cq_signal, sockets});
  std::string why;
  EXPECT_EQ(provider_poll_set_fd(cq_wait, &why), sockets);
  EXPECT_NE(why.find("provider poll set"), std::string::npos) << why;

  // What that buys: a signal written once and never read keeps the wait fd readable, the
  // nested set is not.
  char byte = 1;
  ASSERT_EQ(write(cq_signal_writer, &byte, 1), 1);
  struct epoll_event ev;
  EXPECT_EQ(epoll_wait(cq_wait, &ev, 1, 0), 1);
  EXPECT_EQ(epoll_wait(sockets, &ev, 1, 0), 0);
}

TEST(ProviderPollSet, AnyOtherShapeKeepsTheCqWaitFd) {
  Fds fds;
  std::string why;
  // Not an epoll set at all (an eventfd, as some providers hand out).
  int efd = fds.keep(eventfd(0, EFD_CLOEXEC));
  EXPECT_EQ(provider_poll_set_fd(efd, &why), efd);
  // An empty set.
  int empty = epoll_of(fds, {});
  EXPECT_EQ(provider_poll_set_fd(empty, &why), empty);
  // Signals only, no nested set.
  int only_signals = epoll_of(fds, {signal_socket(fds)});
  EXPECT_EQ(provider_poll_set_fd(only_signals, &why), only_signals);
  EXPECT_NE(why.find("no nested"), std::string::npos) << why;
  // Two nested sets (tcp;ofi_rxm's shape: its wait sets clear their signal).
  int inner_a = epoll_of(fds, {signal_socket(fds)});
  int inner_b = epoll_of(fds, {signal_socket(fds)});
  int two = epoll_of(fds, {inner_a, inner_b});
  EXPECT_EQ(provider_poll_set_fd(two, &why), two);
  // A nested set beside something that is not a signal socket (an eventfd, a TCP socket):
  // that member could be the only sign of work, so nothing is skipped.
  int with_eventfd = epoll_of(fds, {epoll_of(fds, {signal_socket(fds)}), fds.keep(eventfd(0, EFD_CLOEXEC))});
  EXPECT_EQ(provider_poll_set_fd(with_eventfd, &why), with_eventfd);
  int tcp = fds.keep(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int with_tcp = epoll_of(fds, {epoll_of(fds, {signal_socket(fds)}), tcp});
  EXPECT_EQ(provider_poll_set_fd(with_tcp, &why), with_tcp);
}

}  // namespace
}  // namespace kvxfer
