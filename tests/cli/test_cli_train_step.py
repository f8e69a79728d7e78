"""End-to-end check of `k3 train-step`: at the default shapes (4 KDA layers + 1 MoE layer, 2048
tokens) the --json object's keys and the bars of each policy (recompute and offload checksums
equal keep's, fp8 saves <= 0.6 and recompute <= 0.5 of keep's bytes, offload's resident peak
<= 0.5 of keep's, the same seed twice gives the same checksum); on a small step, the checksum
recomputed with hashlib from the gradients --out wrote (parameter order) and fp8's
grad_rel_err_vs_keep recomputed with numpy from the two gradient sets; usage errors.
Usage: test_cli_train_step.py K3_BINARY WORKDIR"""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

k3, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print("FAIL:", what)


def step(policy, *extra):
    r = subprocess.run([k3, "train-step", "--policy", policy, "--json", *extra], capture_output=True, text=True)
    check(r.returncode == 0, f"{policy} {extra}: exit {r.returncode}: {r.stderr}")
    return json.loads(r.stdout) if r.returncode == 0 else None


keys = {"policy", "saved_bytes", "resident_peak_bytes", "host_bytes", "grad_checksum", "grad_rel_err_vs_keep"}
res = {p: step(p) for p in ["keep", "recompute", "fp8", "offload", "mixed"]}
if all(res.values()):
    for p, j in res.items():
        check(set(j) == keys, f"{p}: keys {sorted(j)}")
        check(j["policy"] == p, f"{p}: policy field {j['policy']}")
        check(len(j["grad_checksum"]) == 64 and all(ch in "0123456789abcdef" for ch in j["grad_checksum"]), f"{p}: checksum {j['grad_checksum']}")
        print(f"{p:10s} saved {j['saved_bytes']:>11} resident_peak {j['resident_peak_bytes']:>11} host {j['host_bytes']:>11} "
              f"rel_err {j['grad_rel_err_vs_keep']:.3e}")
    keep = res["keep"]
    check(keep["grad_rel_err_vs_keep"] == 0 and keep["host_bytes"] == 0, f"keep: {keep}")
    check(keep["resident_peak_bytes"] == keep["saved_bytes"], "keep: everything resident")
    for p in ("recompute", "offload"):
        check(res[p]["grad_checksum"] == keep["grad_checksum"], f"{p}: checksum differs from keep's")
        check(res[p]["grad_rel_err_vs_keep"] == 0, f"{p}: rel err {res[p]['grad_rel_err_vs_keep']}")
    check(res["fp8"]["saved_bytes"] <= 0.6 * keep["saved_bytes"], f"fp8 saved {res['fp8']['saved_bytes']} vs keep {keep['saved_bytes']}")
    check(0 < res["fp8"]["grad_rel_err_vs_keep"] < 0.125, f"fp8 rel err {res['fp8']['grad_rel_err_vs_keep']}")
    check(res["fp8"]["grad_checksum"] != keep["grad_checksum"], "fp8: the same checksum as keep")
    check(res["recompute"]["saved_bytes"] <= 0.5 * keep["saved_bytes"], f"recompute saved {res['recompute']['saved_bytes']}")
    check(res["offload"]["resident_peak_bytes"] <= 0.5 * keep["resident_peak_bytes"], f"offload peak {res['offload']['resident_peak_bytes']}")
    check(res["offload"]["host_bytes"] == keep["saved_bytes"], "offload: everything in the host pool")
    check(0 < res["mixed"]["grad_rel_err_vs_keep"] < 0.125 and res["mixed"]["saved_bytes"] < res["fp8"]["saved_bytes"], f"mixed {res['mixed']}")
    again = step("mixed")
    check(again is not None and again["grad_checksum"] == res["mixed"]["grad_checksum"], "mixed: another checksum for the same seed")
    other = step("mixed", "--seed", "1")
    check(other is not None and other["grad_checksum"] != res["mixed"]["grad_checksum"], "mixed: seed 1 gives seed 0's checksum")

# Small step: the checksum and the error recomputed from the gradients themselves.
small = ["--layers", "2", "--tokens", "100", "--seed", "7"]
layer = ["w_q", "w_k", "w_v", "w_g", "w_beta", "w_o", "conv_q", "conv_k", "conv_v", "A_log", "dt_bias"]
names = [f"kda{i}.{n}" for i in range(2) for n in layer] + \
        ["moe." + n for n in ["w_router", "w_down", "we_gate", "we_up", "we_down", "norm_weight", "w_up"]]
grads = {}
for p in ("keep", "fp8"):
    out = os.path.join(work, p)
    j = step(p, *small, "--out", out)
    if not j:
        continue
    g = [np.load(os.path.join(out, n + ".npy")) for n in names]
    check(all(a.dtype == np.float32 for a in g), f"{p}: gradient dtypes")
    check(g[0].shape == (256, 256) and g[4].shape == (2, 256) and g[6].shape == (256, 4) and g[22 + 2].shape == (16, 256, 128),
          f"{p}: gradient shapes {[a.shape for a in g[:7]]}, {g[24].shape}")
    h = hashlib.sha256()
    for a in g:
        h.update(np.ascontiguousarray(a).astype("<f4").tobytes())
    check(h.hexdigest() == j["grad_checksum"], f"{p}: checksum {j['grad_checksum']} vs hashlib {h.hexdigest()}")
    check(all(np.isfinite(a).all() for a in g) and any(np.abs(a).max() > 0 for a in g), f"{p}: gradients finite and not all zero")
    grads[p] = (np.concatenate([a.ravel().astype(np.float64) for a in g]), j)
if len(grads) == 2:
    ref, got = grads["keep"][0], grads["fp8"][0]
    err = np.sqrt(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
    check(abs(err - grads["fp8"][1]["grad_rel_err_vs_keep"]) <= 1e-9 * max(err, 1e-30), f"fp8 rel err {grads['fp8'][1]['grad_rel_err_vs_keep']} vs numpy {err}")

for extra, text in [(["--policy", "fp9"], "must be one of keep|recompute|fp8|offload|mixed"), (["--layers", "0"], "--layers"),
                    (["--tokens", "x"], "expects an integer"), (["--in", "x"], "unknown option")]:
    r = subprocess.run([k3, "train-step", *extra], capture_output=True, text=True)
    check(r.returncode == 2 and text in r.stderr, f"{extra}: exit {r.returncode}, {r.stderr!r}")

print("k3 train-step:", "FAILED" if fails else "passed", f"({fails} failures)")
sys.exit(1 if fails else 0)
