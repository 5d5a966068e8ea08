#include "same_host_imm_ring.hpp"

#include <fcntl.h>
#include <linux/memfd.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438  // same number on every architecture since Linux 5.6
#endif

namespace kvxfer {

struct ImmRingEntry {
  std::atomic<uint64_t> cq_data;
  std::atomic<uint64_t> writer;  // the writer engine's id: what bind_imm_source checks
};

// Each index on a cache line of its own: the writer's tail and the receiver's head are
// written by different processes on different cores.
struct ImmRingLaneImage {
  alignas(64) std::atomic<uint64_t> claim;  // 0: free; else (writer pid << 32) | serial
  alignas(64) std::atomic<uint64_t> tail;   // written by the lane's writer only
  alignas(64) std::atomic<uint64_t> head;   // written by the receiver only
  alignas(64) ImmRingEntry entries[ImmRingBoard::kLaneEntries];
};

struct ImmRingLayout {
  uint64_t magic;
  uint64_t engine_id;
  uint64_t lane_count;
  uint64_t lane_entries;
  alignas(64) std::atomic<uint32_t> closed;
  alignas(64) std::atomic<uint32_t> sleeping;  // the receiver's worker sleeps (wake it)
  alignas(64) std::atomic<uint64_t> posted;    // bumped by a writer after each group of pushes
  alignas(64) std::atomic<uint64_t> in_use;    // a bit per lane ever claimed: what drains scan
  ImmRingLaneImage lanes[ImmRingBoard::kLanes];
};

static_assert(ImmRingBoard::kLanes <= 64, "in_use is one 64-bit word");
static_assert((ImmRingBoard::kLaneEntries & (ImmRingBoard::kLaneEntries - 1)) == 0,
              "indices wrap by masking");

namespace {

constexpr uint64_t kEntryMask = ImmRingBoard::kLaneEntries - 1;

// Whether the process that claimed a lane still runs (pid in the claim's high half). A
// recycled pid reads as alive: the lane then stays taken, which costs a lane, never a
// second writer in one.
bool claimant_alive(uint64_t claim) {
  const pid_t pid = static_cast<pid_t>(claim >> 32);
  return kill(pid, 0) == 0 || errno == EPERM;
}

bool is_eventfd(int fd) {
  char link[64];
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
  if (n <= 0) return false;
  link[n] = '\0';
  return std::strcmp(link, "anon_inode:[eventfd]") == 0;
}

// Claims a free lane, else one whose writer process is gone; -1 if none.
int claim_lane(ImmRingLayout* layout, uint64_t claim) {
  for (size_t i = 0; i < ImmRingBoard::kLanes; ++i) {
    uint64_t free_word = 0;
    if (layout->lanes[i].claim.compare_exchange_strong(free_word, claim, std::memory_order_acq_rel))
      return static_cast<int>(i);
  }
  for (size_t i = 0; i < ImmRingBoard::kLanes; ++i) {
    uint64_t held = layout->lanes[i].claim.load(std::memory_order_acquire);
    if (held != 0 && !claimant_alive(held) &&
        layout->lanes[i].claim.compare_exchange_strong(held, claim, std::memory_order_acq_rel))
      return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

// -- ImmRingBoard (receiver) ----------------------------------------------------------------

size_t ImmRingBoard::bytes() { return sizeof(ImmRingLayout); }

std::unique_ptr<ImmRingBoard> ImmRingBoard::create(uint64_t engine_id) {
  int memfd = static_cast<int>(syscall(SYS_memfd_create, "kvxfer-imm-ring", MFD_CLOEXEC));
  if (memfd < 0) return nullptr;
  void* mem = MAP_FAILED;
  if (ftruncate(memfd, static_cast<off_t>(bytes())) == 0)
    mem = mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (mem == MAP_FAILED || efd < 0) {
    if (mem != MAP_FAILED) munmap(mem, bytes());
    if (efd >= 0) ::close(efd);
    ::close(memfd);
    return nullptr;
  }
  auto* layout = new (mem) ImmRingLayout();  // zeroed pages: every lane free and empty
  layout->magic = kMagic;
  layout->engine_id = engine_id;
  layout->lane_count = kLanes;
  layout->lane_entries = kLaneEntries;
  return std::unique_ptr<ImmRingBoard>(new ImmRingBoard(layout, memfd, efd));
}

ImmRingBoard::~ImmRingBoard() {
  mark_closed();
  layout_->~ImmRingLayout();
  munmap(layout_, bytes());
  ::close(event_fd_);
  ::close(memfd_);
}

void ImmRingBoard::mark_closed() { layout_->closed.store(1, std::memory_order_seq_cst); }

bool ImmRingBoard::pending() const { return posted() != drained_posts_; }

uint64_t ImmRingBoard::posted() const { return layout_->posted.load(std::memory_order_seq_cst); }

uint64_t ImmRingBoard::lanes_in_use() const { return layout_->in_use.load(std::memory_order_acquire); }

void ImmRingBoard::set_sleeping(bool sleeping) {
  layout_->sleeping.store(sleeping ? 1 : 0, std::memory_order_seq_cst);
}

bool ImmRingBoard::lane_span(size_t lane, uint64_t* head, uint64_t* tail) {
  auto& l = layout_->lanes[lane];
  *tail = l.tail.load(std::memory_order_acquire);
  *head = l.head.load(std::memory_order_relaxed);
  if (*tail - *head > kLaneEntries) {
    // Only a broken writer gets here: drop what it claims to have queued, and go on.
    corrupt_.fetch_add(1, std::memory_order_relaxed);
    l.head.store(*tail, std::memory_order_release);
    return false;
  }
  return *head != *tail;
}

void ImmRingBoard::deliver_entry(size_t lane, uint64_t index, uint64_t* cq_data, uint64_t* writer) const {
  const auto& e = layout_->lanes[lane].entries[index & kEntryMask];
  *cq_data = e.cq_data.load(std::memory_order_relaxed);
  *writer = e.writer.load(std::memory_order_relaxed);
}

void ImmRingBoard::finish_lane(size_t lane, uint64_t tail) {
  layout_->lanes[lane].head.store(tail, std::memory_order_release);  // the writer may reuse them
}

// -- ImmRingLane (writer) -------------------------------------------------------------------

std::unique_ptr<ImmRingLane> ImmRingLane::open(int pidfd, int board_fd, int event_fd, uint64_t peer_engine_id,
                                               uint64_t writer_engine_id) {
  if (board_fd < 0 || event_fd < 0) return nullptr;
  // pidfd_getfd takes the permission process_vm_writev takes (ptrace attach), and the fd
  // of the very process the pidfd pins: no /proc path whose pid may have been reused.
  int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, board_fd, 0));
  if (fd < 0) return nullptr;
  struct stat st;
  void* mem = MAP_FAILED;
  // A corrupt fd number may name any file of the peer's: one shorter than a board would
  // fault (SIGBUS) below, so it is not mapped.
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= ImmRingBoard::bytes())
    mem = mmap(nullptr, ImmRingBoard::bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mem == MAP_FAILED) return nullptr;
  auto* layout = static_cast<ImmRingLayout*>(mem);
  int efd = -1;
  if (layout->magic == ImmRingBoard::kMagic && layout->engine_id == peer_engine_id &&
      layout->lane_count == ImmRingBoard::kLanes && layout->lane_entries == ImmRingBoard::kLaneEntries)
    efd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, event_fd, 0));
  if (efd >= 0 && !is_eventfd(efd)) {
    ::close(efd);
    efd = -1;
  }
  static std::atomic<uint32_t> serial{1};
  const uint64_t claim = (static_cast<uint64_t>(getpid()) << 32) | serial.fetch_add(1);
  const int lane = efd >= 0 ? claim_lane(layout, claim) : -1;
  if (lane < 0) {
    if (efd >= 0) ::close(efd);
    munmap(mem, ImmRingBoard::bytes());
    return nullptr;
  }
  layout->in_use.fetch_or(1ull << lane, std::memory_order_acq_rel);
  return std::unique_ptr<ImmRingLane>(new ImmRingLane(layout, efd, static_cast<size_t>(lane), claim, writer_engine_id));
}

