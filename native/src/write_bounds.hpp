// Bounds checks shared by every path a write can take (fabric rails, same-host copy). A
// request is validated whole before anything is planned, so a bad one moves no byte.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transfer_request.hpp"

namespace kvxfer {

// [src_offset, +length) inside the local region and [dst_offset, +length) inside the
// remote one; length > 0. Throws BoundsError naming the side that is out of range.
void check_write_bounds(uint64_t src_offset, uint64_t local_length, uint64_t dst_offset,
                        uint64_t remote_length, uint64_t length);

// Every page i lands inside both regions: offset + pages[i] * stride, +page_size. Throws
// BoundsError naming the first bad position; no choice of numbers can wrap around.
void check_paged_bounds(const int64_t* src_pages, const int64_t* dst_pages, size_t count,
                        uint64_t page_size, uint64_t src_stride, uint64_t dst_stride,
                        uint64_t src_offset, uint64_t dst_offset, uint64_t local_length,
                        uint64_t remote_length);

inline void check_paged_bounds(const PagedWrite& w, uint64_t local_length, uint64_t remote_length) {
  check_paged_bounds(w.src_pages.data, w.dst_pages.data, w.count(), w.page_size, w.src_stride, w.dst_stride,
                     w.src_offset, w.dst_offset, local_length, remote_length);
}

}  // namespace kvxfer
