#!/usr/bin/env python3
"""The PyTorch KDA a user would otherwise run on a CPU, timed on bench_kda's shapes.

What it times: the naive chunked KDA forward in PyTorch, written after the structure of fla's
reference `naive_chunk_kda` (fla/ops/kda/naive.py: the chunk-local WY form, chunk 64, Python
loops over the chunk's positions and over the chunks), eager and under torch.compile, float32,
B = 1, H = 16, K = V = 128 (bench_kda's shape), inputs drawn as bench_kda draws them (unit q and
k rows, g = -5 sigmoid(n), beta = sigmoid(n)). torch.compile wraps the two loop bodies (the
intra-chunk matrix over all chunks, and one chunk's step) rather than the whole function: the
whole function unrolls into T/64 x 64 einsums, whose compilation takes longer than the runs.

Each figure is a median of --reps runs interleaved with a same-run yardstick: torch.matmul of
two 1024 x 1024 float matrices on torch's threads (the counterpart of bench_kda's Eigen GEMM),
and GFLOP/s use bench_kda's count (Kimi Linear's 6Td^2 + 3TCd + TC^2 per head).
--threads defaults to 1, set against k3's one-thread backends (cpu::serial, cpu::simd): on the
shared 2-vCPU VM two torch threads made the eager loop ~18x slower (each of its thousands of
small ops waits at a thread barrier for a descheduled thread).
Output: a table on stdout and, with --csv FILE, the CSV rows of benchmarks/common/bench.hpp.

Before timing it checks the chunked form against a float64 NumPy serial recurrence (the
definition k3's own tests use: S <- diag(exp g) S; S += beta k (v - S^T k)^T; o = S^T (scale q))
on a small shape and prints the relative RMS error.

Needs: Python 3, NumPy, PyTorch (any build; the CPU is used). Without torch it prints
"torch not installed: PyTorch comparison skipped" and exits 0.
Usage: torch_kda.py [--T 256,512,...] [--reps 3] [--threads N] [--no-compile] [--csv FILE]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

try:
    import torch
except ImportError:
    print("torch not installed: PyTorch comparison skipped")
    sys.exit(0)


def intra_chunk(k, g, beta, v):
    """Per chunk: the WY factors w = A (exp(g) k) and u = A v, A = (I + tril(beta k_i k_j decay))^-1 beta.
    k, g: [B, H, N, C, K]; beta: [B, H, N, C]; v: [B, H, N, C, V]; g is the chunk-local cumsum."""
    C = k.shape[-2]
    A = torch.zeros(*k.shape[:-1], C, dtype=k.dtype, device=k.device)
    for i in range(C):
        A[..., i] = torch.einsum("...cd,...d->...c", k * (g - g[..., i : i + 1, :]).exp(), k[..., i, :])
    A = A * beta[..., None]
    A = -A.masked_fill(torch.triu(torch.ones(C, C, dtype=torch.bool, device=k.device), diagonal=0), 0)
    for i in range(1, C):  # forward substitution, row by row
        A[..., i, :i] = A[..., i, :i].clone() + (A[..., i, :, None].clone() * A[..., :, :i].clone()).sum(-2)
    A = (A + torch.eye(C, dtype=k.dtype, device=k.device)) * beta[..., None, :]
    return A @ (g.exp() * k), A @ v


def chunk_step(S, q_i, k_i, u_i, g_i, w_i):
    """One chunk: outputs and the state after it. q_i, k_i, g_i: [B, H, C, K]; u_i: [B, H, C, V]."""
    C = q_i.shape[-2]
    A = torch.zeros(*q_i.shape[:-1], C, dtype=q_i.dtype, device=q_i.device)
    for j in range(C):
        A[..., j] = torch.einsum("...cd,...d->...c", q_i * (g_i - g_i[..., j : j + 1, :]).exp(), k_i[..., j, :])
    A = A.masked_fill(torch.triu(torch.ones(C, C, dtype=torch.bool, device=q_i.device), diagonal=1), 0)
    v_i = u_i - w_i @ S
    o_i = (q_i * g_i.exp()) @ S + A @ v_i
    S = S * g_i[..., -1, :, None].exp()
    S = S + ((g_i[..., -1:, :] - g_i).exp() * k_i).transpose(-1, -2) @ v_i
    return o_i, S


def naive_chunk_kda(q, k, v, g, beta, scale=None, chunk=64, intra=intra_chunk, step=chunk_step):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; T % chunk == 0. Returns o [B, T, H, V], S [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = T // chunk
    scale = K**-0.5 if scale is None else scale

    def split(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(B, N, chunk, H, *x.shape[3:]).float()
        return x.permute(0, 3, 1, 2, *range(4, x.dim())).contiguous()

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    q = q * scale
    g = g.cumsum(-2)
    w, u = intra(k, g, beta, v)
    S = q.new_zeros(B, H, K, V)
    o = torch.empty_like(v)
    for i in range(N):
        o[:, :, i], S = step(S, q[:, :, i], k[:, :, i], u[:, :, i], g[:, :, i], w[:, :, i])
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S


def recurrent_f64(q, k, v, g, beta, scale):
    """Float64 serial recurrence (NumPy), the reference: [B, T, H, *] arrays."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, V))
            for t in range(T):
                S = np.exp(g[b, t, h])[:, None] * S
                kt = k[b, t, h]
                S = S + beta[b, t, h] * np.outer(kt, v[b, t, h] - S.T @ kt)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
    return o


