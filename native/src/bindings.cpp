// pybind11 binding of the engine as kvxfer._native. Every call that may block or plan a
// large transfer releases the GIL. Buffers arrive as (address, length): the extension
// never sees torch or numpy types beyond plain int64 page arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "futex_wait.hpp"
#include "gil_release.hpp"
#include "page_locks.hpp"
#include "same_host_writer_exit.hpp"
#include "transfer_engine.hpp"

namespace kvxfer {
void bind_page_checksum(pybind11::module_& m);  // page_checksum_binding.cpp
}

namespace py = pybind11;
using namespace kvxfer;

namespace {

int64_t deadline_after(double timeout_s) {
  if (timeout_s < 0) throw BoundsError("timeout must be >= 0");
  // Cap at a day so a huge timeout cannot overflow the clock arithmetic.
  double capped = std::min(timeout_s, 86400.0);
  return monotonic_ns() + static_cast<int64_t>(capped * 1e9);
}

std::optional<uint32_t> to_imm(const std::optional<int64_t>& imm) {
  if (!imm) return std::nullopt;
  if (*imm < 0 || *imm > 0xffffffffLL) throw BoundsError("imm must fit in 32 bits: " + std::to_string(*imm));
  return static_cast<uint32_t>(*imm);
}

uint64_t non_negative(int64_t v, const char* what) {
  if (v < 0) throw BoundsError(std::string(what) + " must be >= 0, got " + std::to_string(v));
  return static_cast<uint64_t>(v);
}

using PageArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A transfer handle as Python sees it: the shared state plus the engine that completes it.
struct PyTransfer {
  TransferStatePtr state;
  ProgressWorker* worker;
  std::shared_ptr<TransferEngine> engine;  // keeps the worker alive while Python holds this
};

// A completion counter as Python sees it: the counter plus the engine whose worker makes
// progress when the caller drives it.
struct PyCounter {
  std::shared_ptr<CompletionCounter> counter;
  std::shared_ptr<TransferEngine> engine;
};

// Page lists of a paged write, checked as one-dimensional and of equal lengths.
PagedWrite paged_write(const PageArray& src_pages, const PageArray& dst_pages, int64_t page_size,
                       int64_t src_stride, int64_t dst_stride, int64_t src_offset, int64_t dst_offset) {
  if (src_pages.ndim() != 1 || dst_pages.ndim() != 1) throw BoundsError("page lists must be one-dimensional");
  if (src_pages.size() != dst_pages.size())
    throw BoundsError("src_pages has " + std::to_string(src_pages.size()) + " entries but dst_pages has " +
                      std::to_string(dst_pages.size()));
  size_t n = static_cast<size_t>(src_pages.size());
  return PagedWrite{{src_pages.data(), n},
                    {dst_pages.data(), n},
                    non_negative(page_size, "page_size"),
                    non_negative(src_stride, "src_stride"),
                    non_negative(dst_stride, "dst_stride"),
                    non_negative(src_offset, "src_offset"),
                    non_negative(dst_offset, "dst_offset")};
}

py::dict stats_dict(const RailStats& s) {
  py::dict d;
  d["bytes_posted"] = s.bytes_posted.load();
  d["bytes_completed"] = s.bytes_completed.load();
  d["ops_posted"] = s.ops_posted.load();
  d["ops_completed"] = s.ops_completed.load();
  d["completion_errors"] = s.completion_errors.load();
  d["imm_received"] = s.imm_received.load();
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvxfer native WriteImm engine over libfabric";
  // Immediates a same-host peer's ring lane holds unread (tests size their bursts by it).
  m.attr("IMM_RING_LANE_ENTRIES") = ImmRingBoard::kLaneEntries;

  py::module_ errors = py::module_::import("kvxfer.errors");
  py::object py_engine_error = errors.attr("EngineError");
  py::object py_descriptor_error = errors.attr("DescriptorError");
  py::object py_bounds_error = errors.attr("BoundsError");
  py::object py_imm_overflow = errors.attr("ImmCounterOverflow");
  // Translators hold references for the interpreter's lifetime.
  static py::object keep[4];
  keep[0] = py_engine_error;
  keep[1] = py_descriptor_error;
  keep[2] = py_bounds_error;
  keep[3] = py_imm_overflow;
  py::register_exception_translator([](std::exception_ptr p) {
    // Messages may quote bytes a peer sent: decoded with backslashreplace, since
    // PyErr_SetString would raise UnicodeDecodeError instead of our error on bad UTF-8.
    auto raise = [](PyObject* type, const std::exception& e) {
      const char* what = e.what();
      PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
      if (!msg) return;  // MemoryError is set
      PyErr_SetObject(type, msg);
      Py_DECREF(msg);
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const DescriptorError& e) {
      raise(keep[1].ptr(), e);
    } catch (const BoundsError& e) {
      raise(keep[2].ptr(), e);
    } catch (const ImmCounterOverflow& e) {
      raise(keep[3].ptr(), e);
    } catch (const EngineError& e) {
      raise(keep[0].ptr(), e);
    }
  });

  bind_page_checksum(m);
  m.def("available_providers", &available_providers, "libfabric providers with RDM+RMA here");
  m.def("resolve_provider", &resolve_provider, py::arg("requested"));

  py::class_<MemoryRegion, MemoryRegionPtr>(m, "MemoryRegion")
      .def_readonly("id", &MemoryRegion::id)
      .def_readonly("addr", &MemoryRegion::addr)
      .def_readonly("length", &MemoryRegion::length);

  py::class_<MemoryWindows, MemoryWindowsPtr>(m, "MemoryWindows")
      .def_readonly("id", &MemoryWindows::id)
      .def_property_readonly("closed", [](const MemoryWindows& w) { return w.closed; })
      .def_property_readonly("ranges", [](const MemoryWindows& w) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (const auto& x : w.windows) out.emplace_back(x.offset, x.length);
        return out;
      });

