// The one request type of the engine: what a caller asks for, carried whole from the Python
// binding through TransferEngine::submit to the planner of the rails (RailGroup::plan) or of
// the same-host path (plan_same_host), instead of an argument list repeated at each layer.
//
// Variants: a single write, a paged write, an immediate-only write. Barrier is a list of
// immediate-only requests plus a wait for each (TransferEngine.barrier in Python). Scatter
// (one source to several peers as one request) is not a variant: a WorkBatch carries one
// peer, so it needs a destination per op and a copy list per batch (docs/architecture.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <variant>

namespace kvxfer {

// length bytes from src_offset of the local region to dst_offset of the remote one.
struct SingleWrite {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

// Page indices borrowed from the caller (a NumPy array the binding keeps referenced while
// the request is planned): read in place, never copied.
struct PageList {
  const int64_t* data = nullptr;
  size_t size = 0;
};

// Page src_pages[i] (at src_offset + index * src_stride) to remote page dst_pages[i].
struct PagedWrite {
  PageList src_pages;
  PageList dst_pages;  // as long as src_pages (the binding checks)
  uint64_t page_size = 0;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;

  size_t count() const { return src_pages.size; }
};

// No bytes: only adds `units` to the receiver's count of the request's immediate.
struct ImmOnly {
  uint64_t units = 1;
};

struct TransferRequest {
  std::variant<SingleWrite, PagedWrite, ImmOnly> shape;
  std::optional<uint32_t> imm;

  // What the receiver's count of imm grows by once the request landed: one per single
  // write (however it is sharded), one per page, `units` for an immediate-only write.
  uint64_t units() const {
    if (const auto* p = std::get_if<PagedWrite>(&shape)) return p->count();
    if (const auto* i = std::get_if<ImmOnly>(&shape)) return i->units;
    return 1;
  }
  bool moves_bytes() const { return !std::holds_alternative<ImmOnly>(shape); }
};

}  // namespace kvxfer
