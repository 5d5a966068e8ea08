// The engine's public face: registration, the transfer calls (single write, paged write,
// immediate-only, send/recv), the ImmCounter and events. It validates and plans on the
// calling thread, then hands the batch to the progress worker.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "descriptors.hpp"
#include "engine_types.hpp"
#include "progress_worker.hpp"
#include "rail_group.hpp"
#include "transfer_request.hpp"

namespace kvxfer {

struct EngineSettings {
  std::string provider = "auto";
  size_t rails = 1;
  std::string bind_host;  // socket providers bind here (e.g. 127.0.0.1); empty: default
  // Offer and use the same-host path (same_host_path.hpp) with peers on this kernel.
  bool same_host = true;
  // With same_host, the immediate of a same-host write goes through a ring in the
  // receiver's memory (same_host_imm_ring.hpp) instead of over the fabric: lone writes of
  // 4 KiB-1 MiB took 11-18 us less and 1.2-2x less CPU. Off: every immediate uses the fabric.
  bool same_host_imm_ring = true;
  // Fault in every page of a buffer when it is registered (madvise MADV_POPULATE_WRITE on
  // Linux >= 5.14, else one atomic touch per page): the first transfer into untouched
  // memory ran at 0.23x of the warm rate, since process_vm_writev and the provider then
  // fault each page in (about 10 us per 4 KiB page). Costs what the buffer's size says:
  // every page becomes resident at registration (and registration takes that long once).
  bool populate_on_register = true;
  // With populate_on_register, also lock the populated pages (mlock) where the process may:
  // CAP_IPC_LOCK, or RLIMIT_MEMLOCK room. Locked pages are never swapped or reclaimed, so a
  // transfer never waits for one to come back; the cost is that the buffer's whole size
  // stays out of the kernel's reach until deregistered. Where the kernel refuses, the
  // registration goes on unlocked and is counted (engine_stats: lock_refused).
  bool lock_on_register = true;
  // With populate_on_register, ask for transparent huge pages on the buffer's 2 MiB-aligned
  // part first (madvise MADV_HUGEPAGE), and collapse each 2 MiB span into one (MADV_COLLAPSE,
  // Linux 6.1), filled by its owner or not (a memfd gets huge pages no other way where
  // shmem_enabled is never). process_vm_writev into private memory ran at 8.0-8.3 GB/s
  // with huge pages against 3.3-3.6 GB/s with 4 KiB ones (the kernel pins and maps the
  // target's pages call by call), and fewer pages also mean fewer TLB misses and cheaper
  // RDMA registrations. The hint stays on the mapping after deregistration; a mapping
  // that cannot have huge pages keeps its small ones.
  bool huge_pages_on_register = true;
  PlannerSettings planner;
  ProgressWorkerSettings worker;
};

// A peer's memory region, parsed once and cached by the caller for repeated writes.
struct RemoteRegion {
  MemoryDescriptor descriptor;
  std::shared_ptr<const EngineAddress> owner;
  // Set when writes to this region take the same-host path (its owner's table confirmed it).
  SameHostPeerPtr same_host;
  // Set when the region also lives in a file of the owner's that we mapped: memcpy path.
  SharedMappingPtr mapping;
};
using RemoteRegionPtr = std::shared_ptr<RemoteRegion>;

class TransferEngine {
 public:
  explicit TransferEngine(EngineSettings settings);
  ~TransferEngine();

  const std::string& address() const { return address_blob_; }
  const std::string& provider() const { return provider_; }
  size_t rails() const { return rails_->size(); }
  const RailCapabilities& caps() const { return rails_->caps(); }
  uint64_t engine_id() const { return address_.engine_id; }

  // share_fd >= 0: the buffer lies at share_offset of that file mapping (a memfd), which
  // same-host peers may map to write with memcpy.
  MemoryRegionPtr register_memory(uintptr_t addr, uint64_t length, int share_fd = -1,
                                  uint64_t share_offset = 0);
  void deregister(const MemoryRegionPtr& region);
  std::string descriptor(const MemoryRegion& region) const;

  // Registers each (offset, length) of `parent` again, with fresh keys, on every rail: a
  // descriptor that reaches only those windows, revoked by close_windows. No populate,
  // no same-host table entry: the parent already did both (a same-host peer writes through
  // the parent's mapping, see docs/architecture.md). Ranges must be non-empty, inside the
  // parent and disjoint; they are sorted here.
  MemoryWindowsPtr register_windows(const MemoryRegionPtr& parent,
                                    std::vector<std::pair<uint64_t, uint64_t>> ranges);
  // Closes every window's registration (idempotent; a no-op once the engine closed, which
  // closed them). A fabric write that reaches the target after this fails at the writer.
  void close_windows(const MemoryWindowsPtr& windows);
  std::string descriptor(const MemoryWindows& windows) const;

  RemoteRegionPtr parse_remote(const std::string& descriptor_blob) const;
  std::shared_ptr<const EngineAddress> parse_peer(const std::string& address_blob) const;

