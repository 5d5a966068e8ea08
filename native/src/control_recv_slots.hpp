// Receive buffers for control messages: on each rail a fixed number of slots, each a
// slot_bytes piece of one registered buffer of that rail, posted to the rail and posted
// again once its message was read (ControlInbox takes a copy). Worker thread only: it posts
// to the rails, which only the progress worker touches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "rail_group.hpp"

namespace kvxfer {

class ControlRecvSlots {
 public:
  // Registers one buffer per rail and posts every slot. Throws EngineError (and registers
  // nothing) if a registration fails.
  ControlRecvSlots(RailGroup& rails, size_t slots_per_rail, size_t slot_bytes);
  ~ControlRecvSlots();
  ControlRecvSlots(const ControlRecvSlots&) = delete;
  ControlRecvSlots& operator=(const ControlRecvSlots&) = delete;

  // Whether a completion's op_context is one of our slots. Checked by address, not by
  // reading a tag through the pointer: providers may hand back stale contexts on remote
  // writes (libfabric 1.17's net did), and dereferencing one crashed the worker.
  bool owns(const void* context) const {
    return !slots_.empty() && context >= static_cast<const void*>(slots_.data()) &&
           context < static_cast<const void*>(slots_.data() + slots_.size());
  }
  // The bytes received into the slot `context` (owns(context) must hold).
  const char* message(const void* context) const { return static_cast<const Slot*>(context)->buf; }
  // Posts the slot `context` again: its message was read, or its receive failed.
  void repost(void* context) { post(static_cast<Slot*>(context)); }
  // Posts again the slots the provider refused (EAGAIN) until it made progress.
  void retry_refused();

 private:
  struct Slot {
    struct fi_context2 fi_ctx;  // first member: the libfabric context
    ContextTag tag = ContextTag::kRecvSlot;
    uint16_t rail = 0;
    char* buf = nullptr;
  };
  void post(Slot* slot);

  RailGroup& rails_;
  size_t slot_bytes_;
  // One contiguous array, sized once, so owns() can check an address against it.
  std::vector<Slot> slots_;
  std::vector<std::vector<char>> buffers_;  // one per rail
  std::vector<RailRegistration> registrations_;  // one per rail
  std::vector<Slot*> refused_;
};

}  // namespace kvxfer
