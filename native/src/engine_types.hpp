// Types shared by every layer of the engine: errors, memory regions, the one transfer
// request type and its variants.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "completion_counter.hpp"
#include "futex_wait.hpp"

namespace kvxfer {

// Every error the engine raises derives from EngineError so Python maps them to one family.
class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A serialized address or memory descriptor that is truncated, corrupt or not ours.
class DescriptorError : public EngineError {
 public:
  using EngineError::EngineError;
};
// Offsets, lengths or page indices outside the registered regions.
class BoundsError : public EngineError {
 public:
  using EngineError::EngineError;
};
// An immediate whose arrivals the ImmCounter table could not count (every slot taken by
// other values): a wait on it fails at once rather than time out (imm_counter.hpp).
class ImmCounterOverflow : public EngineError {
 public:
  using EngineError::EngineError;
};
// libfabric said no: carries the provider's message.
class FabricError : public EngineError {
 public:
  FabricError(const std::string& what, int fi_errno);
  int fi_errno() const { return fi_errno_; }

 private:
  int fi_errno_;
};

// What the transfer ended as. Values are stable: Python reads them.
enum class TransferStatus : uint32_t {
  kPending = 0,
  kDone = 1,
  kFailed = 2,
  kTimedOut = 3,
};

// Shared between the submitting thread and the progress worker. The worker publishes the
// status once; waiters yield, then futex-wait on `status`. No locks: the other shared
// words (sleepers, the notify flag) follow store/load handshakes, both seq_cst, so one side
// always sees the other.
struct TransferState {
  uint64_t id = 0;
  std::atomic<uint32_t> status{static_cast<uint32_t>(TransferStatus::kPending)};
  std::atomic<uint32_t> notify_requested{0};
  // Waiters inside futex_wait: the completer issues a wake (a syscall) only if there are.
  std::atomic<uint32_t> sleepers{0};
  // Ops still outstanding on the fabric; touched only by the worker thread.
  uint32_t ops_outstanding = 0;
  int64_t deadline_ns = 0;
  // CLOCK_MONOTONIC stamps, for per-transfer timing without extra calls on the hot path.
  int64_t submitted_ns = 0;
  std::atomic<int64_t> completed_ns{0};
  uint64_t bytes = 0;
  std::string error;  // written by the worker before status is released
  // Set before submission when the transfer was submitted in a group (submit_many): it
  // finishes into this counter too.
  std::shared_ptr<CompletionCounter> counter;

  bool pending() const {
    return status.load(std::memory_order_acquire) == static_cast<uint32_t>(TransferStatus::kPending);
  }
  // Ends the transfer, once: its error and completion time, then the status, which
  // releases them to waiters; wakes the ones that sleep.
  void finish(TransferStatus s, const std::string& why) {
    error = why;
    completed_ns.store(monotonic_ns(), std::memory_order_relaxed);
    status.store(static_cast<uint32_t>(s), std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst)) futex_wake_all(&status);
    if (counter) counter->on_finish(s == TransferStatus::kDone, why);
  }
  // True once complete, false at the deadline. A transfer younger than kWaitSpinNs may
  // complete any moment: its waiter yields in a loop rather than sleep, since a futex sleep
  // and wake costs about as much as a 4 KiB round trip over loopback on a small VM (and
  // yielding, unlike spinning, lets the progress worker run on a shared core).
  bool wait_until(int64_t deadline_ns) {
    constexpr int64_t kWaitSpinNs = 50'000;
    const int64_t spin_until = std::min(deadline_ns, submitted_ns + kWaitSpinNs);
    while (pending() && monotonic_ns() < spin_until) sched_yield();
    for (;;) {
      if (!pending()) return true;
      if (monotonic_ns() >= deadline_ns) return false;
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (pending()) futex_wait_until(&status, static_cast<uint32_t>(TransferStatus::kPending), deadline_ns);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};
using TransferStatePtr = std::shared_ptr<TransferState>;

// Per-rail registration of one memory region.
struct RailRegistration {
  void* mr = nullptr;      // struct fid_mr*, opaque above the rail layer
  void* local_desc = nullptr;
  uint64_t key = 0;
  uint64_t remote_base = 0;  // what a peer adds offsets to: the virtual address or 0
};

// A registered buffer, with its registration on every rail.
struct MemoryRegion {
  uint64_t id = 0;
  uintptr_t addr = 0;
  uint64_t length = 0;
  // Set when the buffer lives in a file mapping (a memfd) that same-host peers may map:
  // the owner's descriptor number, the buffer's offset in the file, and the file's identity.
  int share_fd = -1;
  uint64_t share_offset = 0;
  uint64_t share_dev = 0, share_ino = 0;
  bool locked = false;  // its pages are locked (EngineSettings::lock_on_register) until deregistered
  std::vector<RailRegistration> rails;
};
using MemoryRegionPtr = std::shared_ptr<MemoryRegion>;

// Parts of a registered region, each registered again with its own fresh keys
// (TransferEngine::register_windows): the descriptor of a window set reaches only those
// parts, and closing the set revokes it. The parent stays registered for local reads.
struct MemoryWindows {
  struct Window {
    uint64_t offset = 0;  // in the parent region
    uint64_t length = 0;
    std::vector<RailRegistration> rails;
  };
  uint64_t id = 0;
  MemoryRegionPtr parent;
  std::vector<Window> windows;  // sorted by offset, disjoint
  bool closed = false;          // set under the engine's regions_mutex_
};
using MemoryWindowsPtr = std::shared_ptr<MemoryWindows>;

}  // namespace kvxfer
