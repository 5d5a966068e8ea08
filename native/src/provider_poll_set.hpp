// Which file descriptor the progress worker blocks on for a rail: the CQ's wait fd
// (FI_GETWAIT), or the provider's own socket poll set inside it.
//
// Why not always the CQ's wait fd: libfabric 1.17's net provider hands out an epoll set
// holding two things, its CQ's signal (one end of a socketpair) and the domain's poll set
// of sockets (the listener and every connection). It writes one byte into the signal when a
// completion enters the CQ, and nothing in 1.17 reads it again: its fi_trywait clears
// nothing, and only fi_cq_sread would. So from the first completion on that fd stays
// readable for the engine's life, epoll returns at once, and an idle worker could never
// block: 1,000 wake-ups a second and 3-3.6% of a core per idle engine with one connection
// (measured; benchmarks/README.md, "An idle engine").
//
// The signal tells of completions another thread wrote into the CQ. Here no other thread
// does: the progress worker is the only caller into its domain (FI_THREAD_DOMAIN, no
// provider progress thread; that one starts only for blocking CQ reads, which the engine
// never makes), and it reads the CQ empty before it sleeps. So what can wake it is socket
// traffic, which the inner poll set reports: bytes arriving, a connection accepted, or
// room to send while the provider waits for it (it asks for POLLOUT only then).
//
// The choice is made from what the kernel shows of the CQ's wait fd (/proc/self/fdinfo):
// only an epoll set whose members are exactly one nested epoll set and AF_UNIX sockets is
// taken apart. Any other shape (tcp;ofi_rxm's wait sets, which clear their signal) is used
// as it is, so a provider that works differently keeps the behaviour it had.
#pragma once

#include <string>
#include <vector>

namespace kvxfer {

// The fds registered in epoll set `epoll_fd` (from /proc/self/fdinfo), in the kernel's
// order; empty when `epoll_fd` is not an epoll set or cannot be read.
std::vector<int> epoll_members(int epoll_fd);

// The fd the worker should block on for a CQ whose wait fd is `cq_wait_fd` (see above):
// the nested poll set for the signal-plus-poll-set shape, else `cq_wait_fd` itself.
// `why` (optional) says which and why, for the rail's capabilities.
int provider_poll_set_fd(int cq_wait_fd, std::string* why = nullptr);

}  // namespace kvxfer
