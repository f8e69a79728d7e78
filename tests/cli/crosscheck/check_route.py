#!/usr/bin/env python3
"""Cross-check `k3 route` against an independent numpy reference written from
shared/spec/moe_routing.md A.1 (router), A.4.2 (exact per-step update), A.4.3 (histogram) and A.4.1
(offline solver, checked by its contract: it balances the batch and routing uses its bias).
Router: z = s + b (fp32), top-k of z (ties: lower expert index), weights s/sum(s) * scale,
alpha = (k+1)-th largest z; padding tokens get -1 / 0 and are excluded from everything."""
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, same_outputs, save  # noqa: E402

f32 = np.float32


def route_ref(s, b, k, scale, mask, groups=1, topk_groups=1):
    m, n = s.shape
    z = (s.astype(f32) + b.astype(f32)).astype(f32)  # fp32 sum, as the spec says (selection in FP32)
    if groups > 1:
        gs = n // groups
        zg = z.reshape(m, groups, gs).astype(np.float64)
        top2 = -np.sort(-zg, axis=2)[:, :, :2].sum(2)
        order = np.lexsort((np.broadcast_to(np.arange(groups), (m, groups)), -top2), axis=1)
        keep = np.zeros((m, groups), bool)
        np.put_along_axis(keep, order[:, :topk_groups], True, axis=1)
        z = np.where(np.repeat(keep, gs, axis=1), z, -np.inf).astype(f32)
    idx = np.empty((m, k + 1), np.int64)
    for i in range(m):
        o = np.lexsort((np.arange(n), -z[i].astype(np.float64)))
        idx[i] = o[: k + 1]
    sel = idx[:, :k]
    ssel = np.take_along_axis(s.astype(np.float64), sel, 1)
    w = ssel / ssel.sum(1, keepdims=True) * scale
    alpha = np.take_along_axis(z, idx[:, k:k + 1], 1)[:, 0]
    load = np.zeros(n, np.int64)
    for i in range(m):
        if mask[i]:
            load[sel[i]] += 1
    sel = np.where(mask[:, None], sel, -1)
    w = np.where(mask[:, None], w, 0)
    return sel, w, alpha, load


def exact_update(s, alpha, b, k, mask, ema):
    real = np.flatnonzero(mask)
    m, n = len(real), s.shape[1]
    if m == 0:
        return b.astype(np.float64)
    q = (m * k) // n
    r = alpha[real, None].astype(np.float64) - s[real].astype(np.float64)
    bn = np.sort(r, axis=0)[q]
    bn -= bn.mean()
    if ema:
        bn = ema * b + (1 - ema) * bn
        bn -= bn.mean()
    return bn


def hist_update(s, alpha, b, k, mask, bins, ema):
    real = np.flatnonzero(mask)
    m, n = len(real), s.shape[1]
    if m == 0:
        return b.astype(np.float64), None
    # bins in fp32 (spec A.4.3 keeps lo, hi, scores and the cut-off in FP32; k3/moe documents the
    # exact float sequence t = floor((r - lo) * inv_w), inv_w = B / (hi - lo), so that every backend
    # counts identically); the quantile interpolation itself in float64
    lo, hi = f32(f32(b.min()) - f32(1)), f32(f32(b.max()) + f32(1))
    w = (float(hi) - float(lo)) / bins
    inv_w = f32(f32(bins) / f32(hi - lo))
    r = (alpha[real, None].astype(f32) - s[real].astype(f32)).astype(f32)
    l = np.clip(np.floor(((r - lo).astype(f32) * inv_w).astype(f32)), 0, bins - 1).astype(int)
    lo = float(lo)
    H = np.zeros((n, bins), np.int64)
    for j in range(n):
        H[j] = np.bincount(l[:, j], minlength=bins)
    q = m * k / n
    R = max(1, int(np.ceil(q)))
    bn = np.zeros(n)
    for j in range(n):
        cs = np.cumsum(H[j])
        ls = int(np.argmax(cs >= R))
        c = cs[ls - 1] if ls > 0 else 0
        t = np.clip((q - c) / max(H[j, ls], 1), 0, 1)
        bn[j] = lo + (ls + t) * w
    bn -= bn.mean()
    if ema:
        bn = ema * b + (1 - ema) * bn
        bn -= bn.mean()
    return bn, w


