#include "transfer_engine.hpp"

#include "page_locks.hpp"

#include <algorithm>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "futex_wait.hpp"

namespace kvxfer {
namespace {

// "auto" prefers RDMA-capable NICs, then libfabric's native TCP RDM provider ("net" in
// 1.17; later releases call it "tcp"), then rxm over TCP. shm reaches only this host, so
// it is never picked implicitly.
const char* const kAutoOrder[] = {"efa", "verbs", "net", "tcp", "sockets"};

// Same-host writes up to this size are copied on the submitting thread (see start_copy).
constexpr uint64_t kInlineCopyBytes = 64 * 1024;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

// The 2 MiB-aligned interior of [addr, +length), where transparent huge pages can go.
struct HugeSpan {
  uintptr_t begin = 0, end = 0;
  HugeSpan(uintptr_t addr, uint64_t length) {
    constexpr uintptr_t kHuge = 2ull << 20;
    begin = (addr + kHuge - 1) & ~(kHuge - 1);
    end = (addr + length) & ~(kHuge - 1);
  }
  bool empty() const { return end <= begin; }
  void* start() const { return reinterpret_cast<void*>(begin); }
  size_t bytes() const { return end - begin; }
};

// Makes every page of [addr, +length) resident and writable (see
// EngineSettings::populate_on_register). The touch fallback is an atomic add of zero, so a
// thread writing the buffer meanwhile loses nothing.
void populate_pages(uintptr_t addr, uint64_t length) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = addr & ~(page - 1);
  if (madvise(reinterpret_cast<void*>(begin), addr + length - begin, MADV_POPULATE_WRITE) == 0) return;
  // EINVAL: kernel before 5.14 (or a mapping it refuses); anything else the touches find.
  for (uintptr_t p = addr; p < addr + length; p = (p & ~(page - 1)) + page)
    __atomic_fetch_add(reinterpret_cast<unsigned char*>(p), 0, __ATOMIC_RELAXED);
}

// Gives each 2 MiB span of `huge` one resident page, so MADV_COLLAPSE can turn it into a
// huge page. For memory that has none yet (a fresh buffer), this replaces populating it in
// 4 KiB pages and then copying those into huge ones: a memfd (SharedBuffer, the KV cache)
// gets no huge pages at fault where shmem_enabled is never, yet MADV_COLLAPSE still makes
// them (only "deny" stops it). 256 MiB of fresh SharedBuffer registered in 25-32 ms this
// way, against 297-301 ms populated first (bench_first_touch.py, `register s`). Writes no data: a
// populate-write fault only makes a page present (the fallback adds zero atomically).
void seed_huge_spans(const HugeSpan& huge) {
  constexpr uintptr_t kHuge = 2ull << 20;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (uintptr_t p = huge.begin; p < huge.end; p += kHuge)
    if (madvise(reinterpret_cast<void*>(p), page, MADV_POPULATE_WRITE) != 0)
      __atomic_fetch_add(reinterpret_cast<unsigned char*>(p), 0, __ATOMIC_RELAXED);
}

uint64_t random_engine_id() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(monotonic_ns());
}

}  // namespace

std::string resolve_provider(const std::string& requested) {
  auto present = available_providers();
  auto has = [&](const std::string& p) {
    for (const auto& q : present)
      if (q == p) return true;
    return false;
  };
  if (requested != "auto") {
    if (!has(requested)) {
      std::string list;
      for (const auto& p : present) list += (list.empty() ? "" : ", ") + p;
      throw EngineError("unknown or unavailable libfabric provider '" + requested +
                        "' (available here: " + list + ")");
    }
    return requested;
  }
  for (const char* p : kAutoOrder)
    if (has(p)) return p;
  throw EngineError("no usable libfabric provider found (is libfabric installed?)");
}

