#include "rail_group.hpp"

#include <algorithm>

#include "write_bounds.hpp"

namespace kvxfer {
void RailGroup::finish_batch(WorkBatch& batch) const {
  // Writes without an immediate carry kTrafficOnlyWeight (see there), where CQ data has room.
  const bool mark_traffic = weighted_imm();
  batch.ops_remaining = batch.ops.size();
  uint64_t bytes = 0;
  for (auto& op : batch.ops) {
    op.batch = &batch;
    if (mark_traffic && op.kind == OpKind::kWrite && !op.has_cq_data) {
      op.has_cq_data = true;
      op.cq_data = encode_imm(0, kTrafficOnlyWeight);
    }
    if ((op.kind == OpKind::kWrite && delivery_.writes) ||
        (op.kind == OpKind::kImmOnly && delivery_.immediates))
      op.delivery_complete = true;
    bytes += op.bytes;
  }
  batch.transfer->bytes = bytes;
}

RailGroup::RailGroup(const std::string& provider, const std::string& bind_host, size_t rails,
                     PlannerSettings settings)
    : settings_(settings) {
  if (rails == 0 || rails > 16) throw EngineError("rails must be 1..16, got " + std::to_string(rails));
  for (size_t i = 0; i < rails; ++i)
    rails_.push_back(std::make_unique<FabricRail>(provider, bind_host, i));
  delivery_.writes = settings.delivery_complete;
  // Immediates too: a late one could bump a counter the receiver has reused. Not on shm:
  // libfabric 1.17's shm never completes a zero-byte send flagged FI_DELIVERY_COMPLETE.
  delivery_.immediates = settings.delivery_complete && provider != "shm";
}

std::vector<std::string> RailGroup::rail_addresses() const {
  std::vector<std::string> out;
  for (const auto& r : rails_) out.push_back(r->address());
  return out;
}

fi_rma_iov RailGroup::remote_target(const MemoryDescriptor& remote, size_t r, uint64_t offset, uint64_t length) {
  uint64_t window_offset = 0;
  const RemoteRailKey* key = remote.key_for(remote_rail(r, remote), offset, length, &window_offset);
  if (!key)
    throw BoundsError("bytes [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                      ") of the remote region lie outside the windows its descriptor grants");
  return fi_rma_iov{key->base + (offset - window_offset), length, key->key};
}

void RailGroup::plan(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
                     const TransferRequest& request) const {
  if (const auto* w = std::get_if<SingleWrite>(&request.shape))
    plan_write(batch, local, remote, *w, request.imm);
  else if (const auto* p = std::get_if<PagedWrite>(&request.shape))
    plan_paged_write(batch, local, remote, *p, request.imm);
  else if (!request.imm)
    throw BoundsError("an immediate-only write needs an immediate");
  else
    plan_imm_only(batch, *request.imm, std::get<ImmOnly>(request.shape).units);
}

void RailGroup::plan_write(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
                           const SingleWrite& write, std::optional<uint32_t> imm) const {
  const uint64_t src_offset = write.src_offset, dst_offset = write.dst_offset, length = write.length;
  check_write_bounds(src_offset, local.length, dst_offset, remote.length, length);

  const bool weighted = weighted_imm();
  size_t shards = 1;
  // Without weighted immediates (4-byte CQ data) a shard could not carry a fraction of
  // the write's one unit, so such providers send each single write as one op.
  if (weighted || !imm) {
    if (rails_.size() > 1 && length >= settings_.shard_min_bytes) shards = rails_.size();
    uint64_t by_size = (length + settings_.max_op_bytes - 1) / settings_.max_op_bytes;
    // Keep whole rounds over the rails so each rail gets the same share.
    shards = std::max<uint64_t>(shards, (by_size + shards - 1) / shards * shards);
    shards = std::min<uint64_t>(shards, kImmUnit);
  }
  // Shards end on 4 KiB boundaries so no page is split between two ops.
  uint64_t shard_len = ((length / shards) + 4095) & ~uint64_t(4095);
  batch.ops.reserve(shards);
  for (size_t s = 0; s < shards; ++s) {
    uint64_t begin = std::min<uint64_t>(length, s * shard_len);
    uint64_t end = (s + 1 == shards) ? length : std::min<uint64_t>(length, begin + shard_len);
    if (begin >= end) continue;
    RailOp op;
    op.kind = OpKind::kWrite;
    op.rail = static_cast<uint16_t>(s % rails_.size());
    const auto& lreg = local.rails[op.rail];
    op.iov_count = 1;
    op.iov[0].iov_base = reinterpret_cast<void*>(local.addr + src_offset + begin);
    op.iov[0].iov_len = end - begin;
    op.desc[0] = lreg.local_desc;
    op.rma[0] = remote_target(remote, op.rail, dst_offset + begin, end - begin);
    op.bytes = end - begin;
    batch.ops.push_back(op);
  }
  if (imm) {
    const uint32_t n = static_cast<uint32_t>(batch.ops.size());
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t weight = weighted ? kImmUnit / n + (i + 1 == n ? kImmUnit % n : 0) : 0;
      batch.ops[i].has_cq_data = true;
      batch.ops[i].cq_data = encode_imm(*imm, weight);
    }
  }
  finish_batch(batch);
}