  py::class_<RemoteRegion, RemoteRegionPtr>(m, "RemoteRegion")
      .def_property_readonly("length", [](const RemoteRegion& r) { return r.descriptor.length; })
      .def_property_readonly("engine_id", [](const RemoteRegion& r) { return r.owner->engine_id; })
      .def_property_readonly("same_host", [](const RemoteRegion& r) { return static_cast<bool>(r.same_host); })
      .def_property_readonly("mapped", [](const RemoteRegion& r) { return static_cast<bool>(r.mapping); })
      .def_property_readonly("owner_exited", [](const RemoteRegion& r) {
        return r.same_host && r.same_host->exited();  // only known for same-host owners
      })
      .def_property_readonly("region_id", [](const RemoteRegion& r) { return r.descriptor.region_id; })
      .def_property_readonly("same_host_region_withdrawn", [](const RemoteRegion& r) {
        // The owner no longer lists the region (deregistered); a cached descriptor of it
        // would keep its memory mapped here. Not asked of owners reached over the fabric.
        const auto& d = r.descriptor;
        return r.same_host && !r.same_host->lists_region(d.region_id, d.addr, d.length);
      })
      .def_property_readonly("owner_address", [](const RemoteRegion& r) { return py::bytes(r.owner->serialize()); });

  py::class_<EngineAddress, std::shared_ptr<EngineAddress>>(m, "PeerAddress")
      .def_property_readonly("engine_id", [](const EngineAddress& a) { return a.engine_id; })
      .def_property_readonly("provider", [](const EngineAddress& a) { return a.provider; })
      .def_property_readonly("rails", [](const EngineAddress& a) { return a.rail_addresses.size(); });

  py::class_<SameHostWriter>(m, "SameHostWriter")
      .def_property_readonly("pid", &SameHostWriter::pid)
      .def("still_writing", [](const SameHostWriter& w) {
        GilRelease release;  // a /proc walk of the writer's threads
        return w.still_writing();
      });

