#include "same_host_writer_exit.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "same_host_path.hpp"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // same number on every architecture since Linux 5.3
#endif

namespace kvxfer {
namespace {

constexpr unsigned long kPfExiting = 0x4;  // include/linux/sched.h: "getting shut down"

// The whole of a small /proc file ("" when it cannot be read: gone, or not permitted).
std::string read_small(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[1024];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  ::close(fd);
  return out;
}

// The "Threads:" count of /proc/<pid>/status (the kernel's live thread count of the
// group, which drops as a thread is released from /proc/<pid>/task); -1 if unreadable.
long thread_count(pid_t pid) {
  const std::string status = read_small("/proc/" + std::to_string(pid) + "/status");
  const auto at = status.find("\nThreads:");
  if (at == std::string::npos) return -1;
  return std::strtol(status.c_str() + at + 9, nullptr, 10);
}

// The thread ids /proc/<pid>/task lists; false when it cannot be read.
bool list_threads(pid_t pid, std::set<pid_t>* tids) {
  DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (!dir) return false;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && tid > 0) tids->insert(static_cast<pid_t>(tid));
  }
  closedir(dir);
  return true;
}

// Reads the writer's table header through its own memfd (/proc/<pid>/fd/<table_fd>), or
// else from its memory; true when it names `engine_id`.
bool table_names_engine(pid_t pid, const SameHostIdentity& id, uint64_t engine_id) {
  RegionTable::Header h{};
  bool read = false;
  if (id.table_fd >= 0) {
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(id.table_fd);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      read = ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
      ::close(fd);
    }
  }
  if (!read) {
    struct iovec l = {&h, sizeof h};
    struct iovec r = {reinterpret_cast<void*>(id.table_addr), sizeof h};
    read = process_vm_readv(pid, &l, 1, &r, 1, 0) == static_cast<ssize_t>(sizeof h);
  }
  return read && h.magic == RegionTable::kMagic && h.engine_id == engine_id && h.slots == RegionTable::kSlots;
}

}  // namespace

std::string thread_may_run(pid_t tid, const std::string& stat_line) {
  if (stat_line.empty()) return "";  // released: past do_exit
  // "tid (comm) S ppid pgrp session tty_nr tpgid flags ...": comm may hold anything, so
  // the fields are counted from its last ')'.
  const auto close = stat_line.rfind(')');
  if (close == std::string::npos || close + 2 >= stat_line.size())
    return "thread " + std::to_string(tid) + ": unreadable stat";
  const char state = stat_line[close + 2];
  if (state == 'Z' || state == 'X' || state == 'x') return "";
  const char* p = stat_line.c_str() + close + 3;
  for (int field = 4; field < 9; ++field) {  // skip ppid, pgrp, session, tty_nr, tpgid
    char* end = nullptr;
    std::strtol(p, &end, 10);
    if (end == p) return "thread " + std::to_string(tid) + ": unreadable stat";
    p = end;
  }
  char* end = nullptr;
  const unsigned long flags = std::strtoul(p, &end, 10);
  if (end == p) return "thread " + std::to_string(tid) + ": unreadable stat";
  if (flags & kPfExiting) return "";
  return "thread " + std::to_string(tid) + " is not exiting (state " + std::string(1, state) + ")";
}

std::unique_ptr<SameHostWriter> SameHostWriter::open(const EngineAddress& writer, const SameHostIdentity& self) {
  const auto& id = writer.same_host;
  if (self.host_key.empty() || id.host_key != self.host_key || id.pid == 0) return nullptr;
  const pid_t pid = static_cast<pid_t>(id.pid);
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return nullptr;  // gone already, or no pidfds: nothing pins the pid
  std::unique_ptr<SameHostWriter> opened(new SameHostWriter(pid, pidfd));
  // Checked after the pidfd pinned the pid: the process it names is the writer's engine.
  if (opened->exited() || !table_names_engine(pid, id, writer.engine_id)) return nullptr;
  return opened;
}

SameHostWriter::~SameHostWriter() { ::close(pidfd_); }

bool SameHostWriter::exited() const {
  struct pollfd p = {pidfd_, POLLIN, 0};
  return poll(&p, 1, 0) != 0;  // readable (or an error) once the process is gone
}

std::string SameHostWriter::still_writing() const {
  // Conclusive rounds: the thread count the same before and after the listing, as many ids
  // listed (a listing that raced a release may miss threads), each exiting or gone. Two
  // in a row, the second listing nothing the first did not check: a thread created while
  // the first was listed (by one not yet exiting) shows in the second.
  std::set<pid_t> checked;
  int conclusive = 0;
  std::string why = "the writer's threads changed while they were listed";
  for (int round = 0; round < kListRounds; ++round) {
    if (exited()) return "";
    // While the pidfd is not readable the pid is still the writer's (it cannot be reused
    // before the writer is reaped, which makes the pidfd readable).
    const long before = thread_count(pid_);
    std::set<pid_t> tids;
    const bool listed = list_threads(pid_, &tids);
    const long after = thread_count(pid_);
    if (!listed || before < 0 || after < 0) {
      why = "/proc/" + std::to_string(pid_) + " is not readable";
      continue;  // reaped meanwhile (the pidfd tells next round), or not ours to read
    }
    if (before != after || static_cast<long>(tids.size()) != before) {
      conclusive = 0;
      continue;
    }
    bool news = false;
    for (pid_t tid : tids) {
      if (checked.count(tid)) continue;
      news = true;
      const std::string line =
          read_small("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(tid) + "/stat");
      std::string running = thread_may_run(tid, line);
      if (!running.empty()) return exited() ? "" : running;
      checked.insert(tid);
    }
    conclusive = news ? 1 : conclusive + 1;
    if (conclusive >= 2) return "";
  }
  return exited() ? "" : why;
}

}  // namespace kvxfer
