// k3/core/arch/target.hpp — the target primitives (floating-point control word, prefetch,
// spin-wait hint) for the architecture being compiled for: each file below is empty unless it
// is the one (k3/core/arch/tags.hpp decides), and everything else calls k3::detail::target::*.
#pragma once

#include "k3/core/arch/aarch64.hpp"
#include "k3/core/arch/generic.hpp"
#include "k3/core/arch/tags.hpp"
#include "k3/core/arch/x86_64.hpp"