  py::class_<PyTransfer>(m, "Transfer")
      .def_property_readonly("id", [](const PyTransfer& t) { return t.state->id; })
      .def_property_readonly("status", [](const PyTransfer& t) { return t.state->status.load(); })
      .def_property_readonly("bytes", [](const PyTransfer& t) { return t.state->bytes; })
      .def_property_readonly("error", [](const PyTransfer& t) -> std::string {
        return t.state->status.load() == 0 ? std::string() : t.state->error;
      })
      .def_property_readonly("submitted_ns", [](const PyTransfer& t) { return t.state->submitted_ns; })
      .def_property_readonly("completed_ns", [](const PyTransfer& t) { return t.state->completed_ns.load(); })
      .def("done", [](const PyTransfer& t) { return t.state->status.load() != 0; })
      .def("wait", [](PyTransfer& t, double timeout_s) {
            // Small same-host writes finish inside write(): no GIL round trip for them.
            if (t.state->status.load(std::memory_order_acquire) != 0) return true;
            int64_t deadline = deadline_after(timeout_s);
            GilRelease release;
            return t.worker->wait_transfer(*t.state, deadline);  // the worker outlives close()
          }, py::arg("timeout_s"))
      .def("request_notify", [](PyTransfer& t) {
            // Returns True if already finished (no event will be needed).
            t.state->notify_requested.store(1, std::memory_order_seq_cst);
            return t.state->status.load(std::memory_order_seq_cst) != 0;
          });

  py::class_<PyCounter>(m, "CompletionCounter")
      .def_property_readonly("submitted", [](const PyCounter& c) { return c.counter->submitted(); })
      .def_property_readonly("finished", [](const PyCounter& c) { return c.counter->finished(); })
      .def_property_readonly("failed", [](const PyCounter& c) { return c.counter->failed(); })
      .def_property_readonly("first_error", [](const PyCounter& c) { return c.counter->first_error(); })
      .def("wait", [](PyCounter& c, uint64_t at_least, double timeout_s) {
            if (c.counter->finished() >= at_least) return true;
            int64_t deadline = deadline_after(timeout_s);
            GilRelease release;
            return c.engine->worker().wait_counter(*c.counter, at_least, deadline);
          }, py::arg("at_least"), py::arg("timeout_s"));