  // Any request to a remote region: validated whole, then the same-host copy or the rails.
  TransferStatePtr submit(const MemoryRegionPtr& local, const RemoteRegionPtr& remote,
                          const TransferRequest& request);
  // Many requests to one remote region in one call, each its own transfer finishing into
  // `counter` (one wait for all of them instead of one per handle). All are validated and
  // planned before any is submitted: a bad one throws and none goes out.
  void submit_many(const MemoryRegionPtr& local, const RemoteRegionPtr& remote,
                   const std::vector<TransferRequest>& requests,
                   const std::shared_ptr<CompletionCounter>& counter);
  TransferStatePtr write_imm(std::shared_ptr<const EngineAddress> peer, uint32_t imm);
  TransferStatePtr send(std::shared_ptr<const EngineAddress> peer, std::string payload);

  void connect(std::shared_ptr<const EngineAddress> peer);
  // From now on `imm` is credited only with arrivals sent by `peer`'s endpoints; others are
  // dropped and counted (imm_foreign_dropped). False, and nothing bound, where the provider
  // cannot name the sender of a completion (no FI_SOURCE, or shm), or `peer` has more rails.
  bool bind_imm_source(uint32_t imm, std::shared_ptr<const EngineAddress> peer);
  void unbind_imm_source(uint32_t imm);
  // From now on arrivals for `imm` are counted (with count_claimed_imms_only; without it
  // every value is counted anyway). Throws ImmCounterOverflow when every slot of the table
  // is held by another claimed value.
  void claim_imm(uint32_t imm);
  // Arrivals for `imm` are dropped again and its slot is free (and its sender binding
  // gone). Only once no thread will consume or reset `imm` any more.
  void release_imm(uint32_t imm);
  void forget(const EngineAddress& peer);
  // Severs, on the thread that runs the provider's progress, every TCP connection of this
  // process to one of `peer`'s rail addresses (connection_sever.hpp); `per_rail` gets how
  // many per rail of the peer. True only where that proves no byte from the peer lands
  // after this returns: a socket provider whose progress only that thread makes (net,
  // tcp), no other socket that may carry the peer's bytes (a connection our listeners
  // accepted from its host, a reset one with unread bytes), and a peer that cannot write
  // through the same-host path (which has no socket), unless the caller proved its
  // same-host writes ended (`same_host_writes_ended`: SameHostWriter::still_writing).
  bool sever_peer(const EngineAddress& peer, std::vector<size_t>* per_rail, bool same_host_writes_ended = false);

  ProgressWorker& worker() { return *worker_; }
  void close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // Registrations whose pages the kernel refused to lock (see lock_on_register).
  uint64_t lock_refused() const { return lock_refused_.load(std::memory_order_relaxed); }

 private:
  // Gives a region's locked pages back (those no other locked registration covers).
  void unlock_pages(MemoryRegion& region);
  TransferStatePtr start(std::unique_ptr<WorkBatch> batch);
  // Hands a planned same-host copy to a batch, with the immediates that follow it.
  TransferStatePtr start_copy(std::unique_ptr<WorkBatch> batch, std::unique_ptr<SameHostCopy> copy,
                              std::optional<uint32_t> imm, uint64_t units);
  SameHostPeerPtr same_host_peer(const EngineAddress& owner) const;
  void check_peer(const EngineAddress& peer) const;
  void check_open() const;

  EngineSettings settings_;
  std::string provider_;
  std::unique_ptr<RailGroup> rails_;
  std::unique_ptr<ImmRingBoard> imm_ring_;  // immediates from same-host peers; outlives worker_
  std::unique_ptr<ProgressWorker> worker_;
  EngineAddress address_;
  std::string address_blob_;
  std::atomic<uint64_t> next_transfer_id_{1};
  std::atomic<uint64_t> next_region_id_{1};
  std::mutex regions_mutex_;  // registration only, never on the transfer path
  std::unordered_map<uint64_t, MemoryRegionPtr> regions_;
  std::unordered_map<uint64_t, MemoryWindowsPtr> windows_;  // open window sets, closed by close()
  std::atomic<uint64_t> next_windows_id_{1};
  std::unique_ptr<RegionTable> region_table_;  // what same-host peers may write into
  mutable std::mutex same_host_mutex_;          // peer lookups at descriptor parse, not per write
  mutable std::unordered_map<uint64_t, std::shared_ptr<SameHostPeer>> same_host_peers_;
  // Read by every call, from any thread, while another thread may be closing: atomic.
  // close_mutex_ makes a second close() wait until the first one finished (two threads
  // joining the worker at once would be undefined behaviour).
  std::atomic<bool> closed_{false};
  std::mutex close_mutex_;
  std::atomic<uint64_t> lock_refused_{0};
};

// Picks the best provider present for provider="auto": RDMA NICs first, then sockets.
std::string resolve_provider(const std::string& requested);

}  // namespace kvxfer
