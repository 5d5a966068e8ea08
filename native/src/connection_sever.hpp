// Severing this process's TCP connections to one peer address, for the decoder whose
// prefiller died while a write of it was under way (kv_receiver.py, the dead-prefiller path).
//
// Why: a socket provider (net 1.17) checks a write's key once, at the op's header, and then
// copies the op's payload into the target as it comes off the socket; revoking the target's
// registration refuses only later ops, and fi_av_remove tears no connection down. A killed
// writer's kernel keeps sending the op it held (tests/integrations/
// test_kv_revoked_write_in_progress.py). Cutting the connection under the provider stops it.
//
// What a sever does to each matching socket: shutdown(SHUT_RDWR), then it reads and discards
// what the socket's receive queue holds. After shutdown(SHUT_RDWR) Linux no longer queues
// new data on it (a segment with data answers with a reset: the socket is in FIN_WAIT or
// LAST_ACK with RCV_SHUTDOWN), but what was queued before stays readable, and the provider
// would copy that into the target: hence the drain. Once this returns, a read of the socket
// gives EOF or an error and no byte. That holds for the provider only if no read of it is
// under way meanwhile: call it on the thread that runs the provider's progress.
#pragma once

#include <cstddef>

#include "tcp_congestion.hpp"

namespace kvxfer {

// Severs every connected TCP socket of this process whose peer address is exactly `peer`
// (family, IP and port; a wildcard IP matches nothing) and returns how many. An invalid
// address (not a socket provider's) severs nothing.
size_t sever_tcp_connections_to(const RailSocketAddress& peer);

}  // namespace kvxfer