def run_case(ck, label, rng, m, n, k, scale=1.0, bias_scale=0.05, masked=False, update="histogram", bins=None, ema=None,
             logits=False, groups=None, topk_groups=None, ties=False, sdtype=np.float32, solve=False, threads=None):
    if ties:
        s = (rng.integers(1, 8, (m, n)) / 8.0)
    else:
        s = rng.uniform(0.001, 0.999, (m, n)) ** rng.uniform(0.5, 3, n)  # skewed expert preferences
    b = (rng.standard_normal(n) * bias_scale) if not ties else (rng.integers(-2, 3, n) / 8.0)
    b = (b - b.mean()).astype(f32) if not ties else b.astype(f32)
    mask = np.ones(m, bool) if not masked else rng.random(m) < 0.7
    d = ck.newdir()
    if logits:
        lg = np.log(s) - np.log1p(-s)
        save(d, "logits", lg.astype(sdtype))
        s_in = (1 / (1 + np.exp(-lg.astype(sdtype).astype(np.float64)))).astype(f32)
    else:
        s_in = s.astype(sdtype).astype(np.float64).astype(f32)
        save(d, "scores", s.astype(sdtype))
    save(d, "bias", b)
    if masked:
        save(d, "mask", mask.astype([bool, np.uint8, np.int32][m % 3]))  # numpy bool is the natural mask dtype
    opts = ["--k", str(k), "--scale", repr(scale)]
    if not solve and not (groups and groups > 1):  # k3 rejects the update options where no update runs
        opts += ["--update", update]
        if bins is not None:
            opts += ["--bins", str(bins)]
        if ema is not None:
            opts += ["--ema", repr(ema)]
    if groups:
        opts += ["--groups", str(groups), "--topk-groups", str(topk_groups)]
    if solve:
        opts += ["--solve"]
    if threads is not None:
        opts += ["--threads", str(threads)]
    rc, text, cmd = ck.run(d, opts)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:400]}", cmd)
        return
    idx, w, ld, nb = (ck.out(d, x) for x in ("indices", "weights", "load", "new_bias"))
    if idx.dtype != np.int32 or idx.shape != (m, k):
        ck.fail(label, f"indices: dtype {idx.dtype} shape {idx.shape}, expected int32 {(m, k)}", cmd)
        return
    if solve:
        # contract: routing uses the written bias, and the batch is balanced
        bsol = nb.astype(f32)
        sel, wr, alpha, load = route_ref(s_in, bsol, k, scale, mask)
        if not np.array_equal(idx, sel):
            ck.fail(label, f"--solve: indices differ from top-k with the written new_bias in {(idx != sel).any(1).sum()} tokens", cmd)
        q = mask.sum() * k / n
        load0 = route_ref(s_in, b, k, scale, mask)[3]
        imb0, imb = np.abs(load0 - q).max(), np.abs(ld - q).max()
        if not imb <= max(0.05 * q, 1.0):
            ck.fail(label, f"--solve: max|load-q| = {imb} > 5% of q = {q} (before: {imb0})", cmd)
        else:
            ck.ok(label)
        if abs(float(nb.astype(np.float64).mean())) > 1e-5:
            ck.fail(label, f"--solve: new_bias not mean-centred (mean {nb.mean()})", cmd)
        return
    sel, wr, alpha, load = route_ref(s_in, b, k, scale, mask, groups or 1, topk_groups or 1)
    if not np.array_equal(idx, sel):
        bad = np.flatnonzero((idx != sel).any(1))
        same_set = all(set(idx[i]) == set(sel[i]) for i in bad)
        ck.fail(label, f"indices differ in {len(bad)} tokens ({'same sets, other order' if same_set else 'different sets'}); "
                f"token {bad[0]}: got {idx[bad[0]].tolist()}, expected {sel[bad[0]].tolist()}", cmd)
    else:
        ck.ok(label + " indices")
    err = np.abs(w.astype(np.float64) - wr).max() / max(scale, 1e-30)
    if w.dtype != f32 or not err <= 2e-6:
        ck.fail(label, f"weights: dtype {w.dtype}, max abs err / scale {err:.2e}", cmd)
    else:
        ck.ok(label + " weights")
    if not np.array_equal(ld, load):
        ck.fail(label, f"load differs: got {ld[:8]}..., expected {load[:8]}... (sum {ld.sum()} vs {load.sum()})", cmd)
    else:
        ck.ok(label + " load")
    if groups and groups > 1:
        if not np.array_equal(nb, b):
            ck.fail(label, "group-limited routing changed the bias (CLI says it is kept)", cmd)
        return
    if update == "exact":
        ref = exact_update(s_in, alpha, b.astype(np.float64), k, mask, ema or 0.0)
        tol = 2e-6
    else:
        ref, bw = hist_update(s_in, alpha, b.astype(np.float64), k, mask, bins or 1000, ema or 0.0)
        tol = 2e-5
    e = np.abs(nb.astype(np.float64) - ref).max()
    if nb.dtype != f32 or not e <= tol:
        j = int(np.argmax(np.abs(nb.astype(np.float64) - ref)))
        ck.fail(label, f"new_bias ({update}): max abs err {e:.3e} > {tol:.0e} at expert {j}: got {nb[j]!r}, expected {ref[j]!r}", cmd)
    else:
        ck.ok(label + " new_bias")


