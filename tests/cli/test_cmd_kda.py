#!/usr/bin/env python3
"""End-to-end check of `k3 kda`: an independent numpy recurrence (float64) against the CLI's
o/ht (chunk and recurrent modes, float32 and float64, packed sequences), plus error cases.
Usage: test_cmd_kda.py /path/to/k3"""
import os
import subprocess
import sys
import tempfile

import numpy as np


def ref(q, k, v, g, beta, h0, cu, scale):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    seqs = [(0, b, 0, T) for b in range(B)] if cu is None else [(n, 0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = np.zeros((B, T, HV, V))
    ht = np.zeros((len(seqs), HV, K, V))
    for n, (_, b, s, e) in enumerate(seqs):
        for hv in range(HV):
            h = hv // G
            S = h0[n, hv].astype(np.float64).copy() if h0 is not None else np.zeros((K, V))
            for t in range(s, e):
                S = np.exp(g[b, t, hv])[:, None] * S
                u = beta[b, t, hv] * (v[b, t, hv] - S.T @ k[b, t, h])
                S = S + np.outer(k[b, t, h], u)
                o[b, t, hv] = S.T @ (scale * q[b, t, h])
            ht[n, hv] = S
    return o, ht


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a ** 2)))


def main():
    k3 = sys.argv[1]
    rng = np.random.default_rng(0)
    failures = 0
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        for cu in (None, np.array([0, 3, 3, 40, 70], dtype=np.int32)):
            B, T, H, HV, K, V = (2, 70, 1, 2, 12, 10) if cu is None else (1, 70, 1, 2, 12, 10)
            q = rng.standard_normal((B, T, H, K)); q /= np.linalg.norm(q, axis=-1, keepdims=True)
            k = rng.standard_normal((B, T, H, K)); k /= np.linalg.norm(k, axis=-1, keepdims=True)
            v = rng.standard_normal((B, T, HV, V))
            g = -np.log1p(np.exp(-rng.standard_normal((B, T, HV, K)))) / 4
            beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))
            N = B if cu is None else len(cu) - 1
            h0 = rng.standard_normal((N, HV, K, V)) * 0.5
            arrs = {n: a.astype(dtype) for n, a in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items()}
            o_ref, ht_ref = ref(*(arrs[n].astype(np.float64) for n in ("q", "k", "v", "g", "beta", "h0")), cu, K ** -0.5)
            with tempfile.TemporaryDirectory() as d:
                ind, outd = os.path.join(d, "in"), os.path.join(d, "out")
                os.makedirs(ind)
                for n, a in arrs.items():
                    np.save(os.path.join(ind, n + ".npy"), a)
                if cu is not None:
                    np.save(os.path.join(ind, "cu_seqlens.npy"), cu)
                np.save(os.path.join(ind, "do.npy"), rng.standard_normal((B, T, HV, V)).astype(dtype))
                for mode in ("chunk", "recurrent"):
                    r = subprocess.run([k3, "kda", "--in", ind, "--out", outd, "--mode", mode, "--backward"], capture_output=True, text=True)
                    if r.returncode != 0:
                        print("FAIL: k3 kda exited", r.returncode, r.stderr); failures += 1; continue
                    o = np.load(os.path.join(outd, "o.npy")); ht = np.load(os.path.join(outd, "ht.npy"))
                    e1, e2 = rel_rms(o_ref, o), rel_rms(ht_ref, ht)
                    ok = o.dtype == dtype and e1 < tol and e2 < tol
                    for gname in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
                        ok = ok and os.path.exists(os.path.join(outd, gname + ".npy"))
                    print(("ok  " if ok else "FAIL"), np.dtype(dtype).name, "varlen" if cu is not None else "batched", mode, "o", e1, "ht", e2)
                    failures += not ok
                # errors: mismatched dtype, bad cu_seqlens
                np.save(os.path.join(ind, "beta.npy"), arrs["beta"].astype(np.float32 if dtype == np.float64 else np.float64))
                r = subprocess.run([k3, "kda", "--in", ind, "--out", outd], capture_output=True, text=True)
                ok = r.returncode != 0 and "'beta'" in r.stderr and "dtype" in r.stderr and r.stderr.count("\n") == 1
                print(("ok  " if ok else "FAIL"), "mismatched dtype ->", r.stderr.strip()); failures += not ok
                np.save(os.path.join(ind, "beta.npy"), arrs["beta"])
                if cu is not None:
                    np.save(os.path.join(ind, "cu_seqlens.npy"), np.array([0, 40, 3, 70], dtype=np.int64))
                    r = subprocess.run([k3, "kda", "--in", ind, "--out", outd], capture_output=True, text=True)
                    ok = r.returncode != 0 and "cu_seqlens" in r.stderr
                    print(("ok  " if ok else "FAIL"), "bad cu_seqlens ->", r.stderr.strip()); failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