ImmRingLane::~ImmRingLane() {
  notify();
  // Entries still unread stay valid for the receiver: they name their writer themselves.
  uint64_t ours = claim_;
  layout_->lanes[lane_].claim.compare_exchange_strong(ours, 0, std::memory_order_acq_rel);
  munmap(layout_, ImmRingBoard::bytes());
  ::close(event_fd_);
}

bool ImmRingLane::push(uint64_t cq_data) {
  if (layout_->closed.load(std::memory_order_acquire)) return false;
  auto& l = layout_->lanes[lane_];
  const uint64_t tail = l.tail.load(std::memory_order_relaxed);  // ours alone to write
  if (tail - l.head.load(std::memory_order_acquire) >= ImmRingBoard::kLaneEntries) return false;
  auto& e = l.entries[tail & kEntryMask];
  e.cq_data.store(cq_data, std::memory_order_relaxed);
  e.writer.store(writer_, std::memory_order_relaxed);
  l.tail.store(tail + 1, std::memory_order_release);
  unnotified_ = true;
  return true;
}

void ImmRingLane::notify() {
  if (!unnotified_) return;
  unnotified_ = false;
  // seq_cst on both sides (this bump then the flag, the receiver's flag then its look at
  // the count): either it sees our entries before it sleeps, or we see it asleep.
  layout_->posted.fetch_add(1, std::memory_order_seq_cst);
  if (layout_->sleeping.load(std::memory_order_seq_cst)) {
    uint64_t one = 1;
    ssize_t ignored = write(event_fd_, &one, sizeof one);
    (void)ignored;
  }
}

}  // namespace kvxfer