void RailGroup::plan_paged_write(WorkBatch& batch, const MemoryRegion& local, const MemoryDescriptor& remote,
                                 const PagedWrite& write, std::optional<uint32_t> imm) const {
  check_paged_bounds(write, local.length, remote.length);
  const int64_t* src_pages = write.src_pages.data;
  const int64_t* dst_pages = write.dst_pages.data;
  const size_t count = write.count();
  const uint64_t page_size = write.page_size, src_stride = write.src_stride, dst_stride = write.dst_stride;
  const uint64_t src_offset = write.src_offset, dst_offset = write.dst_offset;

  const bool weighted = weighted_imm();
  const size_t max_iov = weighted ? std::min(kMaxIov, caps().iov_limit) : 1;
  const size_t rails = std::min(rails_.size(), count);
  batch.ops.reserve(count / std::max<size_t>(1, max_iov) + rails + 1);

  // Each rail takes one contiguous slice of the page list (the paper's paged sharding).
  for (size_t r = 0; r < rails; ++r) {
    size_t begin = count * r / rails, end = count * (r + 1) / rails;
    const auto& lreg = local.rails[r];
    RailOp* op = nullptr;
    uint32_t weight = 0;
    for (size_t i = begin; i < end; ++i) {
      uintptr_t src = local.addr + src_offset + src_pages[i] * src_stride;
      const fi_rma_iov target = remote_target(remote, r, dst_offset + dst_pages[i] * dst_stride, page_size);
      const uint64_t dst = target.addr;
      if (op && weighted) {
        auto& last_iov = op->iov[op->iov_count - 1];
        auto& last_rma = op->rma[op->iov_count - 1];
        // Two windows' keys never merge into one iov, even where their memory touches.
        bool adjacent = reinterpret_cast<uintptr_t>(last_iov.iov_base) + last_iov.iov_len == src &&
                        last_rma.addr + last_rma.len == dst && last_rma.key == target.key;
        const bool room = weight < kMaxPagesPerOp;
        if (adjacent && room && op->bytes + page_size <= settings_.max_coalesce_bytes) {
          last_iov.iov_len += page_size;
          last_rma.len += page_size;
          op->bytes += page_size;
          ++weight;
          continue;
        }
        if (room && op->iov_count < max_iov && op->bytes + page_size <= settings_.max_coalesce_bytes) {
          size_t k = op->iov_count++;
          op->iov[k].iov_base = reinterpret_cast<void*>(src);
          op->iov[k].iov_len = page_size;
          op->desc[k] = lreg.local_desc;
          op->rma[k] = target;
          op->bytes += page_size;
          ++weight;
          continue;
        }
      }
      if (op && imm) {
        op->has_cq_data = true;
        op->cq_data = encode_imm(*imm, weighted ? weight * kImmUnit : 0);
      }
      batch.ops.emplace_back();
      op = &batch.ops.back();
      op->kind = OpKind::kWrite;
      op->rail = static_cast<uint16_t>(r);
      op->iov_count = 1;
      op->iov[0].iov_base = reinterpret_cast<void*>(src);
      op->iov[0].iov_len = page_size;
      op->desc[0] = lreg.local_desc;
      op->rma[0] = target;
      op->bytes = page_size;
      weight = 1;
    }
    if (op && imm) {
      op->has_cq_data = true;
      op->cq_data = encode_imm(*imm, weighted ? weight * kImmUnit : 0);
    }
  }
  finish_batch(batch);
}

void RailGroup::plan_imm_only(WorkBatch& batch, uint32_t imm, uint64_t units) const {
  if (units == 0) throw BoundsError("an immediate must be worth at least one unit");
  // One arrival is worth at most kMaxPagesPerOp units; without weighted immediates (4-byte
  // CQ data) every unit is its own message.
  const bool weighted = weighted_imm();
  const uint64_t per_op = weighted ? kMaxPagesPerOp : 1;
  batch.ops.reserve(batch.ops.size() + (units + per_op - 1) / per_op);
  for (uint64_t left = units; left > 0;) {
    const uint64_t n = std::min(left, per_op);
    RailOp op;
    op.kind = OpKind::kImmOnly;
    op.rail = 0;
    op.iov_count = 0;
    op.has_cq_data = true;
    op.cq_data = encode_imm(imm, weighted ? static_cast<uint32_t>(n * kImmUnit) : 0);
    batch.ops.push_back(op);
    left -= n;
  }
  finish_batch(batch);
}

}  // namespace kvxfer
