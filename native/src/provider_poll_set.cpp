#include "provider_poll_set.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace kvxfer {

namespace {

std::string fd_link(int fd) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  char target[256];
  ssize_t n = readlink(path, target, sizeof target - 1);
  if (n <= 0) return {};
  return std::string(target, static_cast<size_t>(n));
}

bool is_epoll(int fd) { return fd_link(fd) == "anon_inode:[eventpoll]"; }

bool is_unix_socket(int fd) {
  int domain = -1;
  socklen_t len = sizeof domain;
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX;
}

}  // namespace

std::vector<int> epoll_members(int epoll_fd) {
  std::vector<int> members;
  if (epoll_fd < 0 || !is_epoll(epoll_fd)) return members;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fdinfo/%d", epoll_fd);
  std::ifstream info(path);
  std::string line;
  // One line per registered fd: "tfd:        9 events:       19 data: ...".
  while (std::getline(info, line)) {
    if (line.compare(0, 4, "tfd:") != 0) continue;
    std::istringstream fields(line.substr(4));
    int fd = -1;
    if (fields >> fd && fd >= 0) members.push_back(fd);
  }
  return members;
}

int provider_poll_set_fd(int cq_wait_fd, std::string* why) {
  auto say = [why](const char* text) {
    if (why) *why = text;
  };
  const std::vector<int> members = epoll_members(cq_wait_fd);
  if (members.empty()) {
    say("cq wait fd (not an epoll set with members)");
    return cq_wait_fd;
  }
  int nested = -1;
  for (int fd : members) {
    if (is_epoll(fd)) {
      if (nested >= 0) {
        say("cq wait fd (more than one nested poll set)");
        return cq_wait_fd;
      }
      nested = fd;
    } else if (!is_unix_socket(fd)) {
      say("cq wait fd (a member is neither a poll set nor a signal socket)");
      return cq_wait_fd;
    }
  }
  if (nested < 0) {
    say("cq wait fd (no nested poll set)");
    return cq_wait_fd;
  }
  say("provider poll set (nested in the cq wait fd, beside its signal)");
  return nested;
}

}  // namespace kvxfer
