#include "fabric_rail.hpp"

#include <rdma/fi_errno.h>

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "provider_poll_set.hpp"

namespace kvxfer {

FabricError::FabricError(const std::string& what, int fi_errno)
    : EngineError(what + ": " + fi_strerror(fi_errno < 0 ? -fi_errno : fi_errno) + " (" +
                  std::to_string(fi_errno) + ")"),
      fi_errno_(fi_errno) {}

namespace {

// API version asked of libfabric: 1.14 is the oldest with everything used here.
constexpr uint32_t kFabricApiVersion = FI_VERSION(1, 14);
// Completion queue depth: above any inflight limit the worker uses, so it never overflows.
constexpr size_t kCqSize = 8192;

void check(int rc, const char* what) {
  if (rc) throw FabricError(what, rc);
}

// Layered providers report "tcp;ofi_rxm"; users name the core provider.
bool provider_matches(const char* reported, const std::string& wanted) {
  std::string r(reported ? reported : "");
  if (r == wanted) return true;
  auto semi = r.find(';');
  return semi != std::string::npos && r.substr(0, semi) == wanted;
}

bool uses_socket_addresses(const std::string& provider) {
  return provider == "tcp" || provider == "net" || provider == "sockets" || provider == "udp";
}

struct fi_info* make_hints(const std::string& provider, bool want_source = false) {
  struct fi_info* hints = fi_allocinfo();
  if (!hints) throw EngineError("fi_allocinfo failed");
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG | FI_SEND | FI_RECV;
  // FI_SOURCE lets the receiver learn who sent an immediate (ImmediateTracker::bind_source).
  if (want_source) hints->caps |= FI_SOURCE;
  hints->ep_attr->type = FI_EP_RDM;
  // We can honour these modes: contexts are ours to give, and receive buffers are posted.
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  // One owner thread per domain (the progress worker): lets the provider skip its locks.
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  // Transports are reliable but unordered; asking for no ordering keeps EFA/SRD eligible.
  hints->tx_attr->msg_order = 0;
  hints->rx_attr->msg_order = 0;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  return hints;
}

}  // namespace

std::vector<std::string> available_providers() {
  struct fi_info* hints = make_hints("");
  struct fi_info* info = nullptr;
  int rc = fi_getinfo(kFabricApiVersion, nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  std::vector<std::string> names;
  if (rc) return names;
  std::set<std::string> seen;
  for (auto* i = info; i; i = i->next) {
    std::string p = i->fabric_attr->prov_name;
    auto semi = p.find(';');
    if (semi != std::string::npos) p = p.substr(0, semi);
    if (seen.insert(p).second) names.push_back(p);
  }
  fi_freeinfo(info);
  return names;
}

FabricRail::FabricRail(const std::string& provider, const std::string& bind_host,
                       size_t device_index) {
  try {
    open(provider, bind_host, device_index);
  } catch (...) {
    close_all();
    throw;
  }
}

FabricRail::~FabricRail() { close_all(); }

struct fi_info* FabricRail::choose(const std::string& provider, const std::string& bind_host,
                                   size_t device_index, bool want_source) {
  const bool pin_host = !bind_host.empty() && uses_socket_addresses(provider);
  struct fi_info* all = nullptr;
  struct fi_info* hints = make_hints(provider, want_source);
  int rc = fi_getinfo(kFabricApiVersion, pin_host ? bind_host.c_str() : nullptr, nullptr,
                      pin_host ? FI_SOURCE : 0, hints, &all);
  fi_freeinfo(hints);
  if (rc) {
    if (want_source) return nullptr;  // the caller asks again without FI_SOURCE
    throw FabricError("no libfabric provider '" + provider + "' with RDM+RMA here", rc);
  }

  // fi_getinfo lists one entry per NIC (and per address family): pick the n-th match.
  struct fi_info* chosen = nullptr;
  size_t seen = 0;
  for (auto* i = all; i; i = i->next) {
    if (!provider_matches(i->fabric_attr->prov_name, provider)) continue;
    if (seen++ == device_index) {
      chosen = i;
      break;
    }
  }
  if (!chosen && seen > 0) {
    // Fewer NICs than rails: rails share a NIC (each still gets its own endpoint).
    size_t want = device_index % seen, k = 0;
    for (auto* i = all; i; i = i->next)
      if (provider_matches(i->fabric_attr->prov_name, provider) && k++ == want) chosen = i;
  }
  struct fi_info* copy = chosen ? fi_dupinfo(chosen) : nullptr;
  fi_freeinfo(all);
  if (!copy && !want_source) throw EngineError("libfabric lists no endpoint for provider '" + provider + "'");
  return copy;
}

void FabricRail::open(const std::string& provider, const std::string& bind_host,
                      size_t device_index) {
  // With FI_SOURCE where the provider offers it (net), else without (tcp in 1.17).
  info_ = choose(provider, bind_host, device_index, true);
  if (!info_) info_ = choose(provider, bind_host, device_index, false);

  const uint64_t mr_mode = info_->domain_attr->mr_mode;
  caps_.provider = info_->fabric_attr->prov_name;
  caps_.fabric_name = info_->fabric_attr->name ? info_->fabric_attr->name : "";
  caps_.domain_name = info_->domain_attr->name ? info_->domain_attr->name : "";
  // FI_MR_BASIC (legacy) means provider keys and virtual addresses.
  caps_.virt_addr = (mr_mode & FI_MR_VIRT_ADDR) || (mr_mode & FI_MR_BASIC);
  caps_.prov_key = (mr_mode & FI_MR_PROV_KEY) || (mr_mode & FI_MR_BASIC);
  caps_.mr_local = mr_mode & FI_MR_LOCAL;
  caps_.mr_endpoint = mr_mode & FI_MR_ENDPOINT;
  caps_.rx_cq_data = info_->mode & FI_RX_CQ_DATA;
  caps_.cq_data_size = info_->domain_attr->cq_data_size;
  caps_.iov_limit = std::max<size_t>(
      1, std::min(info_->tx_attr->iov_limit, info_->tx_attr->rma_iov_limit));
  caps_.tx_size = info_->tx_attr->size;
  caps_.rx_size = info_->rx_attr->size;
  caps_.inject_size = info_->tx_attr->inject_size;
  // shm in libfabric 1.17 grants FI_SOURCE but names every sender fi_addr 0 (measured: an
  // outside engine's immediate read as the bound peer's), so it cannot tell senders apart.
  caps_.source = (info_->caps & FI_SOURCE) && caps_.provider != "shm";

  check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
  check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");

  struct fi_av_attr av_attr = {};
  av_attr.type = FI_AV_TABLE;
  check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open");

  struct fi_cq_attr cq_attr = {};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = kCqSize;
  // A wait fd lets the idle worker sleep in epoll instead of spinning on two cores;
  // providers without one are polled with short sleeps.
  cq_attr.wait_obj = FI_WAIT_FD;
  if (fi_cq_open(domain_, &cq_attr, &cq_, nullptr) == 0) {
    if (fi_control(&cq_->fid, FI_GETWAIT, &wait_fd_) != 0) wait_fd_ = -1;
  } else {
    cq_attr.wait_obj = FI_WAIT_NONE;
    check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open");
  }
  caps_.has_wait_fd = wait_fd_ >= 0;

  check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint");
  check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
  check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  check(fi_enable(ep_), "fi_enable");
  // After fi_enable: the endpoint's sockets and poll set exist by then.
  if (wait_fd_ >= 0) sleep_fd_ = provider_poll_set_fd(wait_fd_, &caps_.sleeps_on);

  char name[1024];
  size_t len = sizeof name;
  check(fi_getname(&ep_->fid, name, &len), "fi_getname");
  address_.assign(name, len);
}

void FabricRail::close_all() noexcept {
  if (ep_) fi_close(&ep_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (av_) fi_close(&av_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  ep_ = nullptr;
  cq_ = nullptr;
  av_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

namespace {

// 64 bits from the kernel's CSPRNG: a memory key is a capability, so it must not be guessable.
uint64_t random_mr_key() {
  uint64_t key = 0;
  char* out = reinterpret_cast<char*>(&key);
  size_t got = 0;
  while (got < sizeof key) {
    ssize_t n = getrandom(out + got, sizeof key - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw EngineError(std::string("getrandom for a memory key failed: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  return key;
}

// Random keys collide with one already in use about never (n^2 / 2^65); a retry covers it.
constexpr int kKeyAttempts = 4;

}  // namespace

RailRegistration FabricRail::register_region(void* addr, size_t length) {
  RailRegistration reg;
  struct fid_mr* mr = nullptr;
  uint64_t access = FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  int rc = -FI_ENOKEY;
  for (int attempt = 0; attempt < kKeyAttempts && rc == -FI_ENOKEY; ++attempt)
    rc = fi_mr_reg(domain_, addr, length, access, 0, caps_.prov_key ? 0 : random_mr_key(), 0, &mr, nullptr);
  check(rc, "fi_mr_reg");
  if (caps_.mr_endpoint) {
    int rc = fi_mr_bind(mr, &ep_->fid, 0);
    if (!rc) rc = fi_mr_enable(mr);
    if (rc) {
      fi_close(&mr->fid);
      throw FabricError("fi_mr_bind/enable", rc);
    }
  }
  reg.mr = mr;
  reg.local_desc = fi_mr_desc(mr);
  reg.key = fi_mr_key(mr);
  reg.remote_base = caps_.virt_addr ? reinterpret_cast<uint64_t>(addr) : 0;
  return reg;
}

void FabricRail::deregister(RailRegistration& reg) {
  if (reg.mr) fi_close(&static_cast<struct fid_mr*>(reg.mr)->fid);
  reg.mr = nullptr;
}

fi_addr_t FabricRail::insert_peer(const std::string& raw_address) {
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int n = fi_av_insert(av_, raw_address.data(), 1, &addr, 0, nullptr);
  if (n != 1) throw FabricError("fi_av_insert", n < 0 ? n : -FI_EINVAL);
  return addr;
}

void FabricRail::remove_peer(fi_addr_t addr) { fi_av_remove(av_, &addr, 1, 0); }

ssize_t FabricRail::post_write(const struct fi_msg_rma& msg, uint64_t flags) {
  return fi_writemsg(ep_, &msg, flags);
}

ssize_t FabricRail::post_send(const struct fi_msg& msg, uint64_t flags) {
  return fi_sendmsg(ep_, &msg, flags);
}

ssize_t FabricRail::post_recv(void* buf, size_t len, void* desc, void* context) {
  return fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, context);
}

ssize_t FabricRail::read_completions(struct fi_cq_data_entry* entries, size_t count) {
  ssize_t n;
  if (caps_.source) {
    if (sources_.size() < count) sources_.resize(count);
    n = fi_cq_readfrom(cq_, entries, count, sources_.data());
  } else {
    n = fi_cq_read(cq_, entries, count);
  }
  if (n == -FI_EAGAIN) return 0;
  return n;
}

bool FabricRail::read_error(struct fi_cq_err_entry* entry, std::string* message) {
  std::memset(entry, 0, sizeof *entry);
  ssize_t n = fi_cq_readerr(cq_, entry, 0);
  if (n != 1) return false;
  const char* detail = fi_cq_strerror(cq_, entry->prov_errno, entry->err_data, nullptr, 0);
  *message = std::string(fi_strerror(entry->err)) + (detail ? std::string(" (") + detail + ")" : "");
  return true;
}

bool FabricRail::try_wait() {
  if (wait_fd_ < 0) return false;
  struct fid* fids[1] = {&cq_->fid};
  return fi_trywait(fabric_, fids, 1) == FI_SUCCESS;
}

}  // namespace kvxfer
