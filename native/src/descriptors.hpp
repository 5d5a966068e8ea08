// Serialized handles that peers exchange: an engine's address (one fabric address per
// rail) and a memory descriptor (everything a peer needs to write into a region).
// Both are versioned, length-checked and end in a checksum, so a truncated, corrupt or
// foreign blob is refused with a DescriptorError before anything is posted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer {

// Where an engine's process lives, for peers that may reach it without the fabric (see
// same_host_path.hpp). Empty host_key: the engine offers no same-host path.
struct SameHostIdentity {
  std::string host_key;     // boot id and PID namespace: equal only where pids mean the same
  uint32_t pid = 0;
  uint64_t table_addr = 0;  // the owner's RegionTable, in its own address space
  int32_t table_fd = -1;    // the memfd holding that table, for peers to map (-1: none)
};

struct EngineAddress {
  uint64_t engine_id = 0;
  std::string provider;
  std::vector<std::string> rail_addresses;  // raw fi_getname() bytes, one per rail
  SameHostIdentity same_host;

  std::string serialize() const;
  static EngineAddress parse(const std::string& blob);
};

struct RemoteRailKey {
  uint64_t base = 0;  // added to offsets on providers with FI_MR_VIRT_ADDR, else 0
  uint64_t key = 0;
};

// A part of a region with its own registration (its own keys): a descriptor that lists
// windows lets its holder write into those windows only, and only while they stay
// registered (TransferEngine::register_windows). `offset` and `length` are in the region.
struct RemoteWindow {
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<RemoteRailKey> rails;  // base is the window's own (its VA, or 0)
};

struct MemoryDescriptor {
  EngineAddress owner;
  uint64_t region_id = 0;
  uint64_t addr = 0;  // the region's virtual address in its owner's process
  uint64_t length = 0;
  int32_t share_fd = -1;  // the owner's memfd holding the region (-1: none), see RegionTable
  uint64_t share_offset = 0;
  std::vector<RemoteRailKey> rails;  // the whole region's keys; empty when `windows` is set
  std::vector<RemoteWindow> windows;  // sorted by offset, disjoint; empty: the whole region

  // The key and base that reach [offset, offset + length) of the region on `rail`, with
  // `*window_offset` set to where that key's range starts in the region; nullptr when no
  // window covers the whole range (the planner refuses the write).
  const RemoteRailKey* key_for(size_t rail, uint64_t offset, uint64_t length, uint64_t* window_offset) const;

  std::string serialize() const;
  static MemoryDescriptor parse(const std::string& blob);
};

std::string to_hex(const std::string& bytes);

}  // namespace kvxfer
