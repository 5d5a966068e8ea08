// The same-host immediate ring (same_host_imm_ring.hpp): lanes claimed one per writer, a
// full lane refusing (the writer then uses the fabric), a dead writer's lane taken over,
// corrupt indices skipped and counted, a closed board refused, and the eventfd written
// only while the receiver sleeps. The writer side maps the board through pidfd_getfd on
// this very process, the way a peer process does.
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "same_host_imm_ring.hpp"

namespace kvxfer {
namespace {

constexpr uint64_t kBoardEngine = 0xb0a2d;

struct Ring {
  std::unique_ptr<ImmRingBoard> board = ImmRingBoard::create(kBoardEngine);
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
  ~Ring() { close(pidfd); }

  std::unique_ptr<ImmRingLane> lane(uint64_t writer) const {
    return ImmRingLane::open(pidfd, board->memfd(), board->event_fd(), kBoardEngine, writer);
  }
  std::vector<std::pair<uint64_t, uint64_t>> drain() {
    std::vector<std::pair<uint64_t, uint64_t>> got;
    board->drain([&](uint64_t cq_data, uint64_t writer) { got.emplace_back(cq_data, writer); });
    return got;
  }
  bool woken() const {
    struct pollfd p = {board->event_fd(), POLLIN, 0};
    if (poll(&p, 1, 0) != 1) return false;
    uint64_t v;
    return read(board->event_fd(), &v, sizeof v) == sizeof v;
  }
};

TEST(ImmRing, EachWriterGetsALaneAndItsEntriesArriveInOrderNamingIt) {
  Ring ring;
  ASSERT_TRUE(ring.board);
  auto a = ring.lane(1), b = ring.lane(2);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->lane(), b->lane());
  EXPECT_FALSE(ring.board->pending());
  ASSERT_TRUE(a->push(10) && a->push(11) && b->push(20));
  EXPECT_FALSE(ring.board->pending()) << "published before notify";
  a->notify();
  b->notify();
  EXPECT_TRUE(ring.board->pending());
  auto got = ring.drain();
  std::vector<std::pair<uint64_t, uint64_t>> want = {{10, 1}, {11, 1}, {20, 2}};
  if (a->lane() > b->lane()) want = {{20, 2}, {10, 1}, {11, 1}};
  EXPECT_EQ(got, want);
  EXPECT_FALSE(ring.board->pending());
  EXPECT_TRUE(ring.drain().empty());
}

TEST(ImmRing, AFullLaneRefusesUntilTheReceiverDrainedIt) {
  Ring ring;
  auto lane = ring.lane(1);
  ASSERT_TRUE(lane);
  for (size_t i = 0; i < ImmRingBoard::kLaneEntries; ++i) ASSERT_TRUE(lane->push(i));
  EXPECT_FALSE(lane->push(999));
  lane->notify();
  EXPECT_EQ(ring.drain().size(), ImmRingBoard::kLaneEntries);
  EXPECT_TRUE(lane->push(999));
}

TEST(ImmRing, LanesRunOutThenADeadWritersLaneIsTakenOverAndAGivenBackOneReused) {
  Ring ring;
  std::vector<std::unique_ptr<ImmRingLane>> held;
  for (size_t i = 0; i < ImmRingBoard::kLanes - 1; ++i) held.push_back(ring.lane(100 + i));
  for (const auto& lane : held) ASSERT_TRUE(lane);
  // The last lane goes to a child process that exits without giving it back.
  pid_t child = fork();
  if (child == 0) {
    // Its own pidfd: the board's fds are inherited, and a child may not fetch its parent's.
    const int own = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
    auto lane = ImmRingLane::open(own, ring.board->memfd(), ring.board->event_fd(), kBoardEngine, 7);
    const bool claimed = lane != nullptr;
    lane.release();  // leaked: no destructor gives the claim back
    _exit(claimed ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto taken_over = ring.lane(8);
  ASSERT_TRUE(taken_over) << "the dead child's lane was not taken over";
  EXPECT_FALSE(ring.lane(9)) << "a 65th live writer got a lane";
  const size_t given_back = held.front()->lane();
  held.erase(held.begin());
  auto reused = ring.lane(10);
  ASSERT_TRUE(reused);
  EXPECT_EQ(reused->lane(), given_back);
}

TEST(ImmRing, EntriesLeftByAWriterThatGaveItsLaneBackStillArrive) {
  Ring ring;
  auto lane = ring.lane(1);
  ASSERT_TRUE(lane && lane->push(5));
  lane.reset();  // notifies, then gives the lane back
  EXPECT_EQ(ring.drain(), (std::vector<std::pair<uint64_t, uint64_t>>{{5, 1}}));
}

TEST(ImmRing, ALaneWithCorruptIndicesIsSkippedCountedAndUsableAgain) {
  Ring ring;
  auto lane = ring.lane(1);
  ASSERT_TRUE(lane);
  for (size_t i = 0; i < ImmRingBoard::kLaneEntries; ++i) ASSERT_TRUE(lane->push(i));
  lane->notify();
  EXPECT_EQ(ring.drain().size(), ImmRingBoard::kLaneEntries);
  // A broken writer moves its tail far past what the lane holds.
  auto* words = reinterpret_cast<uint64_t*>(
      mmap(nullptr, ImmRingBoard::bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, ring.board->memfd(), 0));
  ASSERT_NE(words, MAP_FAILED);
  // Header: 4 words, then 4 cache lines of flags and counts; each lane starts with its
  // claim line, then its tail line.
  const size_t lane_bytes = (ImmRingBoard::bytes() - 5 * 64) / ImmRingBoard::kLanes;
  uint64_t* tail = words + (5 * 64 + lane->lane() * lane_bytes + 64) / 8;
  ASSERT_EQ(*tail, ImmRingBoard::kLaneEntries) << "lane layout moved: fix this test's offsets";
  *tail += 10 * ImmRingBoard::kLaneEntries;
  EXPECT_FALSE(lane->push(1)) << "the lane looks full to its writer";
  // Another writer's post makes the receiver look: it skips the corrupt lane.
  auto other = ring.lane(2);
  ASSERT_TRUE(other && other->push(7));
  other->notify();
  EXPECT_EQ(ring.drain(), (std::vector<std::pair<uint64_t, uint64_t>>{{7, 2}}));
  EXPECT_EQ(ring.board->corrupt_lanes(), 1u);
  munmap(words, ImmRingBoard::bytes());
  ASSERT_TRUE(lane->push(42));
  lane->notify();
  EXPECT_EQ(ring.drain(), (std::vector<std::pair<uint64_t, uint64_t>>{{42, 1}}));
}

TEST(ImmRing, AClosedBoardRefusesPushes) {
  Ring ring;
  auto lane = ring.lane(1);
  ASSERT_TRUE(lane);
  ring.board->mark_closed();
  EXPECT_FALSE(lane->push(1));
}

TEST(ImmRing, TheEventfdIsWrittenOnlyWhileTheReceiverSleeps) {
  Ring ring;
  auto lane = ring.lane(1);
  ASSERT_TRUE(lane);
  ASSERT_TRUE(lane->push(1));
  lane->notify();
  EXPECT_FALSE(ring.woken()) << "woke a receiver that was not asleep";
  ring.board->set_sleeping(true);
  ASSERT_TRUE(lane->push(2));
  lane->notify();
  EXPECT_TRUE(ring.woken());
  lane->notify();  // nothing new pushed: no wake-up
  EXPECT_FALSE(ring.woken());
}

TEST(ImmRing, ALaneIsRefusedForAnotherEnginesBoardOrAFileThatIsNoBoard) {
  Ring ring;
  EXPECT_FALSE(ImmRingLane::open(ring.pidfd, ring.board->memfd(), ring.board->event_fd(), kBoardEngine + 1, 1));
  // The eventfd where the board should be: too small to be one.
  EXPECT_FALSE(ImmRingLane::open(ring.pidfd, ring.board->event_fd(), ring.board->event_fd(), kBoardEngine, 1));
  // The board where the eventfd should be.
  EXPECT_FALSE(ImmRingLane::open(ring.pidfd, ring.board->memfd(), ring.board->memfd(), kBoardEngine, 1));
  EXPECT_FALSE(ImmRingLane::open(ring.pidfd, -1, ring.board->event_fd(), kBoardEngine, 1));
}

}  // namespace
}  // namespace kvxfer