  py::class_<TransferEngine, std::shared_ptr<TransferEngine>>(m, "Engine")
      .def(py::init([](const std::string& provider, size_t rails, const std::string& bind_host,
                       double transfer_timeout_s, size_t max_inflight_per_rail, double idle_spin_us,
                       uint64_t shard_min_bytes, bool delivery_complete, bool same_host,
                       bool caller_drives_progress, size_t imm_table_capacity,
                       size_t inbox_max_messages, uint64_t inbox_max_bytes,
                       bool populate_on_register, bool lock_on_register, bool huge_pages_on_register,
                       bool same_host_imm_ring, const std::string& tcp_congestion, bool cork_sends,
                       bool count_claimed_imms_only) {
             EngineSettings s;
             s.provider = provider;
             s.rails = rails;
             s.bind_host = bind_host;
             s.worker.transfer_timeout_ns = static_cast<int64_t>(transfer_timeout_s * 1e9);
             s.worker.max_inflight_per_rail = max_inflight_per_rail;
             s.worker.idle_spin_ns = static_cast<int64_t>(idle_spin_us * 1e3);
             s.planner.shard_min_bytes = shard_min_bytes;
             s.planner.delivery_complete = delivery_complete;
             s.same_host = same_host;
             s.worker.caller_drives_progress = caller_drives_progress;
             s.worker.imm_table_capacity = imm_table_capacity;
             s.worker.inbox_max_messages = inbox_max_messages;
             s.worker.inbox_max_bytes = inbox_max_bytes;
             s.populate_on_register = populate_on_register;
             s.lock_on_register = lock_on_register;
             s.huge_pages_on_register = huge_pages_on_register;
             s.same_host_imm_ring = same_host_imm_ring;
             s.worker.tcp_congestion = tcp_congestion;
             s.worker.cork_sends = cork_sends;
             s.worker.count_claimed_imms_only = count_claimed_imms_only;
             GilRelease release;
             return std::make_shared<TransferEngine>(s);
           }),
           py::arg("provider"), py::arg("rails"), py::arg("bind_host"), py::arg("transfer_timeout_s"),
           py::arg("max_inflight_per_rail"), py::arg("idle_spin_us"), py::arg("shard_min_bytes"),
           py::arg("delivery_complete") = true, py::arg("same_host") = true,
           py::arg("caller_drives_progress") = false, py::arg("imm_table_capacity") = 1 << 16,
           py::arg("inbox_max_messages") = 1024, py::arg("inbox_max_bytes") = 16ull << 20,
           py::arg("populate_on_register") = true, py::arg("lock_on_register") = true,
           py::arg("huge_pages_on_register") = true, py::arg("same_host_imm_ring") = true,
           py::arg("tcp_congestion") = "cubic,reno", py::arg("cork_sends") = true,
           py::arg("count_claimed_imms_only") = false)
      .def_property_readonly("address", [](const TransferEngine& e) { return py::bytes(e.address()); })
      .def_property_readonly("provider", &TransferEngine::provider)
      .def_property_readonly("rails", &TransferEngine::rails)
      .def_property_readonly("engine_id", &TransferEngine::engine_id)
      .def_property_readonly("capabilities", [](const TransferEngine& e) {
        const auto& c = e.caps();
        py::dict d;
        d["provider"] = c.provider;
        d["fabric"] = c.fabric_name;
        d["domain"] = c.domain_name;
        d["mr_virt_addr"] = c.virt_addr;
        d["mr_prov_key"] = c.prov_key;
        d["mr_local"] = c.mr_local;
        d["mr_endpoint"] = c.mr_endpoint;
        d["rx_cq_data"] = c.rx_cq_data;
        d["cq_data_size"] = c.cq_data_size;
        d["iov_limit"] = c.iov_limit;
        d["tx_size"] = c.tx_size;
        d["rx_size"] = c.rx_size;
        d["wait_fd"] = c.has_wait_fd;
        d["sleeps_on"] = c.sleeps_on;
        d["source"] = c.source;
        return d;
      })
      .def("register", [](TransferEngine& e, uintptr_t addr, uint64_t length, int share_fd,
                          uint64_t share_offset) {
            GilRelease release;
            return e.register_memory(addr, length, share_fd, share_offset);
          }, py::arg("addr"), py::arg("length"), py::arg("share_fd") = -1, py::arg("share_offset") = 0)
      .def("deregister", [](TransferEngine& e, const MemoryRegionPtr& r) {
            GilRelease release;
            e.deregister(r);
          })
      .def("descriptor", [](const TransferEngine& e, const MemoryRegion& r) { return py::bytes(e.descriptor(r)); })
      .def("register_windows", [](TransferEngine& e, const MemoryRegionPtr& parent,
                                  std::vector<std::pair<uint64_t, uint64_t>> ranges) {
            GilRelease release;
            return e.register_windows(parent, std::move(ranges));
          })
      .def("close_windows", [](TransferEngine& e, const MemoryWindowsPtr& w) {
            GilRelease release;
            e.close_windows(w);
          })
      .def("windows_descriptor", [](const TransferEngine& e, const MemoryWindows& w) { return py::bytes(e.descriptor(w)); })
      .def("parse_remote", [](const TransferEngine& e, const py::bytes& b) { return e.parse_remote(b); })
      .def("parse_peer", [](const TransferEngine& e, const py::bytes& b) { return std::const_pointer_cast<EngineAddress>(e.parse_peer(b)); })
      .def("write", [](std::shared_ptr<TransferEngine> e, const MemoryRegionPtr& mr, int64_t src_offset,
                       const RemoteRegionPtr& remote, int64_t dst_offset, int64_t length,
                       std::optional<int64_t> imm) {
            auto i = to_imm(imm);
            uint64_t so = non_negative(src_offset, "src_offset"), dof = non_negative(dst_offset, "dst_offset"),
                     len = non_negative(length, "length");
            TransferStatePtr t;
            {
              GilRelease release;
              t = e->submit(mr, remote, {SingleWrite{so, dof, len}, i});
            }
            return PyTransfer{t, &e->worker(), e};
          })
      .def("write_paged", [](std::shared_ptr<TransferEngine> e, const MemoryRegionPtr& mr, PageArray src_pages,
                             const RemoteRegionPtr& remote, PageArray dst_pages, int64_t page_size,
                             int64_t src_stride, int64_t dst_stride, int64_t src_offset, int64_t dst_offset,
                             std::optional<int64_t> imm) {
            auto i = to_imm(imm);
            PagedWrite w = paged_write(src_pages, dst_pages, page_size, src_stride, dst_stride, src_offset, dst_offset);
            TransferStatePtr t;
            {
              // The arrays stay referenced by this frame, so planning reads them in place.
              GilRelease release;
              t = e->submit(mr, remote, {w, i});
            }
            return PyTransfer{t, &e->worker(), e};
          })
      .def("completion_counter", [](std::shared_ptr<TransferEngine> e) {
            return PyCounter{std::make_shared<CompletionCounter>(), e};
          })
      .def("write_many", [](std::shared_ptr<TransferEngine> e, const MemoryRegionPtr& mr, PageArray src_offsets,
                            const RemoteRegionPtr& remote, PageArray dst_offsets, PageArray lengths,
                            std::optional<int64_t> imm, PyCounter& counter) {
            // Offsets and lengths are read in place (the arrays stay referenced by this frame);
            // a single length applies to every write.
            if (src_offsets.ndim() != 1 || dst_offsets.ndim() != 1 || lengths.ndim() != 1)
              throw BoundsError("offsets and lengths must be one-dimensional");
            size_t n = static_cast<size_t>(src_offsets.size());
            if (static_cast<size_t>(dst_offsets.size()) != n)
              throw BoundsError("src_offsets has " + std::to_string(n) + " entries but dst_offsets has " +
                                std::to_string(dst_offsets.size()));
            if (lengths.size() != 1 && static_cast<size_t>(lengths.size()) != n)
              throw BoundsError("lengths must have 1 or " + std::to_string(n) + " entries");
            auto i = to_imm(imm);
            if (counter.engine != e) throw EngineError("the completion counter belongs to another engine");
            const int64_t *so = src_offsets.data(), *dof = dst_offsets.data(), *len = lengths.data();
            const bool one_length = lengths.size() == 1;
            GilRelease release;
            std::vector<TransferRequest> requests;
            requests.reserve(n);
            for (size_t k = 0; k < n; ++k)
              requests.push_back({SingleWrite{non_negative(so[k], "src_offset"), non_negative(dof[k], "dst_offset"),
                                              non_negative(len[one_length ? 0 : k], "length")},
                                  i});
            e->submit_many(mr, remote, requests, counter.counter);
            return n;
          }, py::arg("mr"), py::arg("src_offsets"), py::arg("remote"), py::arg("dst_offsets"), py::arg("lengths"),
          py::arg("imm"), py::arg("counter"))
      .def("write_paged_many", [](std::shared_ptr<TransferEngine> e, const MemoryRegionPtr& mr,
                                  const py::list& src_lists, const RemoteRegionPtr& remote, const py::list& dst_lists,
                                  int64_t page_size, int64_t src_stride, int64_t dst_stride, int64_t src_offset,
                                  int64_t dst_offset, std::optional<int64_t> imm, PyCounter& counter) {
            if (src_lists.size() != dst_lists.size())
              throw BoundsError(std::to_string(src_lists.size()) + " source page lists but " +
                                std::to_string(dst_lists.size()) + " destination page lists");
            auto i = to_imm(imm);
            if (counter.engine != e) throw EngineError("the completion counter belongs to another engine");
            size_t n = src_lists.size();
            // Held here so the page arrays stay alive (and unmoved) while planning reads them.
            std::vector<PageArray> keep;
            keep.reserve(2 * n);
            std::vector<TransferRequest> requests;
            requests.reserve(n);
            for (size_t k = 0; k < n; ++k) {
              keep.push_back(src_lists[k].cast<PageArray>());
              keep.push_back(dst_lists[k].cast<PageArray>());
              requests.push_back({paged_write(keep[2 * k], keep[2 * k + 1], page_size, src_stride, dst_stride,
                                              src_offset, dst_offset),
                                  i});
            }
            GilRelease release;
            e->submit_many(mr, remote, requests, counter.counter);
            return n;
          }, py::arg("mr"), py::arg("src_lists"), py::arg("remote"), py::arg("dst_lists"), py::arg("page_size"),
          py::arg("src_stride"), py::arg("dst_stride"), py::arg("src_offset"), py::arg("dst_offset"),
          py::arg("imm"), py::arg("counter"))
      .def("write_imm", [](std::shared_ptr<TransferEngine> e, std::shared_ptr<EngineAddress> peer, int64_t imm) {
            auto i = to_imm(imm);
            GilRelease release;
            return PyTransfer{e->write_imm(peer, *i), &e->worker(), e};
          })
      .def("send", [](std::shared_ptr<TransferEngine> e, std::shared_ptr<EngineAddress> peer, const py::bytes& payload) {
            std::string p = payload;
            GilRelease release;
            return PyTransfer{e->send(peer, std::move(p)), &e->worker(), e};
          })
      .def("recv", [](TransferEngine& e, double timeout_s) -> py::object {
            int64_t deadline = deadline_after(timeout_s);
            std::optional<std::string> msg;
            {
              GilRelease release;
              msg = e.worker().recv(deadline);
            }
            if (!msg) return py::none();
            return py::bytes(*msg);
          }, py::arg("timeout_s"))
      .def("imm_count", [](TransferEngine& e, int64_t imm) { return e.worker().imm_counters().get(*to_imm(imm)); })
      .def("consume_imm", [](TransferEngine& e, int64_t imm, uint64_t units) { e.worker().consume_imm(*to_imm(imm), units); })
      .def("reset_imm", [](TransferEngine& e, int64_t imm) { e.worker().reset_imm(*to_imm(imm)); })
      .def("wait_imm", [](TransferEngine& e, int64_t imm, uint64_t count, double timeout_s) {
            auto i = to_imm(imm);
            int64_t deadline = deadline_after(timeout_s);
            GilRelease release;
            return e.worker().wait_imm(*i, count, deadline);
          })
      .def("wait_imm_any", [](TransferEngine& e, const std::vector<std::pair<int64_t, uint64_t>>& wanted,
                              double timeout_s, const std::vector<int>& watched_fds) {
            std::vector<std::pair<uint32_t, uint64_t>> pairs;
            pairs.reserve(wanted.size());
            for (const auto& [imm, count] : wanted) pairs.emplace_back(*to_imm(imm), count);
            int64_t deadline = deadline_after(timeout_s);
            GilRelease release;
            return e.worker().wait_imm_any(pairs, deadline, watched_fds);
          }, py::arg("wanted"), py::arg("timeout_s"), py::arg("watched_fds") = std::vector<int>{})
      .def("expect_imm", [](TransferEngine& e, int64_t imm, uint64_t count, uint64_t token) {
            auto i = to_imm(imm);
            GilRelease release;
            e.worker().expect_imm(*i, count, token);
          })
      .def_property_readonly("event_fd", [](TransferEngine& e) { return e.worker().event_fd(); })
      .def("take_events", [](TransferEngine& e) {
            auto events = e.worker().take_events();
            py::list out;
            for (const auto& ev : events)
              out.append(py::make_tuple(static_cast<uint32_t>(ev.kind), ev.token, ev.status));
            return out;
          })
      .def("bind_imm_source", [](TransferEngine& e, uint32_t imm, std::shared_ptr<EngineAddress> peer) {
            GilRelease release;
            return e.bind_imm_source(imm, peer);
          })
      .def("unbind_imm_source", [](TransferEngine& e, uint32_t imm) {
            GilRelease release;
            e.unbind_imm_source(imm);
          })
      .def("claim_imm", [](TransferEngine& e, int64_t imm) {
            auto i = to_imm(imm);
            GilRelease release;
            e.claim_imm(*i);
          })
      .def("release_imm", [](TransferEngine& e, int64_t imm) {
            auto i = to_imm(imm);
            GilRelease release;
            e.release_imm(*i);
          })
      .def("connect", [](TransferEngine& e, std::shared_ptr<EngineAddress> peer) {
            GilRelease release;
            e.connect(peer);
          })
      .def("forget", [](TransferEngine& e, std::shared_ptr<EngineAddress> peer) {
            GilRelease release;
            e.forget(*peer);
          })
      .def("sever_peer", [](TransferEngine& e, std::shared_ptr<EngineAddress> peer, bool same_host_writes_ended) {
            std::vector<size_t> per_rail;
            bool proven = false;
            {
              GilRelease release;
              proven = e.sever_peer(*peer, &per_rail, same_host_writes_ended);
            }
            return py::make_tuple(proven, per_rail);
          }, py::arg("peer"), py::arg("same_host_writes_ended") = false)
      .def("open_same_host_writer", [](const TransferEngine& e, std::shared_ptr<EngineAddress> peer) {
            // None where `peer` cannot write here through the same-host path, or cannot be pinned.
            return SameHostWriter::open(*peer, EngineAddress::parse(e.address()).same_host);
          })
      .def("stats", [](TransferEngine& e) {
            py::list out;
            if (e.closed()) return out;
            for (const auto& s : e.worker().stats()) out.append(stats_dict(*s));
            return out;
          })
      .def("engine_stats", [](TransferEngine& e) {
            // Engine-wide counters (no rail). Readable after close: the worker lives on.
            const auto& s = e.worker().engine_stats();
            const auto& imm = e.worker().imm_counters();
            py::dict d;
            d["imm_table_overflows"] = imm.overflowed();
            d["imm_foreign_dropped"] = e.worker().imm_foreign_dropped();
            d["imm_unclaimed_dropped"] = e.worker().imm_unclaimed_dropped();
            d["imm_claimed"] = imm.claimed();
            d["imm_table_capacity"] = imm.capacity();
            d["inbox_dropped_messages"] = s.inbox_dropped_messages.load();
            d["inbox_dropped_bytes"] = s.inbox_dropped_bytes.load();
            d["inbox_messages"] = s.inbox_messages.load();
            d["inbox_bytes"] = s.inbox_bytes.load();
            d["imm_ring_sent"] = s.imm_ring_sent.load();
            d["imm_ring_received"] = s.imm_ring_received.load();
            d["imm_ring_fallbacks"] = s.imm_ring_fallbacks.load();
            d["worker_wakeups"] = s.worker_wakeups.load();
            d["tcp_congestion_set"] = e.worker().tcp_congestion().sockets_set();
            d["tcp_congestion_refused"] = e.worker().tcp_congestion().refused();
            d["corked_sockets"] = e.worker().send_corker().sockets();
            d["lock_refused"] = e.lock_refused();
            // Process-wide (mlock is per process): every engine's locked registrations.
            d["locked_bytes"] = PageLocks::process().locked_bytes();
            return d;
          })
      .def("same_host_stats", [](TransferEngine& e) -> py::object {
            if (e.closed()) return py::none();
            return stats_dict(e.worker().same_host_stats());
          })
      .def("close", [](TransferEngine& e) {
            GilRelease release;
            e.close();
          })
      .def_property_readonly("closed", &TransferEngine::closed);
}
