#include "control_recv_slots.hpp"

namespace kvxfer {

ControlRecvSlots::ControlRecvSlots(RailGroup& rails, size_t slots_per_rail, size_t slot_bytes)
    : rails_(rails), slot_bytes_(slot_bytes) {
  slots_.resize(rails_.size() * slots_per_rail);
  try {
    for (size_t r = 0; r < rails_.size(); ++r) {
      buffers_.emplace_back(slots_per_rail * slot_bytes);
      auto& buf = buffers_.back();
      registrations_.push_back(rails_.rail(r).register_region(buf.data(), buf.size()));
    }
  } catch (...) {
    for (size_t r = 0; r < registrations_.size(); ++r) rails_.rail(r).deregister(registrations_[r]);
    throw;
  }
  for (size_t r = 0; r < rails_.size(); ++r) {
    for (size_t i = 0; i < slots_per_rail; ++i) {
      Slot& slot = slots_[r * slots_per_rail + i];
      slot.rail = static_cast<uint16_t>(r);
      slot.buf = buffers_[r].data() + i * slot_bytes;
      post(&slot);
    }
  }
}

ControlRecvSlots::~ControlRecvSlots() {
  for (size_t r = 0; r < registrations_.size(); ++r) rails_.rail(r).deregister(registrations_[r]);
}

void ControlRecvSlots::post(Slot* slot) {
  ssize_t rc = rails_.rail(slot->rail).post_recv(slot->buf, slot_bytes_, registrations_[slot->rail].local_desc, slot);
  // EAGAIN means the provider wants progress first: retry_refused posts it again later.
  if (rc == -FI_EAGAIN) refused_.push_back(slot);
}

void ControlRecvSlots::retry_refused() {
  if (refused_.empty()) return;
  std::vector<Slot*> retry;
  retry.swap(refused_);
  for (Slot* slot : retry) post(slot);
}

}  // namespace kvxfer
