#!/usr/bin/env python3
"""Cross-check `k3 attnres` against an independent float64 numpy reference written from
shared/spec/attnres.md section 2.1 (one mixing site, per token):
    u = g*w;  r_j = 1/sqrt(mean_k v_j[k]^2 + eps);  s_j = r_j (u . v_j);  alpha = softmax_j(s);  h = sum_j alpha_j v_j
Sources: sources.npy [n,T,d] then (optionally) partial.npy [T,d] as the last source.
Gradients by complex step of L = <dh, h>; the spec's numeric vector (section 9) is checked too."""
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, same_outputs, save  # noqa: E402

BF16 = ml_dtypes.bfloat16


def mix_ref(src, w, g, eps):
    """src [..., n, T, d] (extra leading axes allowed), w/g [..., d]."""
    u = g * w
    r = 1.0 / np.sqrt(np.mean(src * src, axis=-1) + eps)  # [..., n, T]
    s = r * np.einsum("...ntd,...d->...nt", src, u)
    s = s - np.max(s.real, axis=-2, keepdims=True)
    e = np.exp(s)
    a = e / e.sum(axis=-2, keepdims=True)
    return np.einsum("...nt,...ntd->...td", a, src)


def grads_cs(allsrc, w, g, eps, dh, elementwise, rng, ndir=3):
    h = 1e-30
    res = {}
    for nm, x in (("src", allsrc), ("w", w), ("g", g)):
        dirs = np.eye(x.size).reshape((x.size,) + x.shape) if elementwise else rng.standard_normal((ndir,) + x.shape)
        D = dirs.shape[0]
        args = {"src": allsrc, "w": w, "g": g}
        args = {k: np.broadcast_to(v, (D,) + v.shape).astype(np.complex128) for k, v in args.items()}
        args[nm] = args[nm] + 1j * h * dirs
        out = mix_ref(args["src"], args["w"], args["g"], eps)
        res[nm] = (dirs, (out.reshape(D, -1) @ dh.ravel()).imag / h)
    return res


def bf16_ulp(x):
    x = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.maximum(x, 2.0 ** -126)))
    return 2.0 ** (e - 7)


