// PageLocks (page_locks.hpp): mlock does not count, so when one of two overlapping locked
// registrations goes, the pages the other still covers must stay locked.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "page_locks.hpp"

namespace kvxfer {
namespace {

// VmLck of this process in bytes.
uint64_t locked_now() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

TEST(PageLocks, OverlappingSpansUnlockOnlyWhatNoOtherSpanCovers) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 16 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  const auto base = reinterpret_cast<uintptr_t>(mem);
  PageLocks& locks = PageLocks::process();
  const uint64_t before = locked_now();
  if (!locks.lock(base, 8 * page)) GTEST_SKIP() << "this process may not lock pages (RLIMIT_MEMLOCK)";
  ASSERT_TRUE(locks.lock(base + 4 * page + 1, 8 * page - 1));  // pages 4..11, unaligned start
  EXPECT_EQ(locked_now() - before, 12 * page);

  locks.unlock(base, 8 * page);  // pages 0..3 go; 4..7 are still covered by the second
  EXPECT_EQ(locked_now() - before, 8 * page);
  locks.unlock(base + 12 * page, page);  // never locked: nothing happens
  EXPECT_EQ(locked_now() - before, 8 * page);
  locks.unlock(base + 4 * page + 1, 8 * page - 1);
  EXPECT_EQ(locked_now(), before);
  munmap(mem, 16 * page);
}

}  // namespace
}  // namespace kvxfer
