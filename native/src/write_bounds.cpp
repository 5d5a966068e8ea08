#include "write_bounds.hpp"

#include <string>

#include "engine_types.hpp"

namespace kvxfer {
namespace {

void check_range(const char* side, uint64_t off, uint64_t len, uint64_t size) {
  if (off > size || len > size - off)
    throw BoundsError(std::string(side) + " range [" + std::to_string(off) + ", " +
                      std::to_string(off) + "+" + std::to_string(len) + ") outside region of " +
                      std::to_string(size) + " bytes");
}

// True when [offset + index * stride, +page_size) lies inside a region of `length` bytes.
// Every step is checked, so no choice of offset, stride or index can wrap around 64 bits.
bool page_fits(uint64_t offset, uint64_t index, uint64_t stride, uint64_t page_size,
               uint64_t length) {
  if (offset > length || page_size > length - offset) return false;
  uint64_t room = length - offset - page_size;  // what index * stride may add
  return index == 0 || stride <= room / index;
}

std::string page_text(uint64_t offset, uint64_t stride, uint64_t page_size, uint64_t size) {
  return "page of " + std::to_string(page_size) + " bytes at offset " + std::to_string(offset) +
         " + index * " + std::to_string(stride) + " falls outside region of " +
         std::to_string(size) + " bytes";
}

}  // namespace

void check_write_bounds(uint64_t src_offset, uint64_t local_length, uint64_t dst_offset,
                        uint64_t remote_length, uint64_t length) {
  if (length == 0) throw BoundsError("write of 0 bytes: use write_imm for an immediate alone");
  check_range("source", src_offset, length, local_length);
  check_range("destination", dst_offset, length, remote_length);
}

void check_paged_bounds(const int64_t* src_pages, const int64_t* dst_pages, size_t count,
                        uint64_t page_size, uint64_t src_stride, uint64_t dst_stride,
                        uint64_t src_offset, uint64_t dst_offset, uint64_t local_length,
                        uint64_t remote_length) {
  if (page_size == 0) throw BoundsError("page_size must be > 0");
  if (src_stride < page_size || dst_stride < page_size)
    throw BoundsError("strides must be >= page_size (pages would overlap)");
  for (size_t i = 0; i < count; ++i) {
    if (src_pages[i] < 0 || dst_pages[i] < 0)
      throw BoundsError("negative page index at position " + std::to_string(i));
    uint64_t s = static_cast<uint64_t>(src_pages[i]), d = static_cast<uint64_t>(dst_pages[i]);
    if (!page_fits(src_offset, s, src_stride, page_size, local_length))
      throw BoundsError("source page " + std::to_string(s) + " at position " + std::to_string(i) +
                        ": " + page_text(src_offset, src_stride, page_size, local_length));
    if (!page_fits(dst_offset, d, dst_stride, page_size, remote_length))
      throw BoundsError("destination page " + std::to_string(d) + " at position " +
                        std::to_string(i) + ": " +
                        page_text(dst_offset, dst_stride, page_size, remote_length));
  }
  if (count == 0) throw BoundsError("paged write with no pages");
}

}  // namespace kvxfer
