// k3/core/cpu_info.hpp: the CPUID vendor agrees with what the kernel reports for the same CPU.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "k3/core/cpu_info.hpp"

TEST_CASE("host_cpu_vendor matches /proc/cpuinfo's vendor_id and is stable") {
  using k3::detail::cpu_vendor;
  cpu_vendor const v = k3::detail::host_cpu_vendor();
  CHECK(k3::detail::host_cpu_vendor() == v);
  std::ifstream in("/proc/cpuinfo");
  std::string line, vendor;
  while (std::getline(in, line))
    if (line.rfind("vendor_id", 0) == 0) {
      vendor = line.substr(line.find(':') + 2);
      break;
    }
  if (vendor.empty()) {
    MESSAGE("no vendor_id in /proc/cpuinfo (not Linux on x86): only stability checked");
    return;
  }
  INFO("vendor_id: " << vendor);
  cpu_vendor const want = vendor == "GenuineIntel" ? cpu_vendor::intel : vendor == "AuthenticAMD" ? cpu_vendor::amd : cpu_vendor::other;
  CHECK(v == want);
}
