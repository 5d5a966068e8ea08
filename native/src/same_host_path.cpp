#include "same_host_path.hpp"

#include <fcntl.h>
#include <linux/memfd.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>

#include "write_bounds.hpp"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // same number on every architecture since Linux 5.3
#endif

namespace kvxfer {
namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Reads `len` bytes at `remote_addr` of process `pid`; false on any error (errno set).
bool read_remote(pid_t pid, uint64_t remote_addr, void* out, size_t len) {
  struct iovec l = {out, len};
  struct iovec r = {reinterpret_cast<void*>(remote_addr), len};
  return process_vm_readv(pid, &l, 1, &r, 1, 0) == static_cast<ssize_t>(len);
}

// Whether a table entry the owner published is exactly this region (a slot is shared by
// region ids equal modulo kSlots, and a withdrawn one reads as id 0).
bool names_region(const RegionTable::EntryImage& e, uint64_t region_id, uint64_t addr, uint64_t length) {
  return e.region_id == region_id && e.addr == addr && e.length == length;
}

bool header_names(pid_t pid, uint64_t table_addr, uint64_t engine_id, RegionTable::Header* out = nullptr) {
  RegionTable::Header local;
  RegionTable::Header& h = out ? *out : local;
  return read_remote(pid, table_addr, &h, sizeof h) && h.magic == RegionTable::kMagic &&
         h.engine_id == engine_id && h.slots == RegionTable::kSlots;
}

// Maps the owner's region table read-only (it is in the owner's memfd `table_fd`), or null
// when that fails or the file is not the table of `engine_id` (a reused fd number).
const char* map_table(pid_t pid, int table_fd, uint64_t engine_id) {
  if (table_fd < 0) return nullptr;
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(table_fd);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  // A corrupt table_fd may name any file of the owner's: one shorter than a table would
  // fault (SIGBUS) on the reads below, so it is not mapped.
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < RegionTable::kBytes) {
    ::close(fd);
    return nullptr;
  }
  void* mem = mmap(nullptr, RegionTable::kBytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mem == MAP_FAILED) return nullptr;
  const auto* h = static_cast<const RegionTable::Header*>(mem);
  if (h->magic != RegionTable::kMagic || h->engine_id != engine_id || h->slots != RegionTable::kSlots) {
    munmap(mem, RegionTable::kBytes);
    return nullptr;
  }
  return static_cast<const char*>(mem);
}

}  // namespace

SameHostIdentity local_same_host_identity(uint64_t table_addr, int table_fd) {
  SameHostIdentity id;
  std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  char ns[128];
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (boot.empty() || n <= 0) return id;  // no /proc: offer nothing
  id.host_key = boot + "/" + std::string(ns, static_cast<size_t>(n));
  if (id.host_key.size() > 255) id.host_key.resize(255);
  id.pid = static_cast<uint32_t>(getpid());
  id.table_addr = table_addr;
  id.table_fd = table_fd;
  return id;
}

// -- RegionTable --------------------------------------------------------------------------

RegionTable::RegionTable(uint64_t engine_id) {
  fd_ = static_cast<int>(syscall(SYS_memfd_create, "kvxfer-region-table", MFD_CLOEXEC));
  void* mem = MAP_FAILED;
  if (fd_ >= 0 && ftruncate(fd_, kBytes) == 0)
    mem = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (mem == MAP_FAILED) {
    // No memfd: peers read the table with process_vm_readv instead of mapping it.
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    mem = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) throw EngineError("cannot allocate the region table");
  }
  layout_ = new (mem) Layout();  // zeroed pages; the constructor only sets the header
  layout_->header = {kMagic, engine_id, kSlots, -1, -1};
}

void RegionTable::offer_imm_ring(const ImmRingBoard& board) {
  layout_->header.imm_ring_fd = board.memfd();
  layout_->header.imm_event_fd = board.event_fd();
}

RegionTable::~RegionTable() {
  layout_->~Layout();
  munmap(layout_, kBytes);
  if (fd_ >= 0) ::close(fd_);
}