def bad_inputs(ck, rng):
    m, n = 6, 5

    def setup(scores=None, bias=None, mask=None, logits=None):
        d = ck.newdir()
        if scores is not None:
            save(d, "scores", scores)
        if logits is not None:
            save(d, "logits", logits)
        if bias is not None:
            save(d, "bias", bias)
        if mask is not None:
            save(d, "mask", mask)
        return d

    s = rng.uniform(0.01, 0.99, (m, n)).astype(f32)
    b = np.zeros(n, f32)
    ck.expect_error("bad: k = n", setup(s, b), ["--k", str(n)], must_mention=["'k'", "'--k'"])
    ck.expect_error("bad: k > n", setup(s, b), ["--k", str(n + 3)], must_mention=["'k'", "'--k'"])
    ck.expect_error("bad: k = 0", setup(s, b), ["--k", "0"], must_mention=["'k'", "'--k'"])
    ck.expect_error("bad: k = -1", setup(s, b), ["--k", "-1"], must_mention=["'k'", "'--k'"])
    ck.expect_error("bad: k = 2^40", setup(s, b), ["--k", str(2 ** 40)], must_mention=["'k'", "'--k'"])
    ck.expect_error("bad: zero experts exact", setup(np.zeros((m, 0), f32), np.zeros(0, f32)), ["--k", "2", "--update", "exact"],
                    must_mention=["'n'", "expert", "'k'", "scores"])
    ck.expect_error("bad: bias length", setup(s, np.zeros(n + 1, f32)), ["--k", "2"], must_mention="bias")
    ck.expect_error("bad: bias rank 2", setup(s, np.zeros((1, n), f32)), ["--k", "2"], must_mention="bias")
    ck.expect_error("bad: bias NaN", setup(s, np.array([0, np.nan, 0, 0, 0], f32)), ["--k", "2"], must_mention="bias")
    x = s.copy()
    x[2, 3] = np.nan
    ck.expect_error("bad: NaN score", setup(x, b), ["--k", "2"], must_mention="score")
    x = s.copy()
    x[1, 1] = np.inf
    ck.expect_error("bad: Inf score", setup(x, b), ["--k", "2"], must_mention="score")
    x = s.copy()
    x[1, 1] = -np.inf
    ck.expect_error("bad: -Inf logit", setup(logits=x, bias=b), ["--k", "2"], must_mention="logit")
    ck.expect_error("bad: zero tokens", setup(np.zeros((0, n), f32), b), ["--k", "2"], must_mention=["token", "m"])
    ck.expect_error("bad: zero experts", setup(np.zeros((m, 0), f32), np.zeros(0, f32)), ["--k", "2"], must_mention=["n", "expert", "k"])
    ck.expect_error("bad: scores rank 1", setup(s[0], b), ["--k", "2"], must_mention="scores")
    ck.expect_error("bad: scores int32", setup(s.astype(np.int32), b), ["--k", "2"], must_mention="scores")
    ck.expect_error("bad: mask length", setup(s, b, np.ones(m + 1, np.uint8)), ["--k", "2"], must_mention="mask")
    ck.expect_error("bad: no scores", setup(None, b), ["--k", "2"], must_mention=["scores", "logits"])
    ck.expect_error("bad: --bins 0", setup(s, b), ["--k", "2", "--bins", "0"], must_mention="bins")
    ck.expect_error("bad: --bins -5", setup(s, b), ["--k", "2", "--bins", "-5"], must_mention="bins")
    ck.expect_error("bad: --update foo", setup(s, b), ["--k", "2", "--update", "foo"], must_mention="update")
    ck.expect_error("bad: --ema 1", setup(s, b), ["--k", "2", "--ema", "1"], must_mention="ema")
    ck.expect_error("bad: --ema -0.5", setup(s, b), ["--k", "2", "--ema", "-0.5"], must_mention="ema")
    ck.expect_error("bad: --groups not dividing n", setup(s, b), ["--k", "2", "--groups", "2"], must_mention="group")
    ck.expect_error("bad: --topk-groups > groups", setup(np.tile(s, (1, 2)), np.zeros(2 * n, f32)), ["--k", "2", "--groups", "2", "--topk-groups", "3"],
                    must_mention="group")
    ck.expect_error("bad: k > experts in kept groups", setup(np.tile(s, (1, 2)), np.zeros(2 * n, f32)),
                    ["--k", "7", "--groups", "2", "--topk-groups", "1"], must_mention=["k", "group"])
    ck.expect_error("bad: --iterations -1", setup(s, b), ["--k", "2", "--solve", "--iterations", "-1"], must_mention="iteration")
    # absurd iteration counts must be refused, not run for hours (was a hang)
    ck.expect_error("bad: --iterations 1e11", setup(s, b), ["--k", "2", "--solve", "--iterations", "100000000000"], must_mention="iteration")
    ck.expect_error("bad: --iterations abc", setup(s, b), ["--k", "2", "--solve", "--iterations", "abc"], must_mention="iteration")
    # the offline solver balances ungrouped top-k only: with --groups its bias would not balance (was silently ignored)
    ck.expect_error("bad: --solve with --groups", setup(np.tile(s, (1, 2)), np.zeros(2 * n, f32)),
                    ["--k", "2", "--groups", "2", "--topk-groups", "1", "--solve"], must_mention="group")
    # NOT run: --threads 100000 (or 100000000000, which wraps to 1215752192 in the int cast) makes the
    # thread pool try to start that many threads; it never finishes and exhausts the machine's
    # process limit for everyone (seen: "fork: Resource temporarily unavailable"). Reported instead.
    # scores outside (0, 1) break the histogram range assumption: error, or documented clamping
    x = s.copy()
    x[0, 0] = 1.7
    x[1, 2] = -0.3
    d = setup(x, b)
    rc, text, cmd = ck.run(d, ["--k", "2"])
    if rc == 0:
        ck.fail("scores outside (0,1)", "accepted silently with --update histogram (spec A.4.3/A.7: histogram mode requires sigmoid scores)", cmd)
    else:
        ck.expect_error("scores outside (0,1): error", d, ["--k", "2"], must_mention="scores")
    # the same scores are fine with the exact update, and on padding rows
    rc, text, cmd = ck.run(d, ["--k", "2", "--update", "exact"])
    if rc != 0:
        ck.fail("scores outside (0,1) exact", f"exit {rc}: {text[:300]}", cmd)
    else:
        ck.ok("scores outside (0,1) exact")
    save(d, "mask", np.array([0, 0, 1, 1, 1, 1], np.uint8))
    rc, text, cmd = ck.run(d, ["--k", "2"])
    if rc != 0:
        ck.fail("scores outside (0,1) on padding rows", f"exit {rc}: {text[:300]}", cmd)
    else:
        ck.ok("scores outside (0,1) on padding rows")
    d = setup(s, b)  # numpy's other layouts hold the same numbers: read, not rejected
    np.save(os.path.join(d, "in", "scores.npy"), np.asfortranarray(s))
    same_outputs(ck, "Fortran scores", setup(s, b), d, ["indices", "weights", "load", "new_bias"], ["--k", "2"])
    d = setup(s, b)
    np.save(os.path.join(d, "in", "bias.npy"), b.astype(">f4"))
    same_outputs(ck, "big-endian bias", setup(s, b), d, ["indices", "weights", "load", "new_bias"], ["--k", "2"])


