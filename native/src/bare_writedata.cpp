// The "what libfabric alone does" baseline for the benchmarks: a minimal fi_writemsg
// loop between two processes (forked here), with remote CQ data counted at the target.
// No kvxfer code: one endpoint per rail, one write at a time unless --window says otherwise.
//
//   kvxfer-bare-writedata --provider net --size 16384 --count 20000 [--window 1] [--rails 1]
//                         [--region 268435456] [--random] [--host 127.0.0.1]
//                         [--delivery-complete]
// --window: writes in flight per rail. --rails N: N endpoints (each its own fabric, domain,
// CQ) in each process, as the engine's rails are; writes go round-robin over them, so the
// deep-window baseline of an engine is --window max_inflight_per_rail --rails rails.
// --delivery-complete: a write completes once the target holds it (as kvxfer's writes do by
// default), so window 1 measures a full round trip: the latency floor under the engine.
// Prints one JSON line: provider, size, count, window, rails, seconds, gbytes_per_s,
// ops_per_s, and the CPU seconds (getrusage, all threads) each process spent in the timed
// loop: initiator_cpu_s from its first post to its last completion, target_cpu_s from its
// first arrival to its last (the target busy-polls, as a bare loop does).
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

struct Options {
  std::string provider = "net";
  std::string host = "127.0.0.1";
  size_t size = 16384;
  size_t count = 10000;
  size_t window = 1;
  size_t rails = 1;
  size_t region = 256u << 20;
  bool random = false;
  bool delivery_complete = false;
};

[[noreturn]] void die(const char* what, int rc) {
  std::fprintf(stderr, "bare-writedata: %s: %s\n", what, fi_strerror(-rc));
  std::exit(2);
}

struct Endpoint {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  bool virt_addr = false, mr_local = false, mr_endpoint = false;

  explicit Endpoint(const Options& o) {
    fi_info* hints = fi_allocinfo();
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(o.provider.c_str());
    bool sock = o.provider != "shm";
    int rc = fi_getinfo(FI_VERSION(1, 14), sock ? o.host.c_str() : nullptr, nullptr, sock ? FI_SOURCE : 0, hints, &info);
    if (rc) die("fi_getinfo", rc);
    fi_freeinfo(hints);
    uint64_t mm = info->domain_attr->mr_mode;
    virt_addr = (mm & FI_MR_VIRT_ADDR) || (mm & FI_MR_BASIC);
    mr_local = mm & FI_MR_LOCAL;
    mr_endpoint = mm & FI_MR_ENDPOINT;
    if ((rc = fi_fabric(info->fabric_attr, &fabric, nullptr))) die("fi_fabric", rc);
    if ((rc = fi_domain(fabric, info, &domain, nullptr))) die("fi_domain", rc);
    fi_av_attr av_attr = {};
    av_attr.type = FI_AV_TABLE;
    if ((rc = fi_av_open(domain, &av_attr, &av, nullptr))) die("fi_av_open", rc);
    fi_cq_attr cq_attr = {};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 4096;
    if ((rc = fi_cq_open(domain, &cq_attr, &cq, nullptr))) die("fi_cq_open", rc);
    if ((rc = fi_endpoint(domain, info, &ep, nullptr))) die("fi_endpoint", rc);
    fi_ep_bind(ep, &av->fid, 0);
    fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV);
    if ((rc = fi_enable(ep))) die("fi_enable", rc);
  }
  fid_mr* reg(void* buf, size_t len, uint64_t key) {
    fid_mr* mr = nullptr;
    int rc = fi_mr_reg(domain, buf, len, FI_WRITE | FI_REMOTE_WRITE, 0, key, 0, &mr, nullptr);
    if (rc) die("fi_mr_reg", rc);
    if (mr_endpoint) {
      fi_mr_bind(mr, &ep->fid, 0);
      fi_mr_enable(mr);
    }
    return mr;
  }
  // Reads completions; returns how many, dies on an error entry.
  size_t poll() {
    fi_cq_data_entry e[64];
    ssize_t n = fi_cq_read(cq, e, 64);
    if (n == -FI_EAGAIN) return 0;
    if (n < 0) {
      fi_cq_err_entry err = {};
      fi_cq_readerr(cq, &err, 0);
      die("completion error", -err.err);
    }
    return static_cast<size_t>(n);
  }
};

constexpr size_t kMaxRails = 16;

struct TargetRail {
  char name[256];
  size_t name_len;
  uint64_t key;
  uint64_t base;
};
struct TargetInfo {
  TargetRail rails[kMaxRails];
};
struct InitiatorResult {
  double seconds;
  double cpu_s;
};

