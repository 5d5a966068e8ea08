// Page locking of registered memory (EngineSettings::lock_on_register), process-wide.
//
// mlock does not count: one munlock unlocks a page whatever locked it before. Two
// registrations may cover the same pages (the same buffer registered twice, or by two
// engines of one process), so this table keeps every locked span and, when one goes,
// unlocks only the parts no other span still covers.
#pragma once

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace kvxfer {

class PageLocks {
 public:
  // The one table of this process (mlock is per process, not per engine).
  static PageLocks& process();

  // Locks the pages of [addr, addr + length). False (nothing locked, errno kept) where the
  // kernel refuses: RLIMIT_MEMLOCK without CAP_IPC_LOCK, or a mapping it cannot lock.
  bool lock(uintptr_t addr, uint64_t length);
  // Ends one earlier successful lock of exactly this span; pages another span still
  // covers stay locked.
  void unlock(uintptr_t addr, uint64_t length);
  // Bytes of whole pages in the spans locked now (overlaps counted once per span).
  uint64_t locked_bytes() const;

  // Page-aligned [begin, end) of a span: what mlock actually locks.
  static std::pair<uintptr_t, uintptr_t> page_span(uintptr_t addr, uint64_t length);

 private:
  mutable std::mutex mutex_;  // registration only, never on the transfer path
  std::vector<std::pair<uintptr_t, uintptr_t>> spans_;  // page-aligned, one per lock()
};

}  // namespace kvxfer
