// k3/core/cpu_info.hpp: the cache sizes k3 reads agree with what the kernel reports, and the
// parser takes sysfs's spellings and rejects anything else.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "k3/core/cpu_info.hpp"

namespace {

// An independent reading of one level from sysfs (bytes; 0 when absent): `size` as "<n>K".
std::size_t sysfs_level(int level, bool data_only) {
  for (int i = 0; i < 16; ++i) {
    std::string const base = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream l(base + "level"), t(base + "type"), s(base + "size");
    int lv = 0;
    std::string type, size;
    if (!(l >> lv) || !(t >> type) || !(s >> size)) continue;
    if (lv != level || type == "Instruction" || (data_only && type != "Data")) continue;
    unsigned long n = 0;
    char unit = 0;
    if (std::sscanf(size.c_str(), "%lu%c", &n, &unit) < 1) return 0;
    return unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : n;
  }
  return 0;
}

void write(std::filesystem::path const& p, std::string const& text) {
  std::ofstream(p) << text << "\n";
}

}  // namespace

TEST_CASE("parse_cache_size: sysfs spellings, and 0 for anything else") {
  using k3::detail::parse_cache_size;
  CHECK(parse_cache_size("48K") == 48u << 10);
  CHECK(parse_cache_size("2048K") == 2u << 20);
  CHECK(parse_cache_size("32M") == 32u << 20);
  CHECK(parse_cache_size("1G") == std::size_t(1) << 30);
  CHECK(parse_cache_size("512") == 512u);
  CHECK(parse_cache_size("64k\n") == 64u << 10);
  CHECK(parse_cache_size("") == 0);
  CHECK(parse_cache_size("K") == 0);
  CHECK(parse_cache_size("12Q") == 0);
  CHECK(parse_cache_size("12KB") == 0);
  CHECK(parse_cache_size("-5K") == 0);
  CHECK(parse_cache_size("99999999999999999999999K") == 0);
}

TEST_CASE("read_sysfs_cache_sizes: levels and types from a cache directory, instruction caches skipped") {
  namespace fs = std::filesystem;
  fs::path const dir = fs::temp_directory_path() / ("k3_cache_sizes_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto index = [&](int i, char const* level, char const* type, char const* size) {
    fs::create_directories(dir / ("index" + std::to_string(i)));
    write(dir / ("index" + std::to_string(i)) / "level", level);
    write(dir / ("index" + std::to_string(i)) / "type", type);
    write(dir / ("index" + std::to_string(i)) / "size", size);
  };
  index(0, "1", "Data", "48K");
  index(1, "1", "Instruction", "32K");
  index(2, "2", "Unified", "2048K");
  index(3, "3", "Unified", "107520K");
  k3::cache_sizes const c = k3::detail::read_sysfs_cache_sizes(dir.string());
  CHECK(c.l1d == 48u << 10);
  CHECK(c.l2 == 2u << 20);
  CHECK(c.l3 == 105u << 20);
  fs::remove_all(dir / "index3");
  write(dir / "index2" / "size", "garbage");
  k3::cache_sizes const d = k3::detail::read_sysfs_cache_sizes(dir.string());
  CHECK(d.l1d == 48u << 10);
  CHECK(d.l2 == 0);
  CHECK(d.l3 == 0);
  CHECK(k3::detail::read_sysfs_cache_sizes((dir / "absent").string()).l2 == 0);
  fs::remove_all(dir);
}

TEST_CASE("host_cache_sizes matches the kernel's sysfs report and is stable") {
  k3::cache_sizes const c = k3::host_cache_sizes();
  CHECK(k3::host_cache_sizes().l2 == c.l2);
  std::size_t const l1 = sysfs_level(1, true), l2 = sysfs_level(2, false), l3 = sysfs_level(3, false);
  if (l1 == 0 && l2 == 0 && l3 == 0) {
    MESSAGE("no cache sizes in sysfs (not Linux?): only stability checked");
    return;
  }
  INFO("sysfs: L1d " << l1 << ", L2 " << l2 << ", L3 " << l3);
  if (l1) CHECK(c.l1d == l1);
  if (l2) CHECK(c.l2 == l2);
  if (l3) CHECK(c.l3 == l3);
}