def run_case(ck, label, rng, n, T, d, dtype, partial=True, backward=True, eps=None, elementwise=False, wscale=1.0, srcscale=1.0,
             wdtype=None, threads=None, tol=None):
    src = (rng.standard_normal((n, T, d)) * srcscale * rng.uniform(0.1, 3.0, (n, 1, 1))).astype(dtype)
    part = (rng.standard_normal((T, d)) * srcscale).astype(dtype) if partial else None
    w = (rng.standard_normal(d) * wscale).astype(wdtype or (np.float64 if dtype == np.float64 else np.float32))
    g = rng.uniform(0.5, 1.5, d).astype(w.dtype)
    dh = rng.standard_normal((T, d)).astype(np.float64 if dtype == np.float64 else np.float32)
    dd = ck.newdir()
    save(dd, "sources", src)
    if partial:
        save(dd, "partial", part)
    save(dd, "w", w)
    save(dd, "gain", g)
    opts = []
    if backward:
        save(dd, "dh", dh)
        opts.append("--backward")
    if eps is not None:
        opts += ["--eps", repr(eps)]
    if threads is not None:
        opts += ["--threads", str(threads)]
    rc, text, cmd = ck.run(dd, opts)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:400]}", cmd)
        return
    e = 1e-5 if eps is None else eps
    allsrc = src.astype(np.float64)
    if partial:
        allsrc = np.concatenate([allsrc, part.astype(np.float64)[None]], axis=0)
    w64, g64 = w.astype(np.float64), g.astype(np.float64)
    href = mix_ref(allsrc, w64, g64, e)
    h = ck.out(dd, "h")
    if dtype == BF16 and h.dtype == np.uint16:
        h = h.view(BF16)  # k3 writes bfloat16 as '<u2' (torch .view(torch.uint16) convention; npy.hpp)
    if h.dtype != np.dtype(dtype):
        ck.fail(label, f"h: dtype {h.dtype}, expected {np.dtype(dtype)}", cmd)
    if dtype == BF16:
        err = np.abs(h.astype(np.float64) - href) / bf16_ulp(href)
        if not err.max() <= 1.0:
            i = np.unravel_index(np.argmax(err), err.shape)
            ck.fail(label, f"h: {err.max():.2f} bf16 ulps off at {i}: got {float(h[i])!r}, exact {href[i]!r}", cmd)
        else:
            ck.ok(label)
    else:
        compare(ck, label, h, href, tol or (1e-12 if dtype == np.float64 else 1e-6), cmd, "h")
    if not backward:
        return
    gdt = np.float64 if dtype == np.float64 else np.float32
    res = grads_cs(allsrc, w64, g64, e, dh.astype(np.float64), elementwise, rng)
    got = {"dsources": ck.out(dd, "dsources"), "dw": ck.out(dd, "dw"), "dgain": ck.out(dd, "dgain")}
    if partial:
        got["dpartial"] = ck.out(dd, "dpartial")
        gsrc = np.concatenate([got["dsources"], got["dpartial"][None]], axis=0)
    else:
        if os.path.exists(os.path.join(dd, "out", "dpartial.npy")):
            ck.fail(label, "dpartial.npy written without a partial", cmd)
        gsrc = got["dsources"]
    for nm, arr in got.items():
        if arr.dtype != gdt:
            ck.fail(label, f"{nm}: dtype {arr.dtype}, expected {np.dtype(gdt)}", cmd)
    btol = tol or (1e-11 if dtype == np.float64 else (1e-5 if dtype == np.float32 else 1e-5))
    for nm, mine in (("src", gsrc), ("w", got["dw"]), ("g", got["dgain"])):
        dirs, ddv = res[nm]
        if elementwise:
            compare(ck, label, mine, ddv.reshape(mine.shape), btol, cmd, "d" + nm)
        else:
            if mine.shape != dirs.shape[1:]:
                ck.fail(label, f"d{nm}: shape {mine.shape} != {dirs.shape[1:]}", cmd)
                continue
            proj = dirs.reshape(dirs.shape[0], -1) @ mine.astype(np.float64).ravel()
            # a saturated softmax makes dw/dg tiny (e^-gap): measure the error against the natural size
            # of the gradient as well, |dh| |v| sqrt(d T), with a floor at rounding level
            M = np.sqrt(np.mean(dh.astype(np.float64) ** 2) * np.mean(allsrc ** 2) * d * max(T, 1)) * np.sqrt(np.mean(dirs ** 2) * dirs[0].size)
            floor = (1e-15 if dtype == np.float64 else 1e-6) * M
            err = np.sqrt(np.mean((proj - ddv) ** 2)) / (max(np.sqrt(np.mean(ddv ** 2)), floor / btol) + 1e-300)
            if not err <= btol:
                ck.fail(label, f"d{nm}: directional rel err {err:.3e} > {btol:.1e}", cmd)
            else:
                ck.ok(label)


