# Eigen, xsimd and threads: everything k3::k3 needs, all from Debian packages.
find_package(Threads REQUIRED)
find_package(Eigen3 CONFIG REQUIRED)  # unversioned on purpose: Eigen 5 would fail a "3.4" request
if(Eigen3_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "k3 needs Eigen >= 3.4, found ${Eigen3_VERSION}")
endif()
# Debian 12's xsimd 8.1 target names `xtl` in its link interface without finding it, which
# becomes `-lxtl` at link time; xtl is header-only, so satisfy the name.
find_package(xtl CONFIG QUIET)
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
find_package(xsimd CONFIG REQUIRED)  # the installed target is plain `xsimd`