TransferEngine::TransferEngine(EngineSettings settings) : settings_(std::move(settings)) {
  provider_ = resolve_provider(settings_.provider);
  rails_ = std::make_unique<RailGroup>(provider_, settings_.bind_host, settings_.rails, settings_.planner);
  address_.engine_id = random_engine_id();
  address_.provider = provider_;
  address_.rail_addresses = rails_->rail_addresses();
  if (settings_.same_host) {
    region_table_ = std::make_unique<RegionTable>(address_.engine_id);
    address_.same_host = local_same_host_identity(region_table_->address(), region_table_->fd());
    if (settings_.same_host_imm_ring) imm_ring_ = ImmRingBoard::create(address_.engine_id);
    if (imm_ring_) region_table_->offer_imm_ring(*imm_ring_);
  }
  address_blob_ = address_.serialize();
  worker_ = std::make_unique<ProgressWorker>(*rails_, settings_.worker, imm_ring_.get());
}

TransferEngine::~TransferEngine() { close(); }

void TransferEngine::close() {
  std::lock_guard<std::mutex> closing(close_mutex_);
  if (closed_.exchange(true, std::memory_order_acq_rel)) return;
  if (imm_ring_) imm_ring_->mark_closed();  // writers turn to the fabric, which fails
  worker_->stop();
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    for (auto& [id, set] : windows_) {
      for (auto& w : set->windows)
        for (size_t r = 0; r < w.rails.size(); ++r) rails_->rail(r).deregister(w.rails[r]);
      set->closed = true;
    }
    windows_.clear();
    for (auto& [id, region] : regions_) {
      for (size_t r = 0; r < region->rails.size(); ++r) rails_->rail(r).deregister(region->rails[r]);
      unlock_pages(*region);  // the buffer may outlive the engine: its pages go back now
    }
    regions_.clear();
  }
  // The worker and rails objects live on until destruction: threads still blocked in
  // wait_imm or recv wake up, see the worker stopped and return without touching freed memory.
}

void TransferEngine::check_open() const {
  if (closed_.load(std::memory_order_acquire)) throw EngineError("engine is closed");
  worker_->check_caller();  // even calls that never reach the worker (inline copies)
}