def spec_vector(ck):
    d = ck.newdir()
    v = np.array([[1, -2, 3, 0.5], [0.5, 0.5, -1, 2], [-1, 1, 1, -1]], dtype=np.float64)
    save(d, "sources", v[:, None, :])
    save(d, "gain", np.array([1, 1.5, 0.5, 1.0]))
    save(d, "w", np.array([0.2, -0.1, 0.3, 0.05]))
    save(d, "dh", np.array([[1, 0, -1, 0.5]]))
    rc, text, cmd = ck.run(d, ["--backward"])
    if rc != 0:
        ck.fail("spec vector", f"exit {rc}: {text[:300]}", cmd)
        return
    exp = {"h": [0.403881, -0.606957, 1.406152, 0.587408], "dw": [0.526952, 0.783602, -0.997157, 1.831642],
           "dgain": [0.105390, -0.052240, -0.598294, 0.091582]}
    dsrc = [[0.452702, 0.003544, -0.473257, 0.239818], [0.442841, -0.115229, -0.171609, 0.188624], [0.170929, 0.035550, -0.313128, 0.118475]]
    for nm, e in exp.items():
        got = ck.out(d, nm).ravel()
        if np.max(np.abs(got - e)) > 1e-6:
            ck.fail("spec vector", f"{nm}: got {got}, spec {e}", cmd)
        else:
            ck.ok("spec vector " + nm)
    got = ck.out(d, "dsources")[:, 0, :]
    if np.max(np.abs(got - np.array(dsrc))) > 1e-6:
        ck.fail("spec vector", f"dsources: got {got}, spec {dsrc}", cmd)
    else:
        ck.ok("spec vector dsources")


def bad_inputs(ck, rng):
    n, T, d = 3, 4, 5
    base = {"sources": rng.standard_normal((n, T, d)), "partial": rng.standard_normal((T, d)), "w": rng.standard_normal(d),
            "gain": rng.standard_normal(d)}

    def setup(mod=None, drop=(), extra=None):
        dd = ck.newdir()
        x = dict(base)
        x.update(mod or {})
        for k, v in x.items():
            if k not in drop and v is not None:
                save(dd, k, v)
        for k, v in (extra or {}).items():
            save(dd, k, v)
        return dd

    ck.expect_error("bad: w length", setup({"w": np.zeros(d + 1)}), must_mention="w")
    ck.expect_error("bad: gain length", setup({"gain": np.zeros(d - 1)}), must_mention="gain")
    ck.expect_error("bad: w rank 2", setup({"w": np.zeros((1, d))}), must_mention="w")
    ck.expect_error("bad: w int32", setup({"w": np.zeros(d, dtype=np.int32)}), must_mention="w")
    ck.expect_error("bad: partial shape", setup({"partial": np.zeros((T + 1, d))}), must_mention="partial")
    ck.expect_error("bad: partial dtype", setup({"partial": np.zeros((T, d), dtype=np.float32)}), must_mention="partial")
    ck.expect_error("bad: sources rank 2", setup({"sources": np.zeros((T, d))}), must_mention="sources")
    ck.expect_error("bad: sources int64", setup({"sources": np.zeros((n, T, d), dtype=np.int64)}), must_mention="sources")
    ck.expect_error("bad: sources float16", setup({"sources": np.zeros((n, T, d), dtype=np.float16)}), must_mention="sources")
    ck.expect_error("bad: missing w", setup(drop=("w",)), must_mention="w")
    ck.expect_error("bad: missing sources", setup(drop=("sources",)), must_mention="sources")
    ck.expect_error("bad: --backward without dh", setup(), ["--backward"], must_mention="dh")
    ck.expect_error("bad: dh shape", setup(extra={"dh": np.zeros((T, d + 1))}), ["--backward"], must_mention="dh")
    ck.expect_error("bad: --eps -1", setup(), ["--eps", "-1"], must_mention="eps")
    ck.expect_error("bad: --eps nan", setup(), ["--eps", "nan"], must_mention="eps")
    ck.expect_error("bad: --threads -3", setup(), ["--threads", "-3"], must_mention="threads")
    # NOT run: --threads 100000 (or 100000000000, which wraps to 1215752192 in the int cast) makes the
    # thread pool try to start that many threads; it never finishes and exhausts the machine's
    # process limit for everyone (seen: "fork: Resource temporarily unavailable"). Reported instead.
    ck.expect_error("bad: n = 0 without partial", setup({"sources": np.zeros((0, T, d))}, drop=("partial",)), must_mention="sources")
    dd = setup()  # numpy's other layouts hold the same numbers: read, not rejected
    np.save(os.path.join(dd, "in", "sources.npy"), np.asfortranarray(base["sources"]))
    same_outputs(ck, "Fortran sources", setup(), dd, ["h"])
    dd = setup()
    np.save(os.path.join(dd, "in", "w.npy"), base["w"].astype(">f8"))
    same_outputs(ck, "big-endian w", setup(), dd, ["h"])
    dd = setup()
    raw = open(os.path.join(dd, "in", "sources.npy"), "rb").read()
    open(os.path.join(dd, "in", "sources.npy"), "wb").write(raw[:100])
    ck.expect_error("bad: truncated sources", dd, must_mention="sources")
    # NaN / Inf in one token stays in that token
    src = rng.standard_normal((n, 6, d))
    src[1, 2, 3] = np.nan
    src[0, 4, 0] = np.inf
    dd = setup({"sources": src, "partial": rng.standard_normal((6, d))}, extra={"dh": rng.standard_normal((6, d))})
    rc, text, cmd = ck.run(dd, ["--backward"])
    if rc != 0:
        ck.fail("nan confinement", f"exit {rc}: {text[:300]}", cmd)
    else:
        h = ck.out(dd, "h")
        good = [0, 1, 3, 5]
        allsrc = np.concatenate([src, np.load(os.path.join(dd, "in", "partial.npy"))[None]], 0)
        href = mix_ref(allsrc[:, good], base["w"], base["gain"], 1e-5)
        compare(ck, "nan confinement", h[good], href, 1e-12, cmd, "h clean tokens")
        ds = ck.out(dd, "dsources")
        if not np.isfinite(ds[:, good]).all():
            ck.fail("nan confinement", "dsources of clean tokens not finite", cmd)
        dw = ck.out(dd, "dw")
        # dw sums over tokens: the poisoned tokens make it non-finite, which is the honest answer
        ck.ok("nan confinement dsources")


