// k3/backend/simt/arch/x86_64.hpp — the fiber context switch of the SIMT host runtime on
// x86-64 (System V ABI): six callee-saved registers pushed on the running stack, the stack
// pointer swapped. No system call (ucontext's swapcontext saves the signal mask with one),
// so a warp shuffle, which switches through all 32 lanes, costs tens of nanoseconds.
#pragma once
#ifndef K3_SIMT_BOOKKEEPING
#define K3_SIMT_BOOKKEEPING
#endif
#include <cstddef>
#include <cstdint>

// Defined in a COMDAT section so that every translation unit may carry it (as an inline
// function) and the linker keeps one copy.
__asm__(R"(
  .pushsection .text.k3_simt_switch_x86_64,"axG",@progbits,k3_simt_switch_x86_64,comdat
  .weak k3_simt_switch_x86_64
  .hidden k3_simt_switch_x86_64
  .type k3_simt_switch_x86_64,@function
k3_simt_switch_x86_64:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size k3_simt_switch_x86_64, .-k3_simt_switch_x86_64
  .popsection
  .pushsection .text.k3_simt_start_x86_64,"axG",@progbits,k3_simt_start_x86_64,comdat
  .weak k3_simt_start_x86_64
  .hidden k3_simt_start_x86_64
  .type k3_simt_start_x86_64,@function
k3_simt_start_x86_64:
  movq %r12, %rdi
  xorl %ebp, %ebp
  callq *%r13
  ud2
  .size k3_simt_start_x86_64, .-k3_simt_start_x86_64
  .popsection
)");

extern "C" {
__attribute__((visibility("hidden"))) void k3_simt_switch_x86_64(void** save, void* load);
__attribute__((visibility("hidden"))) void k3_simt_start_x86_64();
}

namespace k3::simt::arch {

struct x86_64 {
  static constexpr char const* name() noexcept { return "x86_64"; }

  // A context that, when first switched to, calls entry(arg) on the stack [base, base + size).
  // entry must never return (it switches away for good instead).
  struct context {
    void* sp = nullptr;
  };

  static void prepare(context& c, void* base, std::size_t size, void (*entry)(void*), void* arg) noexcept {
    auto top = (reinterpret_cast<std::uintptr_t>(base) + size) & ~std::uintptr_t(15);
    // After the switch pops six registers and returns into the trampoline, the stack pointer is
    // 16-byte aligned at the trampoline's call, as the ABI asks.
    auto* slot = reinterpret_cast<void**>(top - 24);
    slot[0] = reinterpret_cast<void*>(&k3_simt_start_x86_64);  // return address
    slot[-1] = nullptr;                                         // rbp
    slot[-2] = nullptr;                                         // rbx
    slot[-3] = arg;                                             // r12
    slot[-4] = reinterpret_cast<void*>(entry);                  // r13
    slot[-5] = nullptr;                                         // r14
    slot[-6] = nullptr;                                         // r15
    c.sp = slot - 6;
  }

  // What jump needs of the context to resume (read before a race detector is told of the
  // switch, so that the read is the switching thread's).
  using handle = void*;
  K3_SIMT_BOOKKEEPING static handle resume_handle(context const& c) noexcept { return c.sp; }

  // Saves the running context in `from` and resumes the one `to` was taken from.
  static void jump(context& from, handle to) noexcept { k3_simt_switch_x86_64(&from.sp, to); }
};

}  // namespace k3::simt::arch