void RegionTable::publish(const MemoryRegion& region) {
  Entry& e = layout_->entries[region.id % kSlots];
  if (e.region_id.load(std::memory_order_relaxed) != 0) return;  // taken: fabric only
  e.addr.store(region.addr, std::memory_order_relaxed);
  e.length.store(region.length, std::memory_order_relaxed);
  e.share_fd_plus1.store(static_cast<uint64_t>(region.share_fd + 1), std::memory_order_relaxed);
  e.share_offset.store(region.share_offset, std::memory_order_relaxed);
  e.share_dev.store(region.share_dev, std::memory_order_relaxed);
  e.share_ino.store(region.share_ino, std::memory_order_relaxed);
  e.region_id.store(region.id, std::memory_order_release);
}

void RegionTable::withdraw(const MemoryRegion& region) {
  Entry& e = layout_->entries[region.id % kSlots];
  if (e.region_id.load(std::memory_order_relaxed) == region.id)
    e.region_id.store(0, std::memory_order_seq_cst);
}

// -- SameHostPeer -------------------------------------------------------------------------

std::shared_ptr<SameHostPeer> SameHostPeer::open(const EngineAddress& peer, const SameHostIdentity& self,
                                                 uint64_t self_engine_id, bool imm_ring) {
  const auto& id = peer.same_host;
  if (self.host_key.empty() || id.host_key != self.host_key || id.pid == 0 || id.table_addr == 0)
    return nullptr;
  const pid_t pid = static_cast<pid_t>(id.pid);
  // Reading the owner's table proves both permission and identity: only the engine the
  // address names has its id at that address of that pid.
  if (!header_names(pid, id.table_addr, peer.engine_id)) return nullptr;
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return nullptr;  // kernel without pidfds: cannot rule out pid reuse
  // Read again now that the pidfd pins the process: it names the engine we checked.
  RegionTable::Header header;
  if (!header_names(pid, id.table_addr, peer.engine_id, &header)) {
    close(pidfd);
    return nullptr;
  }
  std::shared_ptr<SameHostPeer> opened(
      new SameHostPeer(pid, pidfd, id.table_addr, map_table(pid, id.table_fd, peer.engine_id)));
  if (imm_ring)
    opened->imm_lane_ = ImmRingLane::open(pidfd, static_cast<int>(header.imm_ring_fd),
                                          static_cast<int>(header.imm_event_fd), peer.engine_id, self_engine_id);
  return opened;
}

SameHostPeer::~SameHostPeer() {
  if (table_map_) munmap(const_cast<char*>(table_map_), RegionTable::kBytes);
  close(pidfd_);
}

bool SameHostPeer::exited() const {
  struct pollfd p = {pidfd_, POLLIN, 0};
  return poll(&p, 1, 0) != 0;  // readable (or an error) once the process is gone
}

std::string SameHostPeer::errno_text(int err, const char* doing) const {
  const std::string who = "peer process " + std::to_string(pid_);
  if (err == ESRCH) return who + " exited";
  if (err == EFAULT) return doing + std::string(" failed: range not mapped in ") + who;
  if (err == EPERM) return who + " no longer allows writes (ptrace rules)";
  return doing + std::string(" into ") + who + " failed: " + std::strerror(err);
}

bool SameHostPeer::read_entry(uint64_t region_id, RegionTable::EntryImage* e) const {
  if (!table_map_)
    return read_remote(pid_, table_addr_ + RegionTable::entry_offset(region_id), e, sizeof *e);
  // The owner writes region_id last on publish and first on withdraw; reading it before
  // and after the other words gives a consistent entry or a mismatch (which fails safe).
  const auto* words = reinterpret_cast<const uint64_t*>(table_map_ + RegionTable::entry_offset(region_id));
  auto* out = reinterpret_cast<uint64_t*>(e);
  constexpr size_t n = sizeof *e / sizeof(uint64_t);
  out[0] = __atomic_load_n(&words[0], __ATOMIC_ACQUIRE);
  for (size_t i = 1; i < n; ++i) out[i] = __atomic_load_n(&words[i], __ATOMIC_RELAXED);
  if (__atomic_load_n(&words[0], __ATOMIC_ACQUIRE) != out[0]) out[0] = 0;
  return true;
}

