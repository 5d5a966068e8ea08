// Counters of one path (a rail, or the same-host copies): written by the progress worker,
// read by any thread (stats, metrics) without locks.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvxfer {

struct RailStats {
  std::atomic<uint64_t> bytes_posted{0}, bytes_completed{0}, ops_posted{0}, ops_completed{0},
      completion_errors{0}, imm_received{0};
};

}  // namespace kvxfer
