#include "page_locks.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace kvxfer {

PageLocks& PageLocks::process() {
  static PageLocks locks;
  return locks;
}

std::pair<uintptr_t, uintptr_t> PageLocks::page_span(uintptr_t addr, uint64_t length) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return {addr & ~(page - 1), (addr + length + page - 1) & ~(page - 1)};
}

bool PageLocks::lock(uintptr_t addr, uint64_t length) {
  auto [begin, end] = page_span(addr, length);
  if (begin == end) return true;
  std::lock_guard<std::mutex> guard(mutex_);
  if (mlock(reinterpret_cast<void*>(begin), end - begin) != 0) return false;
  spans_.emplace_back(begin, end);
  return true;
}

void PageLocks::unlock(uintptr_t addr, uint64_t length) {
  auto span = page_span(addr, length);
  if (span.first == span.second) return;
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = std::find(spans_.begin(), spans_.end(), span);
  if (it == spans_.end()) return;
  spans_.erase(it);
  // What other spans still cover inside this one, sorted; unlock the gaps between them.
  std::vector<std::pair<uintptr_t, uintptr_t>> kept;
  for (const auto& [b, e] : spans_)
    if (b < span.second && e > span.first) kept.emplace_back(std::max(b, span.first), std::min(e, span.second));
  std::sort(kept.begin(), kept.end());
  uintptr_t cursor = span.first;
  for (const auto& [b, e] : kept) {
    if (b > cursor) munlock(reinterpret_cast<void*>(cursor), b - cursor);
    cursor = std::max(cursor, e);
  }
  if (cursor < span.second) munlock(reinterpret_cast<void*>(cursor), span.second - cursor);
}

uint64_t PageLocks::locked_bytes() const {
  std::lock_guard<std::mutex> guard(mutex_);
  uint64_t n = 0;
  for (const auto& [b, e] : spans_) n += e - b;
  return n;
}

}  // namespace kvxfer
