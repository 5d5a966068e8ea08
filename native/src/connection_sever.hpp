// Severing this process's TCP connections to one peer, for the decoder whose prefiller died
// while a write of it was under way (kv_receiver.py, the dead-prefiller path).
//
// Why: a socket provider (net 1.17) checks a write's key once, at the op's header, and then
// copies the op's payload into the target as it comes off the socket; revoking the target's
// registration refuses only later ops, and fi_av_remove tears no connection down. A killed
// writer's kernel keeps sending the op it held (tests/integrations/
// test_kv_revoked_write_in_progress.py). Cutting the connection under the provider stops it.
//
// What a sever does to each socket connected to the peer's address: shutdown(SHUT_RDWR),
// then it reads and discards what the socket's receive queue holds. After
// shutdown(SHUT_RDWR) Linux queues no new data on it (a segment with data is answered with a
// reset: the socket is in FIN_WAIT or LAST_ACK with RCV_SHUTDOWN), but what was queued
// before stays readable, and the provider would copy that into the target: hence the drain.
// Once this returns, a read of the socket gives EOF or an error and no byte. That holds for
// the provider only if no read of it is under way meanwhile: call it on the thread that runs
// the provider's progress. Nor does net keep bytes of the op under way in a buffer of its
// own between two progress calls: its receive loop (xnet_progress_rx) goes on while its
// prefetch buffer holds bytes, so what it has not copied is still in the socket; prefetched
// bytes of a later op are refused at that op's header once the registration was revoked.
//
// When that proves that no byte from the peer lands any more (`proven`): no other socket of
// this process can carry its bytes. Two kinds could, and neither can be told apart from
// another peer's, so they are left alone and the sever is not proven:
// - a connection one of our listeners accepted from the peer's host (IP): the peer opened
//   it, from an ephemeral port;
// - a connection already reset (state CLOSE: no peer address any more) with bytes still in
//   its receive queue, which stay readable after a reset (a writer killed with unread input
//   resets instead of closing).
// A connection the provider already closed (on the peer's EOF or reset) is gone with its
// bytes: no socket of ours at all is proven too.
#pragma once

#include <cstddef>
#include <vector>

#include "tcp_congestion.hpp"

namespace kvxfer {

struct SeverResult {
  size_t severed = 0;   // sockets connected to the peer's address, shut down and drained
  bool proven = false;  // no other socket of this process can carry the peer's bytes
};

// Severs every connected TCP socket of this process whose peer address is exactly `peer`
// (family, IP and port; a wildcard IP matches nothing and proves nothing). `ours`: this
// engine's rail addresses, whose listeners' accepted connections are checked against the
// peer's host.
// An invalid `peer` (not a socket provider's address) severs nothing and proves nothing.
SeverResult sever_tcp_connections_to(const RailSocketAddress& peer, const std::vector<RailSocketAddress>& ours);

}  // namespace kvxfer