double cpu_seconds() {
  struct rusage ru = {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "missing value for %s\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--provider") o.provider = next();
    else if (a == "--host") o.host = next();
    else if (a == "--size") o.size = std::stoull(next());
    else if (a == "--count") o.count = std::stoull(next());
    else if (a == "--window") o.window = std::stoull(next());
    else if (a == "--rails") o.rails = std::stoull(next());
    else if (a == "--region") o.region = std::stoull(next());
    else if (a == "--random") o.random = true;
    else if (a == "--delivery-complete") o.delivery_complete = true;
    else {
      std::fprintf(stderr, "usage: %s --provider P --size BYTES --count N [--window W] [--rails R] [--region BYTES] [--random]"
                           " [--delivery-complete]\n", argv[0]);
      return 2;
    }
  }
  if (o.size > o.region) o.region = o.size;
  if (o.rails == 0 || o.rails > kMaxRails || o.window == 0) {
    std::fprintf(stderr, "--rails must be 1..%zu and --window >= 1\n", kMaxRails);
    return 2;
  }
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) return 2;
  pid_t pid = fork();
  if (pid == 0) {  // initiator
    TargetInfo t;
    if (read(to_child[0], &t, sizeof t) != sizeof t) return 2;
    std::vector<std::unique_ptr<Endpoint>> eps;
    std::vector<fi_addr_t> dest(o.rails);
    std::vector<void*> desc(o.rails);
    std::vector<char> src(o.region, 7);
    for (size_t r = 0; r < o.rails; ++r) {
      eps.push_back(std::make_unique<Endpoint>(o));
      if (fi_av_insert(eps[r]->av, t.rails[r].name, 1, &dest[r], 0, nullptr) != 1) die("fi_av_insert", -FI_EINVAL);
      desc[r] = fi_mr_desc(eps[r]->reg(src.data(), src.size(), 2));
    }
    size_t slots = o.region / o.size;
    std::mt19937_64 rng(1);
    std::vector<size_t> inflight(o.rails, 0);
    double cpu0 = cpu_seconds();
    auto start = std::chrono::steady_clock::now();
    size_t posted = 0, done = 0, rail = 0;
    while (done < o.count) {
      // Round-robin over the rails; a rail whose window is full (or whose provider queue
      // is) is skipped until its completions are read.
      for (size_t tries = 0; posted < o.count && tries < o.rails;) {
        size_t r = rail;
        if (inflight[r] >= o.window) {
          rail = (rail + 1) % o.rails;
          ++tries;
          continue;
        }
        size_t slot = o.random ? rng() % slots : posted % slots;
        struct iovec iov = {src.data() + slot * o.size, o.size};
        struct fi_rma_iov rma = {t.rails[r].base + slot * o.size, o.size, t.rails[r].key};
        struct fi_msg_rma msg = {};
        msg.msg_iov = &iov;
        msg.desc = &desc[r];
        msg.iov_count = 1;
        msg.addr = dest[r];
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.data = posted;
        uint64_t flags = FI_COMPLETION | FI_REMOTE_CQ_DATA;
        if (o.delivery_complete) flags |= FI_DELIVERY_COMPLETE;
        ssize_t rc = fi_writemsg(eps[r]->ep, &msg, flags);
        if (rc == -FI_EAGAIN) {
          rail = (rail + 1) % o.rails;
          ++tries;
          continue;
        }
        if (rc) die("fi_writemsg", static_cast<int>(rc));
        ++posted;
        ++inflight[r];
        tries = 0;
        rail = (rail + 1) % o.rails;
      }
      for (size_t r = 0; r < o.rails; ++r) {
        size_t n = eps[r]->poll();
        inflight[r] -= n;
        done += n;
      }
    }
    InitiatorResult res;
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    res.cpu_s = cpu_seconds() - cpu0;
    char ok = 1;
    if (write(to_parent[1], &res, sizeof res) != sizeof res) return 2;
    if (read(to_child[0], &ok, 1) != 1) return 2;  // target saw every immediate
    return 0;
  }
  // target
  std::vector<std::unique_ptr<Endpoint>> eps;
  std::vector<char> dst(o.region, 0);
  TargetInfo t = {};
  for (size_t r = 0; r < o.rails; ++r) {
    eps.push_back(std::make_unique<Endpoint>(o));
    fid_mr* mr = eps[r]->reg(dst.data(), dst.size(), 1);
    t.rails[r].name_len = sizeof t.rails[r].name;
    fi_getname(&eps[r]->ep->fid, t.rails[r].name, &t.rails[r].name_len);
    t.rails[r].key = fi_mr_key(mr);
    t.rails[r].base = eps[r]->virt_addr ? reinterpret_cast<uint64_t>(dst.data()) : 0;
  }
  if (write(to_child[1], &t, sizeof t) != sizeof t) return 2;
  size_t arrived = 0;
  double cpu_first = 0;
  auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (arrived < o.count) {
    for (size_t r = 0; r < o.rails; ++r) {
      size_t n = eps[r]->poll();
      if (n && arrived == 0) cpu_first = cpu_seconds();
      arrived += n;
    }
    if (std::chrono::steady_clock::now() > limit) { std::fprintf(stderr, "target timed out\n"); kill(pid, 9); return 3; }
  }
  double target_cpu = cpu_seconds() - cpu_first;
  InitiatorResult res = {};
  if (read(to_parent[0], &res, sizeof res) != sizeof res) return 2;
  char ok = 1;
  if (write(to_child[1], &ok, 1) != 1) return 2;
  int status = 0;
  waitpid(pid, &status, 0);
  double bytes = static_cast<double>(o.size) * o.count;
  std::printf("{\"provider\": \"%s\", \"size\": %zu, \"count\": %zu, \"window\": %zu, \"rails\": %zu, "
              "\"random\": %s, \"delivery_complete\": %s, "
              "\"seconds\": %.6f, \"gbytes_per_s\": %.4f, \"ops_per_s\": %.1f, "
              "\"initiator_cpu_s\": %.6f, \"target_cpu_s\": %.6f}\n",
              o.provider.c_str(), o.size, o.count, o.window, o.rails, o.random ? "true" : "false",
              o.delivery_complete ? "true" : "false", res.seconds,
              bytes / res.seconds / 1e9, o.count / res.seconds, res.cpu_s, target_cpu);
  return 0;
}