MemoryRegionPtr TransferEngine::register_memory(uintptr_t addr, uint64_t length, int share_fd,
                                                uint64_t share_offset) {
  check_open();
  if (addr == 0 || length == 0) throw BoundsError("cannot register an empty buffer");
  auto region = std::make_shared<MemoryRegion>();
  region->id = next_region_id_.fetch_add(1);
  region->addr = addr;
  region->length = length;
  if (share_fd >= 0) {
    struct stat st;
    if (fstat(share_fd, &st) != 0) throw EngineError("share_fd " + std::to_string(share_fd) + " is not open");
    if (share_offset > static_cast<uint64_t>(st.st_size) ||
        length > static_cast<uint64_t>(st.st_size) - share_offset)
      throw BoundsError("buffer of " + std::to_string(length) + " bytes at offset " +
                        std::to_string(share_offset) + " does not fit its file of " +
                        std::to_string(st.st_size) + " bytes");
    region->share_fd = share_fd;
    region->share_offset = share_offset;
    region->share_dev = static_cast<uint64_t>(st.st_dev);
    region->share_ino = static_cast<uint64_t>(st.st_ino);
  }
  // Before the provider registers it: on this thread, not the worker's (a 1 GiB buffer
  // takes a fraction of a second to populate).
  if (settings_.populate_on_register) {
    // Huge pages first: the hint makes private memory fault them in whole, and a span
    // with one page seeded is collapsed into one, whether its owner had filled it (a KV
    // cache: its pages are copied) or not (shmem, which the hint alone does not give huge
    // pages here). Then whatever is left (the unaligned ends, refused spans) is populated.
    // All hints: a mapping or kernel that refuses (fragmentation, shmem_enabled deny)
    // keeps small pages.
    const HugeSpan huge(addr, length);
    const bool want_huge = settings_.huge_pages_on_register && !huge.empty();
    if (want_huge) {
      madvise(huge.start(), huge.bytes(), MADV_HUGEPAGE);
      seed_huge_spans(huge);
      madvise(huge.start(), huge.bytes(), MADV_COLLAPSE);
    }
    populate_pages(addr, length);
    if (settings_.lock_on_register) {
      region->locked = PageLocks::process().lock(addr, length);
      if (!region->locked) lock_refused_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // MR calls touch the domain, which belongs to the worker thread.
  worker_->run_on_worker(
      [&] {
        for (size_t r = 0; r < rails_->size(); ++r)
          region->rails.push_back(rails_->rail(r).register_region(reinterpret_cast<void*>(addr), length));
      },
      30'000'000'000LL);
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_[region->id] = region;
  if (region_table_) region_table_->publish(*region);
  return region;
}

void TransferEngine::deregister(const MemoryRegionPtr& region) {
  check_open();
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    if (regions_.erase(region->id) == 0) throw EngineError("memory region is not registered");
    // Withdrawn first: same-host peers check the table before every slice they copy.
    if (region_table_) region_table_->withdraw(*region);
  }
  worker_->run_on_worker(
      [&] {
        for (size_t r = 0; r < region->rails.size(); ++r) rails_->rail(r).deregister(region->rails[r]);
      },
      30'000'000'000LL);
  unlock_pages(*region);
}

void TransferEngine::unlock_pages(MemoryRegion& region) {
  if (!region.locked) return;
  region.locked = false;
  PageLocks::process().unlock(region.addr, region.length);
}

MemoryWindowsPtr TransferEngine::register_windows(const MemoryRegionPtr& parent,
                                                  std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  check_open();
  if (!parent) throw EngineError("register_windows needs a registered region");
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    if (!regions_.count(parent->id)) throw EngineError("memory region is not registered");
  }
  if (ranges.empty()) throw BoundsError("register_windows needs at least one window");
  std::sort(ranges.begin(), ranges.end());
  uint64_t previous_end = 0;
  for (const auto& [offset, length] : ranges) {
    if (length == 0 || offset > parent->length || length > parent->length - offset)
      throw BoundsError("window [" + std::to_string(offset) + ", +" + std::to_string(length) +
                        ") is empty or outside the region of " + std::to_string(parent->length) + " bytes");
    if (offset < previous_end) throw BoundsError("windows overlap at offset " + std::to_string(offset));
    previous_end = offset + length;
  }
  auto set = std::make_shared<MemoryWindows>();
  set->id = next_windows_id_.fetch_add(1);
  set->parent = parent;
  for (const auto& [offset, length] : ranges) set->windows.push_back({offset, length, {}});
  // MR calls touch the domain, which belongs to the worker thread. A failure part-way
  // closes what was registered, so nothing stays writable.
  worker_->run_on_worker(
      [&] {
        try {
          for (auto& w : set->windows)
            for (size_t r = 0; r < rails_->size(); ++r)
              w.rails.push_back(rails_->rail(r).register_region(
                  reinterpret_cast<void*>(parent->addr + w.offset), w.length));
        } catch (...) {
          for (auto& w : set->windows)
            for (size_t r = 0; r < w.rails.size(); ++r) rails_->rail(r).deregister(w.rails[r]);
          throw;
        }
      },
      30'000'000'000LL);
  std::lock_guard<std::mutex> lock(regions_mutex_);
  windows_[set->id] = set;
  return set;
}

void TransferEngine::close_windows(const MemoryWindowsPtr& set) {
  if (!set || closed()) return;
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    if (set->closed) return;
    set->closed = true;
    windows_.erase(set->id);
  }
  worker_->run_on_worker(
      [&] {
        for (auto& w : set->windows)
          for (size_t r = 0; r < w.rails.size(); ++r) rails_->rail(r).deregister(w.rails[r]);
      },
      30'000'000'000LL);
}

std::string TransferEngine::descriptor(const MemoryWindows& set) const {
  MemoryDescriptor d;
  d.owner = address_;
  d.region_id = set.parent->id;
  d.addr = set.parent->addr;
  d.length = set.parent->length;
  d.share_fd = set.parent->share_fd;
  d.share_offset = set.parent->share_offset;
  for (const auto& w : set.windows) {
    RemoteWindow rw{w.offset, w.length, {}};
    for (const auto& r : w.rails) rw.rails.push_back({r.remote_base, r.key});
    d.windows.push_back(std::move(rw));
  }
  return d.serialize();
}

std::string TransferEngine::descriptor(const MemoryRegion& region) const {
  MemoryDescriptor d;
  d.owner = address_;
  d.region_id = region.id;
  d.addr = region.addr;
  d.length = region.length;
  d.share_fd = region.share_fd;
  d.share_offset = region.share_offset;
  for (const auto& r : region.rails) d.rails.push_back({r.remote_base, r.key});
  return d.serialize();
}

void TransferEngine::check_peer(const EngineAddress& peer) const {
  if (peer.provider != provider_)
    throw DescriptorError("peer uses provider '" + peer.provider + "' but this engine uses '" +
                          provider_ + "': they cannot talk");
}

RemoteRegionPtr TransferEngine::parse_remote(const std::string& blob) const {
  auto remote = std::make_shared<RemoteRegion>();
  remote->descriptor = MemoryDescriptor::parse(blob);
  check_peer(remote->descriptor.owner);
  remote->owner = std::make_shared<const EngineAddress>(remote->descriptor.owner);
  if (auto peer = same_host_peer(*remote->owner)) {
    const auto& d = remote->descriptor;
    // Only a region its owner lists takes this path; anything else goes over the fabric,
    // whose provider checks the key.
    RegionTable::EntryImage entry;
    if (peer->check_region(d.region_id, d.addr, d.length, &entry).empty()) {
      remote->same_host = peer;
      remote->mapping = peer->map_region(d, entry);
    }
  }
  return remote;
}

SameHostPeerPtr TransferEngine::same_host_peer(const EngineAddress& owner) const {
  if (!settings_.same_host || address_.same_host.host_key.empty()) return nullptr;
  if (owner.same_host.host_key != address_.same_host.host_key) return nullptr;
  std::lock_guard<std::mutex> lock(same_host_mutex_);
  auto it = same_host_peers_.find(owner.engine_id);
  if (it != same_host_peers_.end()) return it->second;
  // A new peer (rare: once per peer engine) sweeps out peers that were never reachable
  // or have exited, so the cache holds no pidfds and table mappings of the dead: workers
  // come and go for the life of a service.
  for (auto i = same_host_peers_.begin(); i != same_host_peers_.end();)
    i = (i->second && !i->second->exited()) ? std::next(i) : same_host_peers_.erase(i);
  auto peer = SameHostPeer::open(owner, address_.same_host, address_.engine_id, settings_.same_host_imm_ring);
  same_host_peers_.emplace(owner.engine_id, peer);
  return peer;
}

std::shared_ptr<const EngineAddress> TransferEngine::parse_peer(const std::string& blob) const {
  auto peer = std::make_shared<const EngineAddress>(EngineAddress::parse(blob));
  check_peer(*peer);
  return peer;
}

TransferStatePtr TransferEngine::start(std::unique_ptr<WorkBatch> batch) {
  auto transfer = batch->transfer;
  transfer->submitted_ns = monotonic_ns();
  worker_->submit(std::move(batch));
  return transfer;
}

static std::unique_ptr<WorkBatch> new_batch(std::atomic<uint64_t>& ids,
                                            std::shared_ptr<const EngineAddress> peer) {
  auto batch = std::make_unique<WorkBatch>();
  batch->transfer = std::make_shared<TransferState>();
  batch->transfer->id = ids.fetch_add(1);
  batch->peer = std::move(peer);
  return batch;
}

static void check_local(const MemoryRegionPtr& local) {
  if (!local || local->rails.empty()) throw EngineError("local memory region is not registered");
}

TransferStatePtr TransferEngine::submit(const MemoryRegionPtr& local, const RemoteRegionPtr& remote,
                                        const TransferRequest& request) {
  check_open();
  if (request.moves_bytes()) check_local(local);
  auto batch = new_batch(next_transfer_id_, remote->owner);
  // Bytes to a peer on this kernel are copied; their immediate follows (start_copy).
  if (remote->same_host && request.moves_bytes())
    return start_copy(std::move(batch),
                      plan_same_host(remote->same_host, remote->mapping, *local, remote->descriptor, request),
                      request.imm, request.units());
  static const MemoryRegion kNoRegion;  // an immediate-only request reads no local memory
  rails_->plan(*batch, local ? *local : kNoRegion, remote->descriptor, request);
  return start(std::move(batch));
}

void TransferEngine::submit_many(const MemoryRegionPtr& local, const RemoteRegionPtr& remote,
                                 const std::vector<TransferRequest>& requests,
                                 const std::shared_ptr<CompletionCounter>& counter) {
  check_open();
  if (!counter) throw EngineError("submit_many needs a completion counter");
  bool moves_bytes = false;
  for (const auto& r : requests) moves_bytes |= r.moves_bytes();
  if (moves_bytes) check_local(local);
  static const MemoryRegion kNoRegion;
  const MemoryRegion& src = local ? *local : kNoRegion;
  std::vector<std::unique_ptr<WorkBatch>> batches;
  std::vector<std::unique_ptr<SameHostCopy>> copies;  // per request; null: over the rails
  batches.reserve(requests.size());
  copies.resize(requests.size());
  // Plan (and so validate) every request before any is submitted.
  for (size_t i = 0; i < requests.size(); ++i) {
    auto batch = new_batch(next_transfer_id_, remote->owner);
    batch->transfer->counter = counter;
    if (remote->same_host && requests[i].moves_bytes())
      copies[i] = plan_same_host(remote->same_host, remote->mapping, src, remote->descriptor, requests[i]);
    else
      rails_->plan(*batch, src, remote->descriptor, requests[i]);
    batches.push_back(std::move(batch));
  }
  counter->add_submitted(requests.size());
  std::vector<std::unique_ptr<WorkBatch>> to_rails;
  to_rails.reserve(batches.size());
  const int64_t now = monotonic_ns();
  for (size_t i = 0; i < batches.size(); ++i) {
    if (copies[i]) {
      start_copy(std::move(batches[i]), std::move(copies[i]), requests[i].imm, requests[i].units());
    } else {
      batches[i]->transfer->submitted_ns = now;
      to_rails.push_back(std::move(batches[i]));
    }
  }
  worker_->submit_all(to_rails);
}

TransferStatePtr TransferEngine::start_copy(std::unique_ptr<WorkBatch> batch,
                                            std::unique_ptr<SameHostCopy> copy,
                                            std::optional<uint32_t> imm, uint64_t units) {
  // A write counts like its fabric twin: one unit per page, one for a single write.
  if (imm) {
    rails_->plan_imm_only(*batch, *imm, units);
    if (copy->peer->imm_lane()) batch->imm_ring_peer = copy->peer;
  }
  auto transfer = batch->transfer;
  transfer->bytes = copy->bytes;
  if (copy->bytes > kInlineCopyBytes) {
    batch->ops_remaining = batch->ops.size() + 1;
    batch->copy = std::move(copy);
    return start(std::move(batch));
  }
  // Small writes are copied right here: a hand-off to the worker and back costs more than
  // the copy, and a 4 KiB write then takes about one copy plus its checks.
  transfer->submitted_ns = monotonic_ns();
  std::string why = worker_->copy_inline(*copy);
  if (why.empty() && imm) {
    batch->ops_remaining = batch->ops.size();  // only its immediates are left to post
    return start(std::move(batch));
  }
  transfer->finish(why.empty() ? TransferStatus::kDone : TransferStatus::kFailed, why);
  return transfer;
}

TransferStatePtr TransferEngine::write_imm(std::shared_ptr<const EngineAddress> peer, uint32_t imm) {
  check_open();
  auto batch = new_batch(next_transfer_id_, std::move(peer));
  rails_->plan_imm_only(*batch, imm);
  return start(std::move(batch));
}

TransferStatePtr TransferEngine::send(std::shared_ptr<const EngineAddress> peer, std::string payload) {
  check_open();
  if (payload.empty()) throw BoundsError("empty message");
  if (payload.size() > settings_.worker.recv_slot_bytes)
    throw BoundsError("message of " + std::to_string(payload.size()) + " bytes exceeds the " +
                      std::to_string(settings_.worker.recv_slot_bytes) + "-byte limit");
  auto batch = new_batch(next_transfer_id_, std::move(peer));
  batch->payload = std::move(payload);
  RailOp op;
  op.kind = OpKind::kSend;
  op.iov_count = 1;
  op.iov[0].iov_base = batch->payload.data();
  op.iov[0].iov_len = batch->payload.size();
  op.desc[0] = nullptr;
  op.bytes = batch->payload.size();
  op.batch = batch.get();
  batch->ops.push_back(op);
  batch->ops_remaining = 1;
  batch->transfer->bytes = op.bytes;
  return start(std::move(batch));
}

void TransferEngine::connect(std::shared_ptr<const EngineAddress> peer) {
  check_open();
  worker_->run_on_worker([&] { worker_->peer_addresses(*peer); }, 30'000'000'000LL);
}

bool TransferEngine::bind_imm_source(uint32_t imm, std::shared_ptr<const EngineAddress> peer) {
  check_open();
  for (size_t r = 0; r < rails_->size(); ++r)
    if (!rails_->rail(r).caps().source) return false;
  // A peer with more rails than ours writes to one of our rails from several of its own.
  // net in libfabric 1.17 names only the first of them; the others read FI_ADDR_NOTAVAIL
  // like an outsider's (measured: a 2-rail writer into 1 rail), so such a binding would drop
  // the peer's own shards. Bind only where each rail of ours hears at most one of the peer's.
  if (peer->rail_addresses.size() > rails_->size()) return false;
  // The peer's rails go into our AVs first (each on the rail of ours it writes to): only
  // then can a completion name them.
  worker_->run_on_worker([&] { worker_->bind_imm_source(imm, worker_->source_addresses(*peer), peer->engine_id); },
                         30'000'000'000LL);
  return true;
}

void TransferEngine::unbind_imm_source(uint32_t imm) {
  check_open();
  worker_->run_on_worker([&] { worker_->unbind_imm_source(imm); }, 30'000'000'000LL);
}

void TransferEngine::claim_imm(uint32_t imm) {
  check_open();
  bool claimed = false;
  worker_->run_on_worker([&] { claimed = worker_->claim_imm(imm); }, 30'000'000'000LL);
  if (!claimed)
    throw ImmCounterOverflow("imm " + std::to_string(imm) + " cannot be claimed: every one of the " +
                             std::to_string(worker_->imm_counters().capacity()) +
                             " slots of the immediate table (imm_table_capacity) holds a live claim");
}

void TransferEngine::release_imm(uint32_t imm) {
  check_open();
  worker_->run_on_worker([&] { worker_->release_imm(imm); }, 30'000'000'000LL);
}

void TransferEngine::forget(const EngineAddress& peer) {
  check_open();
  uint64_t id = peer.engine_id;
  {
    std::lock_guard<std::mutex> lock(same_host_mutex_);
    same_host_peers_.erase(id);
  }
  worker_->run_on_worker([&] { worker_->forget_peer(id); }, 30'000'000'000LL);
}

bool TransferEngine::sever_peer(const EngineAddress& peer, std::vector<size_t>* per_rail,
                                bool same_host_writes_ended) {
  check_open();
  per_rail->assign(peer.rail_addresses.size(), 0);
  // Other socket providers (sockets) run progress threads of their own: a sever on ours
  // would race their reads. Non-socket providers have no connection to find.
  if (provider_ != "net" && provider_ != "tcp") return false;
  std::vector<SeverResult> results;
  worker_->run_on_worker([&] { results = worker_->sever_peer_connections(peer); }, 30'000'000'000LL);
  const bool same_host = !address_.same_host.host_key.empty() &&
                         peer.same_host.host_key == address_.same_host.host_key;
  bool proven = !results.empty() && (!same_host || same_host_writes_ended);
  for (size_t r = 0; r < results.size(); ++r) {
    (*per_rail)[r] = results[r].severed;
    proven = proven && results[r].proven;
  }
  return proven;
}

}  // namespace kvxfer