def main():
    ck = Checker("route")
    for seed in range(ck.args.seeds):
        rng = np.random.default_rng(4000 + seed)
        cases = [
            dict(m=1, n=4, k=3), dict(m=1, n=896, k=16), dict(m=37, n=17, k=16), dict(m=200, n=64, k=4, masked=True),
            dict(m=513, n=896, k=16, threads=2), dict(m=64, n=8, k=2, update="exact"), dict(m=40, n=8, k=1, update="exact", masked=True),
            dict(m=12, n=4, k=1, update="exact"), dict(m=300, n=33, k=5, update="exact", ema=0.3),
            dict(m=300, n=33, k=5, bins=7, ema=0.5), dict(m=100, n=10, k=9, bins=1), dict(m=129, n=1025, k=31, scale=2.5),
            dict(m=50, n=16, k=3, ties=True), dict(m=50, n=16, k=3, ties=True, update="exact"), dict(m=40, n=12, k=2, logits=True),
            dict(m=40, n=12, k=2, sdtype=np.float64), dict(m=40, n=12, k=2, sdtype=ml_dtypes.bfloat16, update="exact"),
            dict(m=60, n=32, k=4, groups=8, topk_groups=3), dict(m=60, n=32, k=8, groups=4, topk_groups=2, masked=True),
            dict(m=30, n=6, k=2, bias_scale=3.0), dict(m=8, n=5, k=2, masked=True, update="exact"),
            dict(m=4096, n=64, k=4, solve=True), dict(m=1000, n=20, k=3, solve=True, masked=True),
        ]
        for c in cases:
            lab = f"s{seed} " + " ".join(f"{a}={getattr(v, '__name__', v)}" for a, v in c.items())
            if ck.want(lab):
                run_case(ck, lab, rng, **c)
        # all tokens padded: bias kept
        lab = f"s{seed} all padding"
        if ck.want(lab):
            d = ck.newdir()
            s = rng.uniform(0.01, 0.99, (5, 6)).astype(f32)
            b = (rng.standard_normal(6) * 0.1).astype(f32)
            save(d, "scores", s)
            save(d, "bias", b)
            save(d, "mask", np.zeros(5, np.uint8))
            for upd in ("histogram", "exact"):
                rc, text, cmd = ck.run(d, ["--k", "2", "--update", upd])
                if rc != 0:
                    ck.fail(lab, f"exit {rc}: {text[:300]}", cmd)
                    continue
                if not (np.array_equal(ck.out(d, "new_bias"), b) and (ck.out(d, "indices") == -1).all() and (ck.out(d, "load") == 0).all()):
                    ck.fail(lab, f"{upd}: expected bias kept, indices -1, zero load; got bias {ck.out(d, 'new_bias')}", cmd)
                else:
                    ck.ok(lab)
    if ck.want("bad"):
        bad_inputs(ck, np.random.default_rng(10))
    ck.finish()


if __name__ == "__main__":
    main()
