// The same-host path: when the target engine lives in another process on this kernel
// (same boot, same PID namespace) and ptrace rules let us, a write is one
// process_vm_writev straight from the source buffer into the target's registered region:
// one copy by the sender's CPU, none by the target's, nothing through a fabric provider.
// The immediate follows once the copy returned, through the receiver's shared-memory ring
// (same_host_imm_ring.hpp) or, where that is not to be had, over the fabric; either way the
// receiver's ImmCounter keeps meaning "every byte is here".
//
// Why not libfabric's shm provider: its RMA is progressed by the target's CPU (the target
// copies out of the sender via CMA when it polls), so a write waits for the target's
// progress thread to wake up, and libfabric 1.17's shm hangs the initiator when a peer
// dies at the wrong moment (see tests/test_engine.py). Here a dead peer is an ESRCH.
//
// Mapped regions: a buffer the owner keeps in a memfd (kvxfer.SharedBuffer; the KV cache
// does) is mapped by the sender through /proc/<pid>/fd/<n>, and the copy is a plain memcpy
// at memory speed: no system call per write, no per-page pinning (process_vm_writev pins
// and dirties every 4 KiB page, which halves its speed against memcpy here).
//
// Safety: a descriptor is only trusted for this path when the owner's RegionTable (in the
// owner's memory, read with process_vm_readv) lists that very region (and, for a mapping,
// the very file, by device and inode), and it is checked again before every slice of a
// copy, together with a pidfd that tells whether the owner is still the process we probed
// (pids are recycled). A descriptor the table does not confirm goes over the fabric, where
// the provider checks its key.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "descriptors.hpp"
#include "engine_types.hpp"
#include "same_host_imm_ring.hpp"
#include "transfer_request.hpp"

namespace kvxfer {

// The identity this process offers to same-host peers; empty host_key when /proc does not
// tell (then no peer will try the path).
SameHostIdentity local_same_host_identity(uint64_t table_addr, int table_fd);

// Owner side: the regions this engine registered, in a fixed table at a stable address of
// this process, for peers to read. Written under the engine's registration mutex only. It
// lives in a memfd (when the kernel has them) so that same-host peers map it read-only and
// check a region with a few loads instead of a process_vm_readv per write.
class RegionTable {
 public:
  static constexpr uint64_t kMagic = 0x326c627472667876ull;  // "vxfrtbl2"
  static constexpr size_t kSlots = 4096;

  struct Header {
    uint64_t magic;
    uint64_t engine_id;
    uint64_t slots;
    // The owner's immediate ring (ImmRingBoard): its memfd and eventfd numbers, -1: none.
    int64_t imm_ring_fd;
    int64_t imm_event_fd;
  };
  // What a reader sees of a slot (the owner writes it through atomics of the same layout).
  struct EntryImage {
    uint64_t region_id;
    uint64_t addr;
    uint64_t length;
    uint64_t share_fd_plus1;  // 0: not in a shareable file
    uint64_t share_offset;
    uint64_t share_dev;
    uint64_t share_ino;
  };

  explicit RegionTable(uint64_t engine_id);
  ~RegionTable();
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;
  uint64_t address() const { return reinterpret_cast<uint64_t>(layout_); }
  int fd() const { return fd_; }  // -1 when the table is on the heap

  // A region whose slot is taken by another live region is not published: same-host writes
  // to it fall back to the fabric.
  void publish(const MemoryRegion& region);
  void withdraw(const MemoryRegion& region);
  // Names the owner's immediate ring to peers; before the engine's address is handed out.
  void offer_imm_ring(const ImmRingBoard& board);

  static uint64_t entry_offset(uint64_t region_id) {
    return sizeof(Header) + (region_id % kSlots) * sizeof(EntryImage);
  }
  static constexpr size_t kBytes = sizeof(Header) + kSlots * sizeof(EntryImage);

 private:
  struct Entry {
    std::atomic<uint64_t> region_id{0};  // 0: free; written last on publish, first on withdraw
    std::atomic<uint64_t> addr{0};
    std::atomic<uint64_t> length{0};
    std::atomic<uint64_t> share_fd_plus1{0};
    std::atomic<uint64_t> share_offset{0};
    std::atomic<uint64_t> share_dev{0};
    std::atomic<uint64_t> share_ino{0};
  };
  struct Layout {
    Header header;
    Entry entries[kSlots];
  };
  static_assert(sizeof(Entry) == sizeof(EntryImage), "readers copy entries as plain words");
  static_assert(sizeof(Layout) == kBytes, "peers map exactly this many bytes");

  Layout* layout_ = nullptr;
  int fd_ = -1;
};

// A peer's region mapped into this process (unmapped when the last user lets go).
class SharedMapping {
 public:
  SharedMapping(void* base, size_t length) : base_(static_cast<char*>(base)), length_(length) {}
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  char* base() const { return base_; }