def main():
    ck = Checker("attnres")
    for seed in range(ck.args.seeds):
        rng = np.random.default_rng(3000 + seed)
        for (n, T, d, part) in [(1, 1, 1, False), (2, 3, 4, True), (1, 2, 5, True), (3, 2, 3, False)]:
            lab = f"tiny s{seed} n{n} T{T} d{d} partial={part}"
            if ck.want(lab):
                run_case(ck, lab, rng, n, T, d, np.float64, partial=part, elementwise=True)
        for i, (n, T, d) in enumerate([(8, 17, 100), (1, 5, 7168), (9, 33, 129), (2, 1, 31), (5, 64, 3), (0, 7, 16)]):
            for dt in (np.float64, np.float32, BF16):
                lab = f"s{seed} {np.dtype(dt).name} n{n} T{T} d{d}"
                if ck.want(lab):
                    run_case(ck, lab, rng, n, T, d, dt, partial=(i % 2 == 0 or n == 0), threads=[None, 1, 2][i % 3],
                             wscale=[1.0, 0.0, 5.0][i % 3])
        lab = f"large logits s{seed}"
        if ck.want(lab):
            run_case(ck, lab, rng, 4, 9, 64, np.float64, wscale=200.0)
            run_case(ck, lab + " f32", rng, 4, 9, 64, np.float32, wscale=200.0, tol=1e-5)
        lab = f"eps s{seed}"
        if ck.want(lab):
            run_case(ck, lab + " eps=0", rng, 3, 5, 8, np.float64, eps=0.0)
            run_case(ck, lab + " eps=0.5 small sources", rng, 3, 5, 8, np.float64, eps=0.5, srcscale=0.01)
            run_case(ck, lab + " w as bf16", rng, 3, 5, 8, np.float32, wdtype=BF16)
            run_case(ck, lab + " w as f64 for f32", rng, 3, 5, 8, np.float32, wdtype=np.float64)
    if ck.want("spec"):
        spec_vector(ck)
    if ck.want("bad"):
        bad_inputs(ck, np.random.default_rng(9))
    ck.finish()


if __name__ == "__main__":
    main()