std::string SameHostPeer::check_region(uint64_t region_id, uint64_t addr, uint64_t length,
                                       RegionTable::EntryImage* entry) const {
  if (exited()) return "peer process " + std::to_string(pid_) + " exited";
  RegionTable::EntryImage local;
  RegionTable::EntryImage& e = entry ? *entry : local;
  if (!read_entry(region_id, &e)) return errno_text(errno, "reading the region table");
  if (!names_region(e, region_id, addr, length))
    return "region " + std::to_string(region_id) + " is no longer registered by peer process " +
           std::to_string(pid_);
  return "";
}

bool SameHostPeer::lists_region(uint64_t region_id, uint64_t addr, uint64_t length) const {
  RegionTable::EntryImage e;
  return read_entry(region_id, &e) && names_region(e, region_id, addr, length);
}

SharedMapping::~SharedMapping() { munmap(base_, length_); }

SharedMappingPtr SameHostPeer::map_region(const MemoryDescriptor& d,
                                          const RegionTable::EntryImage& e) const {
  // Region id, address and length were confirmed by check_region; the file must match too.
  if (d.share_fd < 0 || e.share_fd_plus1 != static_cast<uint64_t>(d.share_fd) + 1 ||
      e.share_offset != d.share_offset)
    return nullptr;
  const MappingKey key{d.region_id, e.share_dev, e.share_ino, d.share_offset, d.length};
  std::lock_guard<std::mutex> lock(mappings_mutex_);
  if (auto it = mappings_.find(key); it != mappings_.end())
    if (auto live = it->second.lock()) return live;
  const std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(d.share_fd);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st;
  void* base = MAP_FAILED;
  // The descriptor number may have been reused for another file: only the file the owner's
  // table names (device and inode) is mapped. MAP_POPULATE: no page faults on the hot path.
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == e.share_dev &&
      static_cast<uint64_t>(st.st_ino) == e.share_ino &&
      d.share_offset + d.length <= static_cast<uint64_t>(st.st_size))
    base = mmap(nullptr, d.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                static_cast<off_t>(d.share_offset));
  ::close(fd);
  if (base == MAP_FAILED) return nullptr;
  auto mapping = std::make_shared<const SharedMapping>(base, d.length);
  for (auto it = mappings_.begin(); it != mappings_.end();)  // forget regions nobody maps
    it = it->second.expired() ? mappings_.erase(it) : std::next(it);
  mappings_[key] = mapping;
  return mapping;
}

std::string SameHostPeer::copy(const struct iovec* local, const struct iovec* remote,
                               size_t count) const {
  uint64_t want = 0;
  for (size_t i = 0; i < count; ++i) want += local[i].iov_len;
  ssize_t n = process_vm_writev(pid_, local, count, remote, count, 0);
  if (n == static_cast<ssize_t>(want)) return "";
  if (n < 0) return errno_text(errno, "process_vm_writev");
  if (n == 0) return errno_text(EFAULT, "process_vm_writev");
  // Partial: the kernel stopped at a fault. Retry the rest, which copies more or says why.
  std::vector<struct iovec> l(local, local + count), r(remote, remote + count);
  size_t done = static_cast<size_t>(n), k = 0;
  while (k < count && done >= l[k].iov_len) done -= l[k++].iov_len;
  if (k == count) return "";
  for (auto* v : {&l[k], &r[k]}) {
    v->iov_base = static_cast<char*>(v->iov_base) + done;
    v->iov_len -= done;
  }
  return copy(l.data() + k, r.data() + k, count - k);
}

// -- SameHostCopy -------------------------------------------------------------------------

std::string SameHostCopy::run_slice(uint64_t* copied) {
  *copied = 0;
  std::string why = peer->check_region(region_id, region_addr, region_length);
  if (!why.empty()) return why;
  size_t end = next;
  uint64_t slice = 0;
  while (end < local.size() && end - next < kSlicePieces &&
         (slice == 0 || slice + local[end].iov_len <= kSliceBytes))
    slice += local[end++].iov_len;
  if (mapping) {
    // Remote addresses are the owner's; the same bytes sit at the same offset of our mapping.
    for (size_t i = next; i < end; ++i)
      std::memcpy(mapping->base() + (reinterpret_cast<uint64_t>(remote[i].iov_base) - region_addr),
                  local[i].iov_base, local[i].iov_len);
  } else {
    why = peer->copy(local.data() + next, remote.data() + next, end - next);
    if (!why.empty()) return why;
  }
  next = end;
  *copied = slice;
  return "";
}