 private:
  char* base_;
  size_t length_;
};
using SharedMappingPtr = std::shared_ptr<const SharedMapping>;

// Sender side: a same-host peer we proved we can write into. Shared by every descriptor
// of that peer; thread-safe (its state is fixed after open, but for the mapping cache,
// which has a lock of its own: it is used when a descriptor is parsed, never per write).
class SameHostPeer {
 public:
  // Null when `peer` cannot be reached this way: no identity, another host or PID
  // namespace, not permitted, gone, or not the engine its address names. With
  // `imm_ring`, also claims a lane of the peer's immediate ring for engine `self_engine_id`
  // (none to be had: immediates go over the fabric).
  static std::shared_ptr<SameHostPeer> open(const EngineAddress& peer, const SameHostIdentity& self,
                                            uint64_t self_engine_id, bool imm_ring);
  ~SameHostPeer();
  SameHostPeer(const SameHostPeer&) = delete;
  SameHostPeer& operator=(const SameHostPeer&) = delete;

  pid_t pid() const { return pid_; }
  // True once the owner process is gone (its pidfd is readable).
  bool exited() const;
  // "" when the owner still runs and lists this region exactly; else the reason. The
  // entry it read goes to *entry when given.
  std::string check_region(uint64_t region_id, uint64_t addr, uint64_t length,
                           RegionTable::EntryImage* entry = nullptr) const;
  // True while the owner's table lists this region exactly. Unlike check_region it does
  // not ask whether the owner still runs (a system call): sweeps of many descriptors of
  // one owner ask exited() once.
  bool lists_region(uint64_t region_id, uint64_t addr, uint64_t length) const;
  // Maps a region that lives in a shareable file of the owner's, given the owner's table
  // entry that check_region confirmed for it; null when that entry names no such file or
  // the file is not that one (then process_vm_writev is used). A region already mapped
  // for another descriptor (each reservation's windows name the same parent) gets that
  // mapping again.
  SharedMappingPtr map_region(const MemoryDescriptor& d, const RegionTable::EntryImage& e) const;
  // Writes every pair (local[i] -> remote[i], equal lengths); "" or the reason it failed.
  std::string copy(const struct iovec* local, const struct iovec* remote, size_t count) const;
  // Our lane of the peer's immediate ring, or null. Used by our progress worker only.
  ImmRingLane* imm_lane() const { return imm_lane_.get(); }

 private:
  SameHostPeer(pid_t pid, int pidfd, uint64_t table_addr, const char* table_map)
      : pid_(pid), pidfd_(pidfd), table_addr_(table_addr), table_map_(table_map) {}
  bool read_entry(uint64_t region_id, RegionTable::EntryImage* e) const;
  std::string errno_text(int err, const char* doing) const;

  pid_t pid_;
  int pidfd_;
  uint64_t table_addr_;
  const char* table_map_;  // the owner's table mapped read-only here, or null: read it by CMA
  std::unique_ptr<ImmRingLane> imm_lane_;

  // Live mappings by what the owner's table confirmed: region id, file (device, inode),
  // offset and length. A mapping each per descriptor used to repeat MAP_POPULATE of the
  // whole KV cache for every reservation, and keep page tables for it per cached
  // descriptor. A live mapping holds its file, so the inode cannot be reused meanwhile.
  using MappingKey = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>;
  mutable std::mutex mappings_mutex_;
  mutable std::map<MappingKey, std::weak_ptr<const SharedMapping>> mappings_;
};
using SameHostPeerPtr = std::shared_ptr<const SameHostPeer>;

// One same-host write, planned on the submitting thread and carried out by the progress
// worker a slice at a time, so a 64 MiB copy never keeps completions of other transfers
// waiting for long.
struct SameHostCopy {
  // At most this many bytes and IOV_MAX pieces per slice: about a millisecond of copying.
  static constexpr uint64_t kSliceBytes = 4ull << 20;
  static constexpr size_t kSlicePieces = 1024;

  SameHostPeerPtr peer;
  SharedMappingPtr mapping;  // set: memcpy into it; else process_vm_writev
  uint64_t region_id = 0, region_addr = 0, region_length = 0;
  std::vector<struct iovec> local, remote;  // pairwise equal lengths, at most kSliceBytes each
  size_t next = 0;                           // first piece not yet copied
  uint64_t bytes = 0;

  bool done() const { return next == local.size(); }
  // Copies the next slice (after re-checking the peer and its region). Returns "" or why
  // it failed; `copied` gets the bytes of the slice.
  std::string run_slice(uint64_t* copied);
};

// Plans the copy of a request's bytes (a single or paged write), validated like the fabric
// path (write_bounds.hpp); runs of pages adjacent on both sides become one piece. Null for
// an immediate-only request: it has no bytes, and its immediates go over the fabric.
std::unique_ptr<SameHostCopy> plan_same_host(SameHostPeerPtr peer, SharedMappingPtr mapping,
                                             const MemoryRegion& local, const MemoryDescriptor& remote,
                                             const TransferRequest& request);

}  // namespace kvxfer
