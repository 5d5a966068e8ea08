// The receiving side's proof that a same-host writer can no longer write (kv_receiver.py,
// a dead prefiller). A same-host writer copies into our memfd-mapped cache with memcpy, or
// with process_vm_writev (same_host_path.hpp): there is no socket to sever, so what
// connection_sever.hpp proves for the fabric needs another argument here.
//
// The argument: the copy is run by a thread of the writer process, in user space (memcpy)
// or inside one system call (process_vm_writev). A killed thread leaves user space at its
// next kernel entry (SIGKILL sends an IPI to a running thread; a sleeping one is woken), a
// system call under way finishes or aborts first (the signal is acted on only on the way
// back to user space), and do_exit sets PF_EXITING in the thread's flags as its first step
// (exit_signals). From then on the thread runs no more user code and enters no system call;
// what the kernel itself still writes in its exit (clear_child_tid, robust futex words) is
// the writer's thread bookkeeping, never a copy's bytes. The stores the thread made before
// its kernel entry are visible before that flag is (x86-64 keeps stores in order; other
// CPUs order them at the interrupt or the context switch). So once every thread of the
// process has PF_EXITING (field 9 of /proc/<pid>/task/<tid>/stat, 0x4), is a zombie, or
// is gone from /proc/<pid>/task, or the pidfd reads as exited, no byte of a copy of it can
// land any more. A thread neither exiting nor gone (a live writer, a frozen one, a thread
// not scheduled since the kill, one in uninterruptible sleep) proves nothing.
//
// Which process: the writer's engine address names its pid (SameHostIdentity), as the
// writer reads ours from our address. That pid is the writer's own word; it is pinned with
// a pidfd while the writer runs (open()), and only then checked: its region table must name
// the writer's engine id. So a pid reused by another process later is never looked at (the
// pidfd reads as exited first). Trusting the declared pid is safe for what this proves: a
// same-host writer already holds ptrace rights over us and could write anything here
// anyway; the proof is about an honest writer's copy in flight when it was killed, not
// about a hostile process (nor a child it forked with our mapping, which runs no copy).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "descriptors.hpp"

namespace kvxfer {

class SameHostWriter {
 public:
  // Rounds of listing the writer's threads before giving up (a process releasing threads
  // while we list it makes a round inconclusive; its remaining threads are quickly zombies).
  static constexpr int kListRounds = 8;

  // Null unless `writer` can write into this process through the same-host path (its
  // identity names our host and PID namespace, `self`) and is pinned: a pidfd of its pid
  // and, after it was opened, the pid's region table naming `writer`'s engine id (read
  // through /proc/<pid>/fd/<table_fd>, which needs no more than same-user read rights, or
  // else by process_vm_readv). Call it while the writer runs.
  static std::unique_ptr<SameHostWriter> open(const EngineAddress& writer, const SameHostIdentity& self);
  ~SameHostWriter();
  SameHostWriter(const SameHostWriter&) = delete;
  SameHostWriter& operator=(const SameHostWriter&) = delete;

  pid_t pid() const { return pid_; }
  // "" once no thread of the writer process can copy any more (see above); otherwise why
  // that is not proven (a thread still running, /proc not readable). Never blocks.
  std::string still_writing() const;
  // True once the writer process exited (its pidfd is readable).
  bool exited() const;

 private:
  SameHostWriter(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}
  pid_t pid_;
  int pidfd_;
};

// Why thread `tid` of `pid` may still run user code: "" when it is exiting (PF_EXITING), a
// zombie or dead, or gone; else its state. `stat_line` is its /proc/<pid>/task/<tid>/stat
// (empty: gone). Exposed for tests.
std::string thread_may_run(pid_t tid, const std::string& stat_line);

}  // namespace kvxfer
