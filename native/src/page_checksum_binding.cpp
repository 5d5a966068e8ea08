// pybind11 face of page_checksum.hpp (kvxfer._native.crc32c, page_crc32c, crc32c_hardware).
// Kept out of bindings.cpp: that file calls bind_page_checksum(m) and nothing else of it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "gil_release.hpp"
#include "page_checksum.hpp"

namespace py = pybind11;

namespace kvxfer {

void bind_page_checksum(py::module_& m) {
  using PageArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  m.def("crc32c_hardware", &crc32c_hardware, "True when crc32c uses the SSE4.2 instruction here");
  m.def(
      "crc32c",
      [](const py::buffer& data, uint32_t crc, bool portable) {
        py::buffer_info info = data.request();
        if (!PyBuffer_IsContiguous(info.view(), 'C')) throw py::value_error("crc32c needs a contiguous buffer");
        const auto* p = static_cast<const uint8_t*>(info.ptr);
        size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        GilRelease release;
        return portable ? crc32c_portable(p, n, crc) : crc32c(p, n, crc);
      },
      py::arg("data"), py::arg("crc") = 0, py::arg("portable") = false,
      "CRC-32C of a contiguous buffer (continue with crc=previous result)");
  m.def(
      "page_crc32c",
      [](uintptr_t address, uint64_t length, uint64_t offset, uint64_t page_bytes, PageArray pages) {
        py::array_t<uint32_t> out(pages.size());
        const int64_t* ids = pages.data();
        uint32_t* dst = out.mutable_data();
        size_t count = static_cast<size_t>(pages.size());
        {
          // Pages are read in place (the KV cache): no copy, other threads run meanwhile.
          GilRelease release;
          page_crc32c(reinterpret_cast<const uint8_t*>(address), length, offset, page_bytes, ids, count, dst);
        }
        return out;
      },
      py::arg("address"), py::arg("length"), py::arg("offset"), py::arg("page_bytes"), py::arg("pages"),
      "CRC-32C of pages [offset + p * page_bytes, + page_bytes) of the region at (address, length)");
}

}  // namespace kvxfer
