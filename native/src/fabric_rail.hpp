// One rail: a libfabric fabric + domain + RDM endpoint + AV + CQ on one NIC (or one
// loopback endpoint). This is the only file that calls libfabric for data movement; the
// layers above see posting calls that return 0 or -FI_EAGAIN and completion entries.
// A rail is owned by one thread (the progress worker), so it is opened with
// FI_THREAD_DOMAIN and holds no locks.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine_types.hpp"

namespace kvxfer {

// What the provider told fi_getinfo about itself, read once and used to shape requests.
struct RailCapabilities {
  std::string provider;        // e.g. "net", "shm", "tcp;ofi_rxm"
  std::string fabric_name;
  std::string domain_name;
  bool virt_addr = false;      // FI_MR_VIRT_ADDR: remote addresses are virtual, else offsets
  bool prov_key = false;       // FI_MR_PROV_KEY: the provider picks MR keys
  bool mr_local = false;       // FI_MR_LOCAL: local buffers need a descriptor
  bool mr_endpoint = false;    // FI_MR_ENDPOINT: MRs are bound to the endpoint
  bool rx_cq_data = false;     // FI_RX_CQ_DATA: remote CQ data consumes a posted receive
  size_t cq_data_size = 0;     // bytes of remote CQ data (4 on EFA/verbs, 8 on tcp/shm)
  size_t iov_limit = 1;        // min of local and remote iov limits for one write
  size_t tx_size = 0;
  size_t rx_size = 0;
  size_t inject_size = 0;
  bool has_wait_fd = false;
  // What the worker blocks on for this rail (provider_poll_set.hpp): "provider poll set
  // ...", "cq wait fd ..." or "none" (no wait fd: the worker polls with short sleeps).
  std::string sleeps_on = "none";
  bool source = false;         // FI_SOURCE: completions can name their sender (fi_cq_readfrom)
};

class FabricRail {
 public:
  // `provider` is a libfabric provider name ("net", "tcp", "shm", "efa", "verbs");
  // `bind_host` pins socket providers to an address (e.g. "127.0.0.1"), empty for default;
  // `device_index` picks the n-th matching NIC for providers that list several.
  FabricRail(const std::string& provider, const std::string& bind_host, size_t device_index);
  ~FabricRail();
  FabricRail(const FabricRail&) = delete;
  FabricRail& operator=(const FabricRail&) = delete;

  const RailCapabilities& caps() const { return caps_; }
  const std::string& address() const { return address_; }

  // Registers [addr, addr + length) for local use and remote writes. The key is the
  // provider's own (FI_MR_PROV_KEY) or 64 random bits from getrandom(): a peer cannot
  // guess it, so only holders of the descriptor can write (a key was once region id << 8,
  // the same in every process, and one forged descriptor reached any KV cache).
  RailRegistration register_region(void* addr, size_t length);
  void deregister(RailRegistration& reg);

  fi_addr_t insert_peer(const std::string& raw_address);
  void remove_peer(fi_addr_t addr);

  // Posting: 0 on success, -FI_EAGAIN when the provider's queue is full, else an error.
  ssize_t post_write(const struct fi_msg_rma& msg, uint64_t flags);
  ssize_t post_send(const struct fi_msg& msg, uint64_t flags);
  ssize_t post_recv(void* buf, size_t len, void* desc, void* context);

  // Returns entries read (>= 0), or -FI_EAVAIL when an error entry waits (read it with
  // read_error), or another negative errno. source(i) is then the sender of entry i.
  ssize_t read_completions(struct fi_cq_data_entry* entries, size_t count);
  // The AV address of the peer that sent entry i of the last read_completions:
  // FI_ADDR_NOTAVAIL when the provider cannot tell (no FI_SOURCE) or the sender is not in
  // this rail's AV (an engine we never connected to).
  fi_addr_t source(size_t i) const { return caps_.source ? sources_[i] : FI_ADDR_NOTAVAIL; }
  // Reads one error entry and formats the provider's message.
  bool read_error(struct fi_cq_err_entry* entry, std::string* message);

  int wait_fd() const { return wait_fd_; }
  // The fd the progress worker blocks on: wait_fd() or the provider's poll set inside it
  // (provider_poll_set.hpp); -1 without a wait fd.
  int sleep_fd() const { return sleep_fd_; }
  // True when it is safe to block on wait_fd() (nothing left to progress).
  bool try_wait();

 private:
  void open(const std::string& provider, const std::string& bind_host, size_t device_index);
  struct fi_info* choose(const std::string& provider, const std::string& bind_host, size_t device_index,
                         bool want_source);
  void close_all() noexcept;

  RailCapabilities caps_;
  struct fi_info* info_ = nullptr;
  struct fid_fabric* fabric_ = nullptr;
  struct fid_domain* domain_ = nullptr;
  struct fid_av* av_ = nullptr;
  struct fid_cq* cq_ = nullptr;
  struct fid_ep* ep_ = nullptr;
  std::string address_;
  int wait_fd_ = -1;
  int sleep_fd_ = -1;
  std::vector<fi_addr_t> sources_;  // filled by fi_cq_readfrom, one per entry read
};

// Names of the providers libfabric lists on this machine that can do RDM + RMA.
std::vector<std::string> available_providers();

}  // namespace kvxfer
