// k3/backend/simt/arch/ucontext.hpp — the portable fiber context switch of the SIMT host
// runtime (POSIX ucontext), for targets without a hand-written switch. Slower: swapcontext
// saves and restores the signal mask with a system call.
#pragma once
#ifndef K3_SIMT_BOOKKEEPING
#define K3_SIMT_BOOKKEEPING
#endif
#include <ucontext.h>

#include <cstddef>
#include <cstdint>

namespace k3::simt::arch {

struct ucontext {
  static constexpr char const* name() noexcept { return "ucontext"; }

  struct context {
    ucontext_t uc{};
  };

  static void prepare(context& c, void* base, std::size_t size, void (*entry)(void*), void* arg) noexcept {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = base;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    // makecontext passes int arguments: the pointers travel as two 32-bit halves.
    auto const e = reinterpret_cast<std::uintptr_t>(entry), a = reinterpret_cast<std::uintptr_t>(arg);
    makecontext(&c.uc, reinterpret_cast<void (*)()>(&trampoline), 4, unsigned(e >> 32), unsigned(e), unsigned(a >> 32), unsigned(a));
  }

  using handle = ucontext_t const*;
  K3_SIMT_BOOKKEEPING static handle resume_handle(context const& c) noexcept { return &c.uc; }

  static void jump(context& from, handle to) noexcept { swapcontext(&from.uc, to); }

 private:
  static void trampoline(unsigned eh, unsigned el, unsigned ah, unsigned al) {
    auto const e = (std::uintptr_t(eh) << 32) | el, a = (std::uintptr_t(ah) << 32) | al;
    reinterpret_cast<void (*)(void*)>(e)(reinterpret_cast<void*>(a));
  }
};

}  // namespace k3::simt::arch
