// Immediates between engines of one kernel through shared memory: the same-host path's
// doorbell. A same-host write copies its bytes without the fabric (same_host_path.hpp),
// but its immediate used to follow over the fabric: loopback TCP, the receiver's CQ and
// the provider's progress, 11-18 us of a lone write (bench_same_host_imm.py) and as much
// CPU again. Here the writer appends the immediate to a ring in the receiver's memory and
// the receiver's progress worker counts it like a fabric arrival.
//
// The receiver owns an ImmRingBoard: a memfd of kLanes single-producer rings and an
// eventfd. A writer engine claims a lane of its own (ImmRingLane), so a writer that dies
// mid-push leaves at most one unpublished entry in its own lane and can hold up nobody.
// Each entry names its writer engine, so bind_imm_source still applies. The worker wakes
// from its sleep through the eventfd, which a writer only writes while the worker sleeps.
//
// Trust: mapping the board and fetching the eventfd take the same ptrace permission as
// process_vm_writev into the receiver, which already lets a writer write anything there.
// The receiver still reads the ring defensively: a lane whose indices make no sense is
// skipped and counted (corrupt), never trusted.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace kvxfer {

struct ImmRingLayout;

// Receiver side: owned by the TransferEngine, drained by its progress worker only.
class ImmRingBoard {
 public:
  static constexpr uint64_t kMagic = 0x31676e69726d6d69ull;  // "immring1"
  // Concurrent writer engines with a lane each; more writers fall back to the fabric.
  static constexpr size_t kLanes = 64;
  // Immediates a lane holds unread; a writer that finds its lane full uses the fabric.
  static constexpr size_t kLaneEntries = 512;

  // Null when the kernel gives no memfd or eventfd (then every immediate uses the fabric).
  static std::unique_ptr<ImmRingBoard> create(uint64_t engine_id);
  ~ImmRingBoard();
  ImmRingBoard(const ImmRingBoard&) = delete;
  ImmRingBoard& operator=(const ImmRingBoard&) = delete;

  int memfd() const { return memfd_; }
  int event_fd() const { return event_fd_; }
  static size_t bytes();

  // Worker only. Calls deliver(cq_data, writer_engine_id) for every entry published since
  // the last drain, in each lane's order; returns how many.
  template <class Deliver>
  size_t drain(Deliver&& deliver);
  // Worker only: true when a writer published something not drained yet.
  bool pending() const;
  // Worker only, around its sleep: while set, writers write the eventfd after a push. Set,
  // then look at pending() before sleeping (the writer publishes, then reads this flag).
  void set_sleeping(bool sleeping);
  // Lanes skipped because their indices were corrupt (a writer's bug or malice).
  uint64_t corrupt_lanes() const { return corrupt_.load(std::memory_order_relaxed); }
  // From close(): writers find the board closed and use the fabric (which then fails, as
  // it does to any closed engine) instead of queueing immediates nobody will read.
  void mark_closed();

 private:
  ImmRingBoard(ImmRingLayout* layout, int memfd, int event_fd)
      : layout_(layout), memfd_(memfd), event_fd_(event_fd) {}
  // Lane i's entries in [*head, tail) if they make sense; false (and counted) if not.
  bool lane_span(size_t lane, uint64_t* head, uint64_t* tail);
  void deliver_entry(size_t lane, uint64_t index, uint64_t* cq_data, uint64_t* writer) const;
  void finish_lane(size_t lane, uint64_t tail);
  uint64_t lanes_in_use() const;
  uint64_t posted() const;

  ImmRingLayout* layout_;
  int memfd_;
  int event_fd_;
  uint64_t drained_posts_ = 0;  // worker only: the writers' post count at the last drain
  std::atomic<uint64_t> corrupt_{0};
};

template <class Deliver>
size_t ImmRingBoard::drain(Deliver&& deliver) {
  const uint64_t posts = posted();
  if (posts == drained_posts_) return 0;
  // Entries published after this load bump the post count again: the next drain sees them.
  drained_posts_ = posts;
  size_t n = 0;
  const uint64_t in_use = lanes_in_use();
  for (size_t lane = 0; lane < kLanes; ++lane) {
    if (!(in_use & (1ull << lane))) continue;
    uint64_t head, tail;
    if (!lane_span(lane, &head, &tail)) continue;
    for (uint64_t i = head; i != tail; ++i, ++n) {
      uint64_t cq_data, writer;
      deliver_entry(lane, i, &cq_data, &writer);
      deliver(cq_data, writer);
    }
    finish_lane(lane, tail);
  }
  return n;
}

// Writer side: a claimed lane of a same-host peer's board. One thread pushes at a time
// (the writer's progress worker); the lane is given back when this is destroyed.
class ImmRingLane {
 public:
  // Maps the board `board_fd` of process `pidfd` (an fd number in that process), fetches
  // its eventfd and claims a free lane for `writer_engine_id`. Null when any step fails:
  // no permission, not the board of `peer_engine_id`, no free lane.
  static std::unique_ptr<ImmRingLane> open(int pidfd, int board_fd, int event_fd, uint64_t peer_engine_id,
                                           uint64_t writer_engine_id);
  ~ImmRingLane();
  ImmRingLane(const ImmRingLane&) = delete;
  ImmRingLane& operator=(const ImmRingLane&) = delete;

  // Appends one immediate; false when the lane is full or the board closed (use the fabric).
  bool push(uint64_t cq_data);
  // Publishes what push() appended since the last call and wakes the receiver if it sleeps.
  void notify();
  size_t lane() const { return lane_; }

 private:
  ImmRingLane(ImmRingLayout* layout, int event_fd, size_t lane, uint64_t claim, uint64_t writer)
      : layout_(layout), event_fd_(event_fd), lane_(lane), claim_(claim), writer_(writer) {}

  ImmRingLayout* layout_;
  int event_fd_;
  size_t lane_;
  uint64_t claim_;   // what this lane's claim word holds while it is ours
  uint64_t writer_;  // our engine id, written into every entry
  bool unnotified_ = false;
};

}  // namespace kvxfer
