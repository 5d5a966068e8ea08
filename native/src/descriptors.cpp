#include "descriptors.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "engine_types.hpp"

namespace kvxfer {
namespace {

constexpr char kAddressMagic[4] = {'K', 'V', 'X', 'A'};
constexpr char kDescriptorMagic[4] = {'K', 'V', 'X', 'D'};
// 2: addresses carry a same-host identity, descriptors the region's virtual address and
// its shareable file (same_host_path.hpp). 3: writes without an immediate carry
// kTrafficOnlyWeight (rail_group.hpp), which a version-2 peer would count. 4: descriptors
// may list windows with their own keys (per-reservation registrations); the whole-region
// keys are then absent, so a version-3 reader would misread them.
constexpr uint16_t kWireVersion = 4;
// A reservation's windows: one per layer of a model (hundreds at most).
constexpr size_t kMaxWindows = 4096;
// Generous bounds that still stop a corrupt length from allocating gigabytes.
constexpr size_t kMaxRails = 64;
constexpr size_t kMaxRailAddressBytes = 4096;

uint32_t fnv1a(const char* data, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(data[i]);
    h *= 16777619u;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_bytes(const std::string& s) { out_.append(s); }
  std::string finish() {
    put<uint32_t>(fnv1a(out_.data(), out_.size()));
    return std::move(out_);
  }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const std::string& blob, const char* what) : blob_(blob), what_(what) {
    if (blob.size() < 4 + sizeof(uint32_t)) fail("too short");
    size_t body = blob.size() - sizeof(uint32_t);
    uint32_t stored;
    std::memcpy(&stored, blob.data() + body, sizeof stored);
    if (stored != fnv1a(blob.data(), body)) fail("checksum mismatch (truncated or corrupt)");
    end_ = body;
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, blob_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string get_bytes(size_t n) {
    need(n);
    std::string s = blob_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  void expect_magic(const char magic[4]) {
    if (get_bytes(4) != std::string(magic, 4)) fail("wrong magic: not a kvxfer " + std::string(what_));
    uint16_t version = get<uint16_t>();
    if (version != kWireVersion) fail("unsupported wire version " + std::to_string(version));
  }
  void expect_end() {
    if (pos_ != end_) fail("trailing bytes");
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw DescriptorError(std::string("malformed ") + what_ + ": " + why);
  }

 private:
  void need(size_t n) {
    if (pos_ + n > end_) fail("truncated");
  }
  const std::string& blob_;
  const char* what_;
  size_t pos_ = 0;
  size_t end_ = 0;
};

void write_address(Writer& w, const EngineAddress& a) {
  w.put<uint64_t>(a.engine_id);
  w.put<uint8_t>(static_cast<uint8_t>(a.provider.size()));
  w.put_bytes(a.provider);
  w.put<uint16_t>(static_cast<uint16_t>(a.rail_addresses.size()));
  for (const auto& r : a.rail_addresses) {
    w.put<uint16_t>(static_cast<uint16_t>(r.size()));
    w.put_bytes(r);
  }
  w.put<uint8_t>(static_cast<uint8_t>(a.same_host.host_key.size()));
  w.put_bytes(a.same_host.host_key);
  w.put<uint32_t>(a.same_host.pid);
  w.put<uint64_t>(a.same_host.table_addr);
  w.put<int32_t>(a.same_host.table_fd);
}

// Names a peer sends (provider, host key) end up in error messages and Python strings:
// only printable ASCII is accepted, so a corrupt name is a DescriptorError here rather than
// an undecodable string later (Python raised UnicodeDecodeError for fuzzed descriptors).
bool printable_ascii(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

EngineAddress read_address(Reader& r) {
  EngineAddress a;
  a.engine_id = r.get<uint64_t>();
  a.provider = r.get_bytes(r.get<uint8_t>());
  if (a.provider.empty() || !printable_ascii(a.provider)) r.fail("provider name is not printable ASCII");
  uint16_t rails = r.get<uint16_t>();
  if (rails == 0 || rails > kMaxRails) r.fail("rail count " + std::to_string(rails));
  for (uint16_t i = 0; i < rails; ++i) {
    uint16_t n = r.get<uint16_t>();
    if (n == 0 || n > kMaxRailAddressBytes) r.fail("rail address length " + std::to_string(n));
    a.rail_addresses.push_back(r.get_bytes(n));
  }
  a.same_host.host_key = r.get_bytes(r.get<uint8_t>());
  if (!printable_ascii(a.same_host.host_key)) r.fail("host key is not printable ASCII");
  a.same_host.pid = r.get<uint32_t>();
  a.same_host.table_addr = r.get<uint64_t>();
  a.same_host.table_fd = r.get<int32_t>();
  return a;
}

}  // namespace

std::string EngineAddress::serialize() const {
  Writer w;
  w.put_bytes(std::string(kAddressMagic, 4));
  w.put<uint16_t>(kWireVersion);
  write_address(w, *this);
  return w.finish();
}

EngineAddress EngineAddress::parse(const std::string& blob) {
  Reader r(blob, "engine address");
  r.expect_magic(kAddressMagic);
  EngineAddress a = read_address(r);
  r.expect_end();
  return a;
}

std::string MemoryDescriptor::serialize() const {
  Writer w;
  w.put_bytes(std::string(kDescriptorMagic, 4));
  w.put<uint16_t>(kWireVersion);
  write_address(w, owner);
  w.put<uint64_t>(region_id);
  w.put<uint64_t>(addr);
  w.put<uint64_t>(length);
  w.put<int32_t>(share_fd);
  w.put<uint64_t>(share_offset);
  w.put<uint16_t>(static_cast<uint16_t>(rails.size()));
  for (const auto& k : rails) {
    w.put<uint64_t>(k.base);
    w.put<uint64_t>(k.key);
  }
  w.put<uint16_t>(static_cast<uint16_t>(windows.size()));
  for (const auto& win : windows) {
    w.put<uint64_t>(win.offset);
    w.put<uint64_t>(win.length);
    for (const auto& k : win.rails) {
      w.put<uint64_t>(k.base);
      w.put<uint64_t>(k.key);
    }
  }
  return w.finish();
}

MemoryDescriptor MemoryDescriptor::parse(const std::string& blob) {
  Reader r(blob, "memory descriptor");
  r.expect_magic(kDescriptorMagic);
  MemoryDescriptor d;
  d.owner = read_address(r);
  d.region_id = r.get<uint64_t>();
  d.addr = r.get<uint64_t>();
  d.length = r.get<uint64_t>();
  d.share_fd = r.get<int32_t>();
  d.share_offset = r.get<uint64_t>();
  const size_t owner_rails = d.owner.rail_addresses.size();
  uint16_t rails = r.get<uint16_t>();
  if (rails != owner_rails && rails != 0)
    r.fail("descriptor has " + std::to_string(rails) + " rail keys for " + std::to_string(owner_rails) +
           " rail addresses");
  for (uint16_t i = 0; i < rails; ++i) {
    RemoteRailKey k;
    k.base = r.get<uint64_t>();
    k.key = r.get<uint64_t>();
    d.rails.push_back(k);
  }
  uint16_t windows = r.get<uint16_t>();
  if (windows > kMaxWindows) r.fail("window count " + std::to_string(windows));
  if ((rails == 0) == (windows == 0)) r.fail("descriptor needs either whole-region keys or windows, not both");
  uint64_t previous_end = 0;
  for (uint16_t i = 0; i < windows; ++i) {
    RemoteWindow win;
    win.offset = r.get<uint64_t>();
    win.length = r.get<uint64_t>();
    if (win.length == 0 || win.offset < previous_end || win.offset > d.length || win.length > d.length - win.offset)
      r.fail("window " + std::to_string(i) + " is empty, unsorted or outside the region");
    previous_end = win.offset + win.length;
    for (size_t k = 0; k < owner_rails; ++k) {
      RemoteRailKey key;
      key.base = r.get<uint64_t>();
      key.key = r.get<uint64_t>();
      win.rails.push_back(key);
    }
    d.windows.push_back(std::move(win));
  }
  r.expect_end();
  return d;
}

const RemoteRailKey* MemoryDescriptor::key_for(size_t rail, uint64_t offset, uint64_t length,
                                               uint64_t* window_offset) const {
  if (windows.empty()) {
    *window_offset = 0;
    return rail < rails.size() ? &rails[rail] : nullptr;
  }
  // The last window that starts at or before `offset` is the only one that can hold it.
  auto it = std::upper_bound(windows.begin(), windows.end(), offset,
                             [](uint64_t off, const RemoteWindow& w) { return off < w.offset; });
  if (it == windows.begin()) return nullptr;
  const RemoteWindow& w = *std::prev(it);
  if (offset - w.offset > w.length || length > w.length - (offset - w.offset) || rail >= w.rails.size())
    return nullptr;
  *window_offset = w.offset;
  return &w.rails[rail];
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

}  // namespace kvxfer
