"""Cross-check of `k3 kda` (the C++ API side is tests/kda/test_kda_views_state_types.cpp and
tests/dplr/test_dplr_views_maps.cpp): bfloat16 gates at a lower bound that bfloat16 cannot hold.

A lower-bounded gate lb * sigmoid(z) saturates at lb; stored as bfloat16 it is lb rounded to
bfloat16 (-4.3 -> -4.3125, below -4.3). `k3 kda --gate-lower-bound lb` must accept such a g
(it is the bound as the storage type holds it) and compute the same numbers as without the
option, against a float64 reference written here from shared/spec/kda.md 1.1; one bfloat16
step further down must still be refused, naming --gate-lower-bound.

`k3 kda --threads N` (as `k3 dplr` and `k3 attnres` take it; once an unknown option here): every
output, gradients included, bitwise the same for N = 1, 2, 3, 5 and 0 (all hardware threads),
float32 and float64, both modes, packed sequences with grouped value heads.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, save  # noqa: E402

import ml_dtypes  # noqa: E402

ck = Checker("kda")
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(7_2026_1130 + ck.args.seeds)


def kda_ref(q, k, v, g, beta, scale):
    """spec 1.1, float64: S' = Diag(e^g) S; S = S' + beta k (v - S'^T k)^T; o = S^T (scale q)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    G = HV // H
    o = np.zeros((B, T, HV, V))
    ht = np.zeros((B, HV, K, V))
    for b in range(B):
        for hv in range(HV):
            S = np.zeros((K, V))
            h = hv // G
            for t in range(T):
                S = np.exp(g[b, t, hv])[:, None] * S
                kt = k[b, t, h]
                S = S + beta[b, t, hv] * np.outer(kt, v[b, t, hv] - kt @ S)
                o[b, t, hv] = scale * (S.T @ q[b, t, h])
            ht[b, hv] = S
    return o, ht


for seed in range(ck.args.seeds):
    for lb in (-4.3, -0.1, -1.0 / 3.0, -2.7, -5.0):
        label = f"bf16 g at --gate-lower-bound {lb:.6g} (seed {seed})"
        if not ck.want(label):
            continue
        B, T, H, HV, K, V = 1, int(rng.integers(17, 80)), 1, 2, int(rng.integers(3, 9)), int(rng.integers(2, 6))
        lb_bf = float(np.float32(lb).astype(bf16))
        q = (rng.standard_normal((B, T, H, K)) / np.sqrt(K)).astype(bf16)
        k = (rng.standard_normal((B, T, H, K)) / np.sqrt(K)).astype(bf16)
        v = rng.standard_normal((B, T, HV, V)).astype(bf16)
        # g: the saturated gate (lb rounded to bfloat16) on 40% of the entries, else inside.
        g = np.where(rng.random((B, T, HV, K)) < 0.4, lb_bf, lb * rng.random((B, T, HV, K))).astype(bf16)
        beta = rng.random((B, T, HV)).astype(bf16)
        d = ck.newdir()
        for n, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            save(d, n, a)
        o_ref, ht_ref = kda_ref(*(x.astype(np.float64) for x in (q, k, v, g, beta)), 1 / np.sqrt(K))
        for mode in ("chunk", "recurrent"):
            rc, text, cmd = ck.run(d, ["--mode", mode, "--gate-lower-bound", repr(lb)])
            if rc != 0:
                ck.fail(label + " " + mode, f"exit {rc}: {text.strip()[:300]}", cmd)
                continue
            compare(ck, label + " " + mode, ck.out(d, "o").view(bf16).astype(np.float64), o_ref, 5e-3, cmd, "o")
            compare(ck, label + " " + mode, ck.out(d, "ht"), ht_ref, 5e-3, cmd, "ht")
        # One bfloat16 step below both lb and its rounding: refused.
        below = np.nextafter(np.float32(min(lb, lb_bf)), np.float32(-np.inf)).astype(bf16)
        if float(below) >= min(lb, lb_bf):
            below = (np.float32(min(lb, lb_bf)) - np.float32(0.0625)).astype(bf16)
        g2 = g.copy()
        g2[0, T // 2, 1, 0] = below
        save(d, "g", g2)
        for mode in ("chunk", "recurrent"):
            ck.expect_error(f"{label} {mode}: one bf16 step below", d, ["--mode", mode, "--gate-lower-bound", repr(lb)],
                            must_mention="--gate-lower-bound")

for seed in range(ck.args.seeds):
    for dt in (np.float32, np.float64):
        for mode in ("chunk", "recurrent"):
            label = f"--threads bitwise {np.dtype(dt).name} {mode} (seed {seed})"
            if not ck.want(label):
                continue
            T, H, HV, K, V = 150, 2, 6, 9, 7
            cu = np.array([0, 3, 3, 70, 150], np.int64)
            d = ck.newdir()
            save(d, "q", (rng.standard_normal((1, T, H, K)) / 3).astype(dt))
            save(d, "k", (rng.standard_normal((1, T, H, K)) / 3).astype(dt))
            save(d, "v", rng.standard_normal((1, T, HV, V)).astype(dt))
            save(d, "g", (-0.5 * rng.random((1, T, HV, K))).astype(dt))
            save(d, "beta", rng.random((1, T, HV)).astype(dt))
            save(d, "h0", rng.standard_normal((4, HV, K, V)).astype(dt))
            save(d, "do", rng.standard_normal((1, T, HV, V)).astype(dt))
            save(d, "dht", rng.standard_normal((4, HV, K, V)).astype(dt))
            save(d, "cu_seqlens", cu)
            outs = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
            ref = None
            for th in ("1", "2", "3", "5", "0"):
                rc, text, cmd = ck.run(d, ["--mode", mode, "--backward", "--threads", th])
                if rc != 0:
                    ck.fail(label, f"--threads {th}: exit {rc}: {text.strip()[:300]}", cmd)
                    break
                got = [ck.out(d, o).tobytes() for o in outs]
                if ref is None:
                    ref = got
                    continue
                diff = [o for o, a, b in zip(outs, ref, got) if a != b]
                if diff:
                    ck.fail(label, f"--threads {th} differs from --threads 1 in {diff}", cmd)
                else:
                    ck.ok(f"{label} --threads {th}")
d = ck.newdir()
if ck.want("--threads bad"):
    for bad in ("-1", "x", "1025"):
        ck.expect_error(f"--threads bad {bad}", d, ["--threads", bad], must_mention="--threads")

ck.finish()
