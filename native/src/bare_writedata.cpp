// The "what libfabric alone does" baseline for the benchmarks: a minimal fi_writemsg
// loop between two processes (forked here), with remote CQ data counted at the target.
// No kvxfer code: one endpoint, one write at a time unless --window says otherwise.
//
//   kvxfer-bare-writedata --provider net --size 16384 --count 20000 [--window 1]
//                         [--region 268435456] [--random] [--host 127.0.0.1]
//                         [--delivery-complete]
// --delivery-complete: a write completes once the target holds it (as kvxfer's writes do by
// default), so window 1 measures a full round trip: the latency floor under the engine.
// Prints one JSON line: provider, size, count, window, seconds, gbytes_per_s, ops_per_s.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

struct TargetInfo {
  char name[256];
  size_t name_len;
  uint64_t key;
  uint64_t base;
};

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
    else if (a == "--region") o.region = std::stoull(next());
    else if (a == "--random") o.random = true;
    else if (a == "--delivery-complete") o.delivery_complete = true;
    else {
      std::fprintf(stderr, "usage: %s --provider P --size BYTES --count N [--window W] [--region BYTES] [--random]"
                           " [--delivery-complete]\n", argv[0]);
      return 2;
    }
  }
  if (o.size > o.region) o.region = o.size;
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) return 2;
  pid_t pid = fork();
  if (pid == 0) {  // initiator
    TargetInfo t;
    if (read(to_child[0], &t, sizeof t) != sizeof t) return 2;
    Endpoint ep(o);
    fi_addr_t dest;
    if (fi_av_insert(ep.av, t.name, 1, &dest, 0, nullptr) != 1) die("fi_av_insert", -FI_EINVAL);
    std::vector<char> src(o.region, 7);
    fid_mr* mr = ep.reg(src.data(), src.size(), 2);
    void* desc = fi_mr_desc(mr);
    size_t slots = o.region / o.size;
    std::mt19937_64 rng(1);
    auto start = std::chrono::steady_clock::now();
    size_t posted = 0, done = 0;
    while (done < o.count) {
      while (posted < o.count && posted - done < o.window) {
        size_t slot = o.random ? rng() % slots : posted % slots;
        struct iovec iov = {src.data() + slot * o.size, o.size};
        struct fi_rma_iov rma = {t.base + slot * o.size, o.size, t.key};
        struct fi_msg_rma msg = {};
        msg.msg_iov = &iov;
        msg.desc = &desc;
        msg.iov_count = 1;
        msg.addr = dest;
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.data = posted;
        uint64_t flags = FI_COMPLETION | FI_REMOTE_CQ_DATA;
        if (o.delivery_complete) flags |= FI_DELIVERY_COMPLETE;
        ssize_t rc = fi_writemsg(ep.ep, &msg, flags);
        if (rc == -FI_EAGAIN) break;
        if (rc) die("fi_writemsg", static_cast<int>(rc));
        ++posted;
      }
      done += ep.poll();
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char ok = 1;
    if (write(to_parent[1], &secs, sizeof secs) != sizeof secs) return 2;
    if (read(to_child[0], &ok, 1) != 1) return 2;  // target saw every immediate
    return 0;
  }
  // target
  Endpoint ep(o);
  std::vector<char> dst(o.region, 0);
  fid_mr* mr = ep.reg(dst.data(), dst.size(), 1);
  TargetInfo t = {};
  t.name_len = sizeof t.name;
  fi_getname(&ep.ep->fid, t.name, &t.name_len);
  t.key = fi_mr_key(mr);
  t.base = ep.virt_addr ? reinterpret_cast<uint64_t>(dst.data()) : 0;
  if (write(to_child[1], &t, sizeof t) != sizeof t) return 2;
  size_t arrived = 0;
  auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (arrived < o.count) {
    arrived += ep.poll();
    if (std::chrono::steady_clock::now() > limit) { std::fprintf(stderr, "target timed out\n"); kill(pid, 9); return 3; }
  }
  double secs = 0;
  if (read(to_parent[0], &secs, sizeof secs) != sizeof secs) return 2;
  char ok = 1;
  if (write(to_child[1], &ok, 1) != 1) return 2;
  int status = 0;
  waitpid(pid, &status, 0);
  double bytes = static_cast<double>(o.size) * o.count;
  std::printf("{\"provider\": \"%s\", \"size\": %zu, \"count\": %zu, \"window\": %zu, \"random\": %s, "
              "\"delivery_complete\": %s, "
              "\"seconds\": %.6f, \"gbytes_per_s\": %.4f, \"ops_per_s\": %.1f}\n",
              o.provider.c_str(), o.size, o.count, o.window, o.random ? "true" : "false",
              o.delivery_complete ? "true" : "false", secs,
              bytes / secs / 1e9, o.count / secs);
  return 0;
}