namespace {

std::unique_ptr<SameHostCopy> new_copy(SameHostPeerPtr peer, SharedMappingPtr mapping,
                                       const MemoryDescriptor& remote) {
  auto copy = std::make_unique<SameHostCopy>();
  copy->peer = std::move(peer);
  copy->mapping = std::move(mapping);
  copy->region_id = remote.region_id;
  copy->region_addr = remote.addr;
  copy->region_length = remote.length;
  return copy;
}

// Appends [src, dst) x len, cut into pieces of at most kSliceBytes.
void add_piece(SameHostCopy& copy, uint64_t src, uint64_t dst, uint64_t len) {
  for (uint64_t off = 0; off < len; off += SameHostCopy::kSliceBytes) {
    uint64_t n = std::min<uint64_t>(SameHostCopy::kSliceBytes, len - off);
    copy.local.push_back({reinterpret_cast<void*>(src + off), n});
    copy.remote.push_back({reinterpret_cast<void*>(dst + off), n});
  }
  copy.bytes += len;
}

}  // namespace

namespace {

std::unique_ptr<SameHostCopy> plan_single(SameHostPeerPtr peer, SharedMappingPtr mapping,
                                          const MemoryRegion& local, const MemoryDescriptor& remote,
                                          const SingleWrite& write) {
  const uint64_t src_offset = write.src_offset, dst_offset = write.dst_offset, length = write.length;
  check_write_bounds(src_offset, local.length, dst_offset, remote.length, length);
  auto copy = new_copy(std::move(peer), std::move(mapping), remote);
  add_piece(*copy, local.addr + src_offset, remote.addr + dst_offset, length);
  return copy;
}

std::unique_ptr<SameHostCopy> plan_paged(SameHostPeerPtr peer, SharedMappingPtr mapping,
                                         const MemoryRegion& local, const MemoryDescriptor& remote,
                                         const PagedWrite& write) {
  check_paged_bounds(write, local.length, remote.length);
  const int64_t* src_pages = write.src_pages.data;
  const int64_t* dst_pages = write.dst_pages.data;
  const size_t count = write.count();
  const uint64_t page_size = write.page_size, src_stride = write.src_stride, dst_stride = write.dst_stride;
  const uint64_t src_offset = write.src_offset, dst_offset = write.dst_offset;
  auto copy = new_copy(std::move(peer), std::move(mapping), remote);
  copy->local.reserve(count);
  copy->remote.reserve(count);
  // Runs of pages adjacent on both sides are merged first, then cut at kSliceBytes.
  uint64_t run_src = 0, run_dst = 0, run_len = 0;
  for (size_t i = 0; i < count; ++i) {
    uint64_t src = local.addr + src_offset + static_cast<uint64_t>(src_pages[i]) * src_stride;
    uint64_t dst = remote.addr + dst_offset + static_cast<uint64_t>(dst_pages[i]) * dst_stride;
    if (run_len && run_src + run_len == src && run_dst + run_len == dst) {
      run_len += page_size;
      continue;
    }
    if (run_len) add_piece(*copy, run_src, run_dst, run_len);
    run_src = src;
    run_dst = dst;
    run_len = page_size;
  }
  add_piece(*copy, run_src, run_dst, run_len);
  return copy;
}

}  // namespace

std::unique_ptr<SameHostCopy> plan_same_host(SameHostPeerPtr peer, SharedMappingPtr mapping,
                                             const MemoryRegion& local, const MemoryDescriptor& remote,
                                             const TransferRequest& request) {
  if (const auto* w = std::get_if<SingleWrite>(&request.shape))
    return plan_single(std::move(peer), std::move(mapping), local, remote, *w);
  if (const auto* p = std::get_if<PagedWrite>(&request.shape))
    return plan_paged(std::move(peer), std::move(mapping), local, remote, *p);
  return nullptr;
}

}  // namespace kvxfer
