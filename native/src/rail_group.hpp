// Several rails (NICs) used as one. This file holds all multi-rail logic: how a transfer
// is validated, sharded across rails and coalesced into fabric operations. Planning runs
// on the submitting thread and only reads immutable rail capabilities, so the progress
// worker is left with posting and completions.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "descriptors.hpp"
#include "engine_types.hpp"
#include "fabric_rail.hpp"
#include "same_host_path.hpp"
#include "transfer_request.hpp"

namespace kvxfer {

// Most local/remote segments one write carries; providers here allow 4.
constexpr size_t kMaxIov = 4;

enum class OpKind : uint8_t {
  kWrite,    // one-sided write, maybe with remote CQ data
  kImmOnly,  // zero-byte send carrying remote CQ data (immediate-only writes)
  kSend,     // two-sided control message
};

struct WorkBatch;

// One fabric operation. Its address is the libfabric context, so it must not move while
// posted: batches keep ops in a vector that is never resized after planning.
// Every libfabric context the engine hands out starts with this header, so a completion's
// op_context tells which kind of object it is.
enum class ContextTag : uint32_t { kRailOp = 0x6f70, kRecvSlot = 0x7276 };

struct RailOp {
  struct fi_context2 fi_ctx;  // first member: providers with FI_CONTEXT write here
  ContextTag tag = ContextTag::kRailOp;
  WorkBatch* batch = nullptr;
  fi_addr_t dest = FI_ADDR_UNSPEC;  // resolved by the worker when the batch arrives
  OpKind kind = OpKind::kWrite;
  uint16_t rail = 0;
  uint8_t iov_count = 0;
  bool has_cq_data = false;
  bool delivery_complete = false;
  // Posted and counted in the worker's inflight budget of its rail until it completes or
  // its transfer expires (see RailPostQueue::release).
  bool holds_slot = false;
  uint64_t cq_data = 0;
  uint64_t bytes = 0;
  struct iovec iov[kMaxIov];
  void* desc[kMaxIov];
  struct fi_rma_iov rma[kMaxIov];
};

// The one request type: everything the worker needs to carry out a transfer.
struct WorkBatch {
  TransferStatePtr transfer;
  std::shared_ptr<const EngineAddress> peer;
  std::vector<RailOp> ops;
  std::string payload;                   // owned bytes of a control message
  std::vector<RailRegistration> payload_registration;
  // A same-host write: copied first, then `ops` (its immediates, if any) are posted.
  std::unique_ptr<SameHostCopy> copy;
  // Set when those immediates may go through this peer's immediate ring instead
  // (SameHostPeer::imm_lane); an op the ring has no room for is posted.
  std::shared_ptr<const SameHostPeer> imm_ring_peer;
  // Parts still to finish: each op, plus one for the copy.
  size_t ops_remaining = 0;
  bool failed = false;
};

// Immediates travel in the 64-bit CQ data word: low 32 bits the user's immediate, high
// 32 bits what this arrival is worth, in fixed point with kImmUnit per counted unit. An op
// carrying k coalesced pages is worth k * kImmUnit; the s shards of one single write are
// worth kImmUnit / s each (the last takes the remainder), so every shard carries the
// immediate and no extra message or round trip is needed. The receiver's total reaches
// n units exactly when everything that makes up n units has landed: its count does not
// depend on how the sender coalesced or sharded.
constexpr uint32_t kImmUnit = 1u << 16;
// Most pages one op may stand for, so its weight fits in 32 bits.
constexpr uint64_t kMaxPagesPerOp = (1ull << 32) / kImmUnit - 1;

// A write without an immediate still carries CQ data where the provider has 8 bytes of
// it: this weight, which counts nothing. Software providers (net, tcp, shm) acknowledge a
// write only when the target's worker makes progress, and a write that leaves no
// completion at the target looks like silence to that worker: it drifts into its quiet
// polling (see sleep_until_work) and every such write waits for the next poll (about
// 120 us per 4 KiB write over net). libfabric's remote-write counters would tell, but net
// 1.17 never increments them and tcp has none. Real weights stay at or below
// kMaxPagesPerOp * kImmUnit, so this one is free.
constexpr uint32_t kTrafficOnlyWeight = 0xffffffffu;

inline uint64_t encode_imm(uint32_t imm, uint32_t weight) {
  return static_cast<uint64_t>(imm) | (static_cast<uint64_t>(weight) << 32);
}

// Tunables of the planner, set once at engine start.
struct PlannerSettings {
  // Single writes at least this large are split across rails; below it one NIC is as fast.
  uint64_t shard_min_bytes = 512 * 1024;
  // A single write is cut into ops of at most this size even on one rail: one huge op
  // leaves both ends idle around its edges (64 MiB ran 20-35% below 1 MiB on net/tcp).
  uint64_t max_op_bytes = 4 * 1024 * 1024;
  // Coalesced page runs stop at this size so one op cannot starve the other rails.
  uint64_t max_coalesce_bytes = 4 * 1024 * 1024;
  // Complete a write (and an immediate-only message) at the initiator only once the target
  // has it (an ack from the target on socket providers). Then "the prefiller saw every
  // write complete" means no byte and no immediate of the request can still land, which is
  // what page and immediate reuse on cancel rely on.
  bool delivery_complete = true;
};

// Which ops of a batch complete only once delivered (PlannerSettings::delivery_complete).
struct DeliveryLevel {
  bool writes = false;
  bool immediates = false;
};

class RailGroup {
 public:
  RailGroup(const std::string& provider, const std::string& bind_host, size_t rails,
            PlannerSettings settings);

  size_t size() const { return rails_.size(); }
  FabricRail& rail(size_t i) { return *rails_[i]; }
  const RailCapabilities& caps() const { return rails_[0]->caps(); }
  // Weighted immediates need 8 bytes of CQ data; without them every page is its own op.
  bool weighted_imm() const { return caps().cq_data_size >= 8; }
  std::vector<std::string> rail_addresses() const;

  // Plans any request into the batch's fabric ops: validated whole first (write_bounds.hpp).
  void plan(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
            const TransferRequest& request) const;

  void plan_write(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
                  const SingleWrite& write, std::optional<uint32_t> imm) const;

  void plan_paged_write(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
                        const PagedWrite& write, std::optional<uint32_t> imm) const;

  // Immediate-only messages that together add `units` to the receiver's count of imm.
  void plan_imm_only(WorkBatch& batch, uint32_t imm, uint64_t units = 1) const;

 private:
  // Links the ops to their batch and sets what every op of a batch carries: delivery
  // level, the traffic marker; totals the bytes.
  void finish_batch(WorkBatch& batch) const;
  // Remote rail that local rail `r` talks to (peers may have a different rail count).
  static size_t remote_rail(size_t r, const MemoryDescriptor& remote) {
    // Keys per remote rail: the region's, or (a windowed descriptor) each window's.
    const size_t keys = !remote.rails.empty() ? remote.rails.size()
                        : remote.windows.empty() ? 1 : remote.windows.front().rails.size();
    return r % std::max<size_t>(keys, 1);
  }
  // Where [offset, offset + length) of the remote region is on our rail `r`: the address
  // to put in fi_rma_iov and its key. A descriptor with windows reaches only inside one of
  // them (each window is its own registration): anything else is a BoundsError here, before
  // anything is posted.
  static fi_rma_iov remote_target(const MemoryDescriptor& remote, size_t r, uint64_t offset, uint64_t length);

  std::vector<std::unique_ptr<FabricRail>> rails_;
  PlannerSettings settings_;
  DeliveryLevel delivery_;
};

}  // namespace kvxfer
