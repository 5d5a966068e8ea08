// The receiving side's proof that a same-host writer can no longer write
// (same_host_writer_exit.hpp): a writer is pinned only when its pid's region table names
// its engine; a live, frozen or partly exited writer proves nothing; a killed one does. The
// writers are real child processes forked from this one (they inherit its region table).
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "same_host_path.hpp"
#include "same_host_writer_exit.hpp"

namespace kvxfer {
namespace {

constexpr uint64_t kEngineId = 0x77a17e;
// How long a test waits for a child to reach the state it checks (no speed is asserted).
constexpr auto kStateDeadline = std::chrono::seconds(10);

// A child process: with `leader_exits`, its main thread ends (a zombie leader) once a byte
// comes on `release_fd`, while another thread keeps running, as a process some of whose
// threads exited. The leader waits for that byte so that the writer is pinned first: a
// zombie leader's fd table and memory are gone, so it could not be pinned after.
pid_t spawn_child(bool leader_exits, int release_fd) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (leader_exits) {
    pthread_t t;
    pthread_create(&t, nullptr, [](void*) -> void* { for (;;) pause(); }, nullptr);
    char byte;
    while (read(release_fd, &byte, 1) < 0 && errno == EINTR) {
    }
    syscall(SYS_exit, 0);  // this thread only, without unwinding the test's frames
  }
  for (;;) pause();
}

char proc_state(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return '?';
  char line[512] = {};
  const bool read = fgets(line, sizeof line, f) != nullptr;
  fclose(f);
  const char* close = read ? strrchr(line, ')') : nullptr;
  return close && close[1] && close[2] ? close[2] : '?';
}

bool wait_for_state(pid_t pid, char state) {
  const auto end = std::chrono::steady_clock::now() + kStateDeadline;
  while (proc_state(pid) != state && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  return proc_state(pid) == state;
}

class SameHostWriterExit : public ::testing::Test {
 protected:
  void SetUp() override {
    self_ = local_same_host_identity(table_.address(), table_.fd());
    ASSERT_FALSE(self_.host_key.empty()) << "needs /proc";
    ASSERT_EQ(pipe(release_), 0);
  }
  void TearDown() override {
    for (pid_t pid : children_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    close(release_[0]);
    close(release_[1]);
  }
  // Lets a `leader_exits` child's main thread end.
  void release_leader() { ASSERT_EQ(write(release_[1], "x", 1), 1); }
  EngineAddress writer(pid_t pid, uint64_t engine_id = kEngineId) {
    EngineAddress a;
    a.engine_id = engine_id;
    a.same_host = self_;
    a.same_host.pid = static_cast<uint32_t>(pid);
    return a;
  }
  pid_t child(bool leader_exits = false) {
    const pid_t pid = spawn_child(leader_exits, release_[0]);
    children_.push_back(pid);
    return pid;
  }

  RegionTable table_{kEngineId};
  SameHostIdentity self_;
  std::vector<pid_t> children_;
  int release_[2] = {-1, -1};
};

TEST(ThreadMayRun, ReadsTheExitingFlagAfterTheCommandsLastParenthesis) {
  // flags (field 9) 0x404044 has PF_EXITING (0x4); 0x404040 has not.
  EXPECT_EQ(thread_may_run(7, "7 (a) b) c) R 1 7 7 0 -1 4210756 12 0 0"), "");
  EXPECT_NE(thread_may_run(7, "7 (a) b) c) R 1 7 7 0 -1 4210752 12 0 0"), "");
  EXPECT_EQ(thread_may_run(7, "7 (x) Z 1 7 7 0 -1 4210752 12 0 0"), "");  // a zombie
  EXPECT_EQ(thread_may_run(7, ""), "");                                  // released
  EXPECT_NE(thread_may_run(7, "7 (x) S 1 7"), "");                        // truncated: unproven
}

TEST_F(SameHostWriterExit, IsPinnedOnlyWhereThePidsTableNamesTheWritersEngine) {
  const pid_t pid = child();
  EXPECT_TRUE(SameHostWriter::open(writer(pid), self_));
  EXPECT_FALSE(SameHostWriter::open(writer(pid, kEngineId + 1), self_));  // another engine's pid
  SameHostIdentity elsewhere = self_;
  elsewhere.host_key += "-other";
  EXPECT_FALSE(SameHostWriter::open(writer(pid), elsewhere));  // another host or PID namespace
}

TEST_F(SameHostWriterExit, ALiveOrFrozenWriterIsStillWritingAndAKilledOneIsNot) {
  const pid_t pid = child();
  auto w = SameHostWriter::open(writer(pid), self_);
  ASSERT_TRUE(w);
  EXPECT_NE(w->still_writing(), "");
  kill(pid, SIGSTOP);
  ASSERT_TRUE(wait_for_state(pid, 'T'));
  EXPECT_NE(w->still_writing(), "");  // frozen: it would write on when woken
  kill(pid, SIGKILL);                 // not reaped: a zombie holds the pid
  ASSERT_TRUE(wait_for_state(pid, 'Z'));
  EXPECT_EQ(w->still_writing(), "");
}

TEST_F(SameHostWriterExit, AWriterWithOneThreadNotExitingIsStillWriting) {
  const pid_t pid = child(/*leader_exits=*/true);
  auto w = SameHostWriter::open(writer(pid), self_);
  ASSERT_TRUE(w);
  release_leader();
  ASSERT_TRUE(wait_for_state(pid, 'Z'));  // its leader exited; its other thread sleeps
  const std::string why = w->still_writing();
  EXPECT_NE(why.find("is not exiting"), std::string::npos) << why;
  kill(pid, SIGKILL);
  const auto end = std::chrono::steady_clock::now() + kStateDeadline;
  while (!w->still_writing().empty() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(w->still_writing(), "");
}

}  // namespace
}  // namespace kvxfer
