// k3/core/cpu_info.hpp — the cache sizes the host reports, from which the memory tuning of the
// streaming kernels takes its defaults (k3::quant::tuning, k3::attnres::tuning). Results never
// depend on them, only speed.
#pragma once
#include <cctype>
#include <cstddef>
#include <fstream>
#include <string>
#include <unistd.h>

namespace k3 {

// Bytes of one instance of each level as the core running the call sees it: its L1 data cache,
// its L2 and the L3 it shares. 0: not reported.
struct cache_sizes {
  std::size_t l1d = 0, l2 = 0, l3 = 0;
};

namespace detail {

// "48K", "2048K", "32M", "1G" or plain bytes (sysfs's spelling); 0 for anything else.
inline std::size_t parse_cache_size(std::string const& s) noexcept {
  std::size_t i = 0, v = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    if (v > (std::size_t(-1) >> 12)) return 0;  // no cache is that large: a corrupt file
    v = v * 10 + static_cast<std::size_t>(s[i++] - '0');
  }
  if (i == 0) return 0;
  std::size_t unit = 1;
  if (i < s.size()) {
    char const c = static_cast<char>(std::toupper(static_cast<unsigned char>(s[i++])));
    unit = c == 'K' ? std::size_t(1) << 10 : c == 'M' ? std::size_t(1) << 20 : c == 'G' ? std::size_t(1) << 30 : 0;
  }
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return i == s.size() ? v * unit : 0;
}

// Linux: /sys/devices/system/cpu/cpu0/cache/index*/{level,type,size}.
inline cache_sizes read_sysfs_cache_sizes(std::string const& dir = "/sys/devices/system/cpu/cpu0/cache") {
  cache_sizes c;
  for (int i = 0; i < 16; ++i) {
    std::string const base = dir + "/index" + std::to_string(i) + "/";
    std::ifstream level_in(base + "level"), type_in(base + "type"), size_in(base + "size");
    std::string level, type, size;
    if (!(level_in >> level) || !(type_in >> type) || !(size_in >> size)) continue;
    if (type == "Instruction") continue;
    std::size_t const bytes = parse_cache_size(size);
    if (level == "1" && type == "Data") c.l1d = bytes;
    if (level == "2") c.l2 = bytes;
    if (level == "3") c.l3 = bytes;
  }
  return c;
}

}  // namespace detail

// The host's caches, read once (sysfs, else the C library's sysconf, else 0).
inline cache_sizes host_cache_sizes() noexcept {
  static cache_sizes const c = []() noexcept {
    cache_sizes r;
    try {
      r = detail::read_sysfs_cache_sizes();
    } catch (...) {  // an allocation failure leaves the sizes unknown
    }
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
    auto const conf = [](int name) { long const v = ::sysconf(name); return v > 0 ? static_cast<std::size_t>(v) : std::size_t(0); };
    if (r.l1d == 0) r.l1d = conf(_SC_LEVEL1_DCACHE_SIZE);
    if (r.l2 == 0) r.l2 = conf(_SC_LEVEL2_CACHE_SIZE);
    if (r.l3 == 0) r.l3 = conf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return r;
  }();
  return c;
}

}  // namespace k3