def make_inputs(B, T, H, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=gen)
    q = torch.nn.functional.normalize(n(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(n(B, T, H, K), dim=-1)
    v = n(B, T, H, V)
    g = -5.0 * torch.sigmoid(n(B, T, H, K))  # fla's lower-bounded gate, lb = -5
    beta = torch.sigmoid(n(B, T, H))
    return q, k, v, g, beta


def check():
    B, T, H, K, V = 1, 128, 2, 32, 32
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=5)
    o, _ = naive_chunk_kda(q, k, v, g, beta)
    ref = recurrent_f64(*(x.double().numpy() for x in (q, k, v, g, beta)), K**-0.5)
    err = np.sqrt(np.mean((o.double().numpy() - ref) ** 2) / np.mean(ref**2))
    print(f"# check: naive chunked KDA (float32, eager) vs float64 serial recurrence, B={B} T={T} H={H} K=V={K}: rel RMS {err:.2e}")
    return err


CSV_HEADER = "benchmark,op,form,backend,shape,T,median_s,throughput,unit,tokens_per_s,yardstick,yardstick_rate,yardstick_unit,ratio,isa,threads\n"


def cpu_isa():
    try:
        flags = open("/proc/cpuinfo").read()
        return "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "unknown")
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="256,512,1024,2048,4096")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)  # see the note in the docstring
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    err = check()
    if not err < 1e-4:
        print("FAIL: the PyTorch reference does not match the recurrence")
        return 1
    B, H, K, V, C = a.B, a.H, a.K, a.K, 64
    x1, x2 = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def gemm():
        t0 = time.perf_counter()
        torch.matmul(x1, x2)
        return 2 * 1024**3 / (time.perf_counter() - t0) * 1e-9

    gemm()
    variants = [("torch_eager", dict())]
    if not a.no_compile:
        variants.append(("torch_compile", dict(intra=torch.compile(intra_chunk), step=torch.compile(chunk_step))))
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, cpu {cpu_isa()}")
    print("# naive chunked KDA forward (fla naive_chunk_kda structure), float32, chunk 64; GFLOP/s: bench_kda's count")
    print(f"{'T':>7} {'backend':>14} {'fwd ms':>10} {'tok/s':>10} {'GFLOP/s':>8} {'yard GF/s':>10} {'ratio':>6}  (compile s)")
    if a.csv and (not os.path.exists(a.csv) or os.path.getsize(a.csv) == 0):
        with open(a.csv, "w") as f:
            f.write(CSV_HEADER)
    for T in [int(t) for t in a.T.split(",") if t]:
        q, k, v, g, beta = make_inputs(B, T, H, K, V)
        flops = H * (6.0 * T * K * K + 3.0 * T * C * K + T * C * C) * B
        for name, kw in variants:
            with torch.no_grad():
                t0 = time.perf_counter()
                naive_chunk_kda(q, k, v, g, beta, **kw)  # warm-up (and compilation)
                warm = time.perf_counter() - t0
                ts, ys = [], []
                for _ in range(a.reps):
                    ys.append(gemm())
                    t0 = time.perf_counter()
                    naive_chunk_kda(q, k, v, g, beta, **kw)
                    ts.append(time.perf_counter() - t0)
                ys.append(gemm())
            t, y = statistics.median(ts), statistics.median(ys)
            gf = flops / t * 1e-9
            print(f"{T:7d} {name:>14} {t * 1e3:10.1f} {B * T / t:10.0f} {gf:8.2f} {y:10.1f} {gf / y:6.3f}  ({warm:.1f})", flush=True)
            shape = f"B={B};T={T};H={H};K={K};V={V}"
            row = (f"kda,forward,naive_chunk,{name},{shape},{T},{t:.6g},{gf:.6g},GFLOP/s,{B * T / t:.6g},"
                        f"torch_matmul_1024_{torch.get_num_threads()}t,{y:.6g},GFLOP/s,{gf / y:.6g},{cpu_isa()},{torch.get_num_threads()}\n")
            if a.csv:
                with open(a.csv, "a") as f:
                    f.write(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
