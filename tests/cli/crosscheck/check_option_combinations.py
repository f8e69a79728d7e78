#!/usr/bin/env python3
"""Option combinations and edge shapes the other checkers do not try, for `k3 route`,
`k3 quant` / `k3 dequant` and `k3 attnres`, each against its own numpy / ml_dtypes reference
written from shared/spec/{moe_routing,quantization,attnres}.md (not from the library code).

route:   k = n - 1 with n not a multiple of 16, m = 1, exact ties across the cut-off and across
         group boundaries, groups of one expert, all-padding masks, float64 / bfloat16 scores, bias
         all equal, histogram with 1 / 2 / 2^20 bins (against the exact quantile), EMA with both
         updates, and the option combinations that must be errors (--update/--bins/--ema with
         --solve or --groups > 1, --iterations without --solve, --bins with --update exact), both
         scores.npy and logits.npy, non-finite masks.
quant:   every format x scale rule on 1-D and 3-D inputs, DeepSeek tiles on last extents that are
         not multiples of 128, MX/NVFP4 last extents that must be rejected, bfloat16 inputs with
         NaN / Inf / subnormal patterns; `k3 dequant` of random code and scale bytes made with
         ml_dtypes (NaN codes, E8M0 0x00 / 0xFE / 0xFF) and of malformed scale files.
attnres: n = 1 source, bank of 0 rows plus a partial, d = 1, T = 1, gradients by the complex step,
         Fortran-order inputs, mixed dtypes (documented promotion or a clear error)."""
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, save  # noqa: E402

f32 = np.float32
ck = Checker("option_combinations")  # the subcommand is chosen per run (cmdname)


def run(d, sub, opts=()):
    return ck.run(d, list(opts), cmdname=sub)


def expect_error(label, d, sub, opts, must):
    rc, text, cmd = run(d, sub, opts)
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if rc is None or rc == 0 or rc < 0 or rc > 2:
        ck.fail(label, f"expected a clean error, got exit {rc}: {text.strip()[:300]}", cmd)
    elif len(lines) != 1 or must not in lines[0]:
        ck.fail(label, f"expected one line mentioning {must!r}, got: {text.strip()[:300]}", cmd)
    elif os.path.exists(os.path.join(d, "out")) and os.listdir(os.path.join(d, "out")):
        ck.fail(label, f"error run left outputs {os.listdir(os.path.join(d, 'out'))}", cmd)
    else:
        ck.ok(label)


# ------------------------------------------------------------------------------------------------
# route (spec A.1, A.4.2, A.4.3)

def route_ref(s32, b32, k, scale, real, groups=1, topk_groups=1):
    """s32, b32 float32. z = s + b in FP32; ties -> lower expert index; alpha = (k+1)-th z."""
    m, n = s32.shape
    z = (s32 + b32).astype(f32).astype(np.float64)
    if groups > 1:
        gs = n // groups
        zg = np.sort(z.reshape(m, groups, gs), axis=2)[:, :, ::-1]
        # float32 sum, as DeepSeek-V3's Gate does it in the scores' dtype: 0.5 + 1e-13 ties with 0.5
        gscore = zg[:, :, 0].astype(f32) + (zg[:, :, 1].astype(f32) if gs > 1 else f32(0))
        gorder = np.lexsort((np.broadcast_to(np.arange(groups), (m, groups)), -gscore), axis=1)
        keep = np.zeros((m, groups), bool)
        np.put_along_axis(keep, gorder[:, :topk_groups], True, axis=1)
        z = np.where(np.repeat(keep, gs, axis=1), z, -np.inf)
    order = np.array([np.lexsort((np.arange(n), -z[i])) for i in range(m)])
    sel = order[:, :k]
    alpha = np.take_along_axis(z, order[:, k:k + 1], 1)[:, 0]
    ss = np.take_along_axis(s32.astype(np.float64), sel, 1)
    w = ss / ss.sum(1, keepdims=True) * scale
    load = np.bincount(sel[real].ravel(), minlength=n)
    return np.where(real[:, None], sel, -1), np.where(real[:, None], w, 0.0), load, alpha


def exact_bias(s32, alpha, b, k, real, ema):
    r = alpha[real, None] - s32[real].astype(np.float64)
    mr, n = r.shape
    if mr == 0:
        return b.astype(np.float64)
    bn = np.sort(r, axis=0)[(mr * k) // n]
    bn = bn - bn.mean()
    if ema:
        bn = ema * b + (1 - ema) * bn
        bn = bn - bn.mean()
    return bn


def route_case(label, s, k, bias=None, mask=None, opts=(), kind="scores", groups=1, topk_groups=1, update="histogram",
               bins=1000, ema=0.0, scale=1.0):
    m, n = s.shape
    d = ck.newdir()
    save(d, kind, s)
    if kind == "logits":
        s32 = (1.0 / (1.0 + np.exp(-s.astype(np.float64)))).astype(f32)
    elif s.dtype in (np.uint16, ml_dtypes.bfloat16):
        s32 = s.view(ml_dtypes.bfloat16).astype(f32) if s.dtype == np.uint16 else s.astype(f32)
    else:
        s32 = s.astype(f32)
    b32 = np.zeros(n, f32) if bias is None else bias.astype(f32)
    if bias is not None:
        save(d, "bias", bias)
    real = np.ones(m, bool) if mask is None else (mask != 0)
    if mask is not None:
        save(d, "mask", mask)
    rc, text, cmd = run(d, "route", ["--k", str(k)] + list(opts))
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:300]}", cmd)
        return
    idx, w, ld, nb = (ck.out(d, x) for x in ("indices", "weights", "load", "new_bias"))
    sel, wr, load, alpha = route_ref(s32, b32, k, scale, real, groups, topk_groups)
    if idx.dtype != np.int32 or not np.array_equal(idx, sel):
        bad = np.flatnonzero((idx != sel).any(1)) if idx.shape == sel.shape else [0]
        ck.fail(label, f"indices differ (token {bad[0]}: got {idx[bad[0]].tolist()}, expected {sel[bad[0]].tolist()})", cmd)
    elif not np.array_equal(ld, load) or ld.dtype != np.int64:
        ck.fail(label, f"load {ld.tolist()} != {load.tolist()}", cmd)
    elif not (w.dtype == f32 and np.all(np.abs(w - wr) <= 2e-6 * abs(scale) + 1e-30)):
        ck.fail(label, f"weights: max err {np.abs(w - wr).max():.2e}", cmd)
    else:
        ck.ok(label + " routing")
    if groups > 1:
        if not np.array_equal(nb, b32):
            ck.fail(label, "--groups: new_bias is not the input bias", cmd)
        return
    bx = exact_bias(s32, alpha, b32.astype(np.float64), k, real, ema)
    if update == "exact":
        err, tol = np.abs(nb - bx).max(), 2e-6
    elif not real.any():
        err, tol = np.abs(nb - b32).max(), 0.0
    elif bins == 1:
        # one bin: every expert gets lo + t*w with the same t, which centring makes 0
        ref = np.zeros(n) if not ema else ema * b32 - (ema * b32).mean()
        err, tol = np.abs(nb - ref).max(), 2e-6
    else:
        # spec A.4.3 targets the R-th smallest margin, R = max(1, ceil(mk/n)) (A.4.2's exact update
        # takes the (floor(mk/n)+1)-th: one order statistic apart when mk/n is integral). The
        # estimate lies in that margin's bin: |b^ - b| <= w before centring, <= 2w after it.
        width = (float(b32.max()) - float(b32.min()) + 2) / bins
        r = alpha[real, None] - s32[real].astype(np.float64)
        R = max(1, int(np.ceil(r.shape[0] * k / n)))
        bh = np.sort(r, axis=0)[R - 1]
        bh = bh - bh.mean()
        if ema:
            bh = ema * b32 + (1 - ema) * bh
            bh = bh - bh.mean()
        err, tol = np.abs(nb - bh).max(), 2 * width * (1 - ema) + 4e-6
    if nb.dtype != f32 or not err <= tol:
        ck.fail(label, f"new_bias ({update}, bins {bins}): max err {err:.3e} > {tol:.1e}; got {nb[:6]}, ref {bx[:6]}", cmd)
    else:
        ck.ok(label + " new_bias")


def route_cases(rng):
    # k = n - 1, n not a multiple of 16, m = 1 and small m, both updates
    for n in (2, 7, 13, 17, 33):
        for m in (1, 3):
            s = rng.uniform(0.01, 0.99, (m, n)).astype(f32)
            b = (rng.standard_normal(n) * 0.1).astype(f32)
            route_case(f"route k=n-1 n={n} m={m} exact", s, n - 1, b, opts=["--update", "exact"], update="exact")
            route_case(f"route k=n-1 n={n} m={m} hist", s, n - 1, b, opts=["--bins", "4096"], bins=4096)
            route_case(f"route k=1 n={n} m={m} exact ema", s, 1, b, opts=["--update", "exact", "--ema", "0.5"], update="exact", ema=0.5)
    # exact ties across the cut-off: every row holds runs of equal scores; ties -> lower index
    s = (rng.integers(0, 4, (64, 13)) / 4).astype(f32)
    route_case("route ties at cut-off", s, 5, opts=["--update", "exact"], update="exact")
    route_case("route ties all equal row", np.full((5, 9), 0.25, f32), 4, opts=["--update", "exact"], update="exact")
    # bias all equal: histogram range [b - 1, b + 1]; equal bias routes as no bias
    s = rng.uniform(0, 1, (300, 20)).astype(f32)
    route_case("route bias all equal hist", s, 3, np.full(20, 0.375, f32), bins=1000)
    route_case("route bias all equal exact", s, 3, np.full(20, -2.5, f32), opts=["--update", "exact"], update="exact")
    # histogram with 1, 2 and 2^20 bins, with and without EMA
    b = (rng.standard_normal(20) * 0.05).astype(f32)
    route_case("route bins=1", s, 3, b, opts=["--bins", "1"], bins=1)
    route_case("route bins=1 ema", s, 3, b, opts=["--bins", "1", "--ema", "0.75"], bins=1, ema=0.75)
    route_case("route bins=2", s, 3, b, opts=["--bins", "2"], bins=2)
    route_case("route bins=2^20", s, 3, b, opts=["--bins", str(1 << 20)], bins=1 << 20)
    route_case("route bins=2^20 ema", s, 3, b, opts=["--bins", str(1 << 20), "--ema", "0.3"], bins=1 << 20, ema=0.3)
    # padding: all tokens padding keeps the bias (both updates); a single real token
    mask0 = np.zeros(6, np.uint8)
    for upd in ("exact", "histogram"):
        route_case(f"route all padding {upd}", s[:6], 3, b, mask=mask0, opts=["--update", upd, "--ema", "0.5"], update=upd, ema=0.5)
    one = np.zeros(6, bool)
    one[4] = True
    route_case("route one real token exact", s[:6], 3, b, mask=one, opts=["--update", "exact"], update="exact")
    route_case("route mask float 0.5 / -1", s[:4], 3, b, mask=np.array([0.5, 0, -1, 0]), opts=["--update", "exact"], update="exact")
    # float64 scores: rounded to float32 first, so values equal in float32 tie (lower index)
    s64 = np.tile(np.array([0.5, 0.5 + 1e-12, 0.25, 0.5 - 1e-13, 0.75]), (3, 1))
    route_case("route float64 ties after rounding", s64, 2, opts=["--update", "exact"], update="exact")
    # bfloat16 scores (ties everywhere) as ml_dtypes and as '<u2'
    sb = rng.uniform(0, 1, (40, 12)).astype(ml_dtypes.bfloat16)
    route_case("route bf16 scores", sb.view(np.uint16), 4, b[:12], opts=["--update", "exact"], update="exact")
    # saturated logits: sigmoid is exactly 1 (or 0 / subnormal) in float32 -> ties at the cut-off
    # (not 17: float32 1/(1+exp(-17)) is 1.0, the correctly rounded sigmoid 1 - 2^-24; see check_random_sweeps.py)
    lg = rng.choice(np.array([-200, -100, -30, 0, 30, 80], f32), (40, 10))
    route_case("route saturated logits exact", lg, 4, kind="logits", opts=["--update", "exact"], update="exact")
    route_case("route saturated logits hist", lg, 4, kind="logits", opts=["--bins", "50"], bins=50)
    route_case("route saturated logits groups", lg, 4, kind="logits", groups=5, topk_groups=3, opts=["--groups", "5", "--topk-groups", "3"])
    # bfloat16 scores saved by ml_dtypes ('|V2') rather than as '<u2' bits
    route_case("route bf16 |V2 scores", sb, 4, b[:12], opts=["--update", "exact"], update="exact")
    # groups: ties between group scores (lower group first), ties inside groups, groups of 1 expert
    s = (rng.integers(0, 3, (50, 16)) / 8).astype(f32)
    route_case("route group ties", s, 4, groups=4, topk_groups=2, opts=["--groups", "4", "--topk-groups", "2"])
    route_case("route groups of one", s, 3, groups=16, topk_groups=5, opts=["--groups", "16", "--topk-groups", "5"])
    route_case("route groups k = all kept", s, 7, groups=8, topk_groups=4, opts=["--groups", "8", "--topk-groups", "4"])
    s = rng.uniform(0, 1, (7, 15)).astype(f32)
    route_case("route groups n=15 of 5, k=n-1", s, 14, (rng.standard_normal(15) * 0.1).astype(f32), groups=3, topk_groups=3,
               opts=["--groups", "3", "--topk-groups", "3"])
    route_case("route groups scale 2.5 logits", (rng.standard_normal((9, 12)) * 3).astype(f32), 3, kind="logits", groups=6,
               topk_groups=2, opts=["--groups", "6", "--topk-groups", "2", "--scale", "2.5"], scale=2.5)
    # --solve with a mask and k = n - 1: routing uses the written bias and is balanced
    s = rng.uniform(0, 1, (97, 11)).astype(f32)
    mask = (rng.random(97) < 0.8).astype(np.uint8)
    d = ck.newdir()
    save(d, "scores", s)
    save(d, "mask", mask)
    rc, text, cmd = run(d, "route", ["--k", "10", "--solve", "--iterations", "20"])
    if rc != 0:
        ck.fail("route solve k=n-1", f"exit {rc}: {text[:300]}", cmd)
    else:
        nb = ck.out(d, "new_bias")
        sel, _, load, _ = route_ref(s, nb, 10, 1.0, mask != 0)
        if not np.array_equal(ck.out(d, "indices"), sel) or np.abs(load - mask.sum() * 10 / 11).max() > 2.0:
            ck.fail("route solve k=n-1", f"loads {load.tolist()} (q = {mask.sum() * 10 / 11:.2f})", cmd)
        else:
            ck.ok("route solve k=n-1")

    # errors: options that would be ignored, ambiguous inputs, bad masks, bad option values
    s = rng.uniform(0, 1, (8, 12)).astype(f32)
    for opts, must in ((["--solve", "--update", "exact"], "--update"), (["--solve", "--bins", "9"], "--bins"),
                       (["--solve", "--ema", "0.1"], "--ema"), (["--solve", "--update", "histogram"], "--update"),
                       (["--groups", "3", "--update", "exact"], "--update"), (["--groups", "2", "--bins", "5"], "--bins"),
                       (["--groups", "2", "--ema", "0"], "--ema"), (["--groups", "2", "--solve"], "--solve"),
                       (["--iterations", "3"], "--iterations"), (["--update", "exact", "--bins", "100"], "--bins"),
                       (["--groups", "5"], "--groups"), (["--groups", "0"], "--groups"), (["--topk-groups", "2"], "--topk-groups"),
                       (["--groups", "4", "--topk-groups", "5"], "--topk-groups"), (["--groups", "4", "--topk-groups", "1", "--k", "4"], "--k"),
                       (["--scale", "nan"], "--scale"), (["--scale", "1e39"], "--scale"), (["--bins", "0"], "--bins"),
                       (["--iterations", "0", "--solve"], "--iterations"), (["--k", "12"], "--k")):
        d = ck.newdir()
        save(d, "scores", s)
        o = list(opts) if "--k" in opts else ["--k", "2"] + list(opts)
        expect_error(f"route bad {' '.join(opts)}", d, "route", o, must)
    for b in (np.full(12, 1e8, f32), np.array([3e38, -3e38] + [0] * 10, f32)):
        d = ck.newdir()
        save(d, "scores", s)
        save(d, "bias", b)
        expect_error(f"route histogram bias {b[:2]}", d, "route", ["--k", "2"], "'bias'")
    d = ck.newdir()
    save(d, "scores", s)
    save(d, "logits", s)
    expect_error("route both scores and logits", d, "route", ["--k", "2"], "logits.npy")
    for bad in (np.nan, np.inf):
        d = ck.newdir()
        save(d, "scores", s)
        save(d, "mask", np.array([1, 0, bad, 1, 1, 1, 1, 1]))
        expect_error(f"route mask {bad}", d, "route", ["--k", "2"], "mask")
    d = ck.newdir()
    save(d, "scores", s)
    save(d, "mask", np.zeros(8, bool))
    expect_error("route solve all padding", d, "route", ["--k", "2", "--solve"], "padding")


# ------------------------------------------------------------------------------------------------
# quant / dequant (spec B.1-B.7)

ELEM = {  # ml_dtype, max finite, emax (exponent of the largest binade)
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15),
    "e3m2": (ml_dtypes.float6_e3m2fn, 28.0, 4), "e2m3": (ml_dtypes.float6_e2m3fn, 7.5, 2),
    "e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 2)}
MXNAME = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp6": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1"}


def encode(v32, elem):
    """RNE into the element format after clamping to +-max (B.4: normal overflow is clamped)."""
    dt, mx, _ = ELEM[elem]
    return np.clip(v32, -mx, mx).astype(f32).astype(dt)


def decode(codes_u8, elem):
    dt = ELEM[elem][0]
    mask = {"e2m1": 0x0F, "e3m2": 0x3F, "e2m3": 0x3F}.get(elem, 0xFF)
    return (codes_u8 & mask).astype(np.uint8).view(dt).astype(f32)


def f32_exponent(a):
    return ((a.astype(f32).view(np.uint32) >> 23) & 0xFF).astype(np.int64) - 127


def ceil_pow2_exp(v):
    """ceil(log2 v) for positive finite float32 v (exact, from the bits)."""
    bits = v.astype(f32).view(np.uint32)
    e, man = ((bits >> 23) & 0xFF).astype(np.int64), (bits & 0x7FFFFF)
    sub = e == 0
    # subnormal: v = man * 2^-149
    lg_sub = np.where(man > 0, np.ceil(np.log2(np.maximum(man, 1))), 0).astype(np.int64) - 149
    return np.where(sub, lg_sub, e - 127 + (man != 0))


def mx_ref(x32, elem, rule):
    rows, K = x32.shape
    xb = x32.reshape(rows, K // 32, 32)
    with np.errstate(invalid="ignore"):
        amax = np.abs(xb).max(2)
    fin = np.isfinite(amax)
    a = np.where(fin & (amax > 0), amax, 1.0).astype(f32)
    _, mx, emax = ELEM[elem]
    if rule == "floor":
        se = f32_exponent(a) - emax
        se = np.where(a < np.finfo(f32).tiny, np.floor(np.log2(a.astype(np.float64))).astype(np.int64) - emax, se)
    else:
        se = ceil_pow2_exp((a / f32(mx)).astype(f32))
    se = np.where(amax == 0, -127, se)
    se = np.maximum(se, -127)
    X = np.where(fin, se + 127, 255).astype(np.uint8)
    scale = np.ldexp(np.ones_like(se, dtype=np.float64), -se).astype(f32)  # exact powers of two
    with np.errstate(invalid="ignore", over="ignore"):
        v = (xb * scale[:, :, None]).astype(f32)
    P = encode(np.where(fin[:, :, None], v, 0), elem).reshape(rows, K)
    deq = np.where(np.repeat(fin, 32, 1), P.astype(f32) * np.repeat(np.ldexp(1.0, se).astype(f32), 32, 1), np.nan).astype(f32)
    return X, P, deq


def deepseek_ref(x32, tr, tc, ue8m0):
    rows, K = x32.shape
    sr, sc = -(-rows // tr), -(-K // tc)
    S = np.zeros((sr, sc), f32)
    q = np.zeros((rows, K), ml_dtypes.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = x32[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
            if not np.isfinite(blk).all():  # the spec leaves this open; k3 documents s = NaN, codes 0x7F
                S[i, j] = np.nan
                q[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc] = np.uint8(0x7F).view(ml_dtypes.float8_e4m3fn)
                continue
            s = f32(max(f32(np.abs(blk).max()), f32(1e-4)) / f32(448))
            if ue8m0:
                s = f32(np.ldexp(1.0, int(ceil_pow2_exp(np.array([s]))[0])))
            S[i, j] = s
            q[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc] = encode((blk * (f32(1) / s)).astype(f32), "e4m3")
    deq = (q.astype(f32) * np.repeat(np.repeat(S, tr, 0)[:rows], tc, 1)[:, :K]).astype(f32)
    return S, q, deq


def nvfp4_ref(x32):
    rows, K = x32.shape
    fin = np.isfinite(x32)
    # k3 documents: tensor scale over the finite values, a non-finite block gets scale 0x7F (NaN)
    g = f32(f32(np.abs(np.where(fin, x32, 0)).max()) / f32(448 * 6))
    xb = x32.reshape(rows, K // 16, 16)
    bfin = fin.reshape(rows, K // 16, 16).all(2)
    bs = (np.abs(np.where(bfin[:, :, None], xb, 0)).max(2) / f32(6)).astype(f32)
    sb = np.clip((bs / g).astype(f32), 2.0 ** -6, 448).astype(f32).astype(ml_dtypes.float8_e4m3fn)
    sb = np.where(bfin, sb.view(np.uint8), np.uint8(0x7F)).astype(np.uint8)
    sbf = sb.view(ml_dtypes.float8_e4m3fn).astype(f32)
    # torchao's current form x * ((1/g)/sb) in fp32; x / (g*sb) where that reciprocal overflows
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rec = ((f32(1) / g) / sbf).astype(f32)
        xf = np.where(bfin[:, :, None], xb, 0).astype(f32)
        y = np.where(np.isfinite(rec)[:, :, None], xf * rec[:, :, None], xf / (g * sbf)[:, :, None]).astype(f32)
    P = encode(np.where(bfin[:, :, None], y, 0), "e2m1").reshape(rows, K)
    deq = (P.astype(f32) * np.repeat((sbf * g).astype(f32), 16, 1)).astype(f32)
    return g, sb, P, deq


def pack4(P):
    b = P.view(np.uint8) & 0x0F
    return (b[:, 0::2] | (b[:, 1::2] << 4)).astype(np.uint8)


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def nan_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nn = np.isnan(a) | np.isnan(b)
    return np.array_equal(np.isnan(a), np.isnan(b)) and a[~nn].view(np.uint32).tolist() == b[~nn].view(np.uint32).tolist()


def quant_case(label, x, fmt, block=None, scale=None):
    """x float32 / bfloat16 (ml_dtypes) of any rank >= 1."""
    d = ck.newdir()
    save(d, "x", x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x)
    opts = ["--format", fmt] + (["--block", block] if block else []) + (["--scale", scale] if scale else [])
    rc, text, cmd = run(d, "quant", opts)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:300]}", cmd)
        return
    shp = x.shape
    x32 = x.astype(f32).reshape(-1, shp[-1])
    codes, scales, deq = ck.out(d, "codes"), ck.out(d, "scales"), ck.out(d, "dequant")
    if fmt == "nvfp4":
        g, sb, P, dref = nvfp4_ref(x32)
        want = [("tensor_scale", ck.out(d, "tensor_scale"), np.array([g], f32)),
                ("scales", scales, sb.reshape(shp[:-1] + (shp[-1] // 16,)))]
        cm = np.repeat(sb != 0x7F, 8, 1)  # codes of NaN blocks are unspecified
        got_c = codes.reshape(x32.shape[0], -1)
        if not (got_c.shape == cm.shape and np.array_equal(got_c[cm], pack4(P)[cm])):
            ck.fail(label, "codes differ from the NVFP4 reference", cmd)
            return
    elif fmt in MXNAME or (block == "32"):
        elem = MXNAME.get(fmt, fmt)
        X, P, dref = mx_ref(x32, elem, scale or "floor")
        fin = np.repeat(X != 255, 32, 1)
        c = pack4(P) if elem == "e2m1" else P.view(np.uint8)
        got_c = codes.reshape(x32.shape[0], -1)
        if elem == "e2m1":  # codes of NaN blocks are unspecified: compare the finite blocks only
            cm = fin[:, 0::2]
        else:
            cm = fin
        want = [("scales", scales, X.reshape(shp[:-1] + (shp[-1] // 32,)))]
        if not (got_c.shape == c.shape and np.array_equal(got_c[cm], c[cm])):
            ck.fail(label, "codes differ from the MX reference", cmd)
            return
    else:
        tr, tc = {"1x128": (1, 128), "128x128": (128, 128), "128x1": (128, 1)}[block or "1x128"]
        S, q, dref = deepseek_ref(x32, tr, tc, scale == "ue8m0")
        want = [("scales", scales, S), ("codes", codes, q.view(np.uint8).reshape(shp))]
    for nm, got, ref in want:
        if not bits_equal(got, ref):
            diff = np.flatnonzero(got.ravel() != ref.ravel())[:3] if got.shape == ref.shape else "shape"
            ck.fail(label, f"{nm}: {got.dtype}{got.shape} vs {ref.dtype}{ref.shape}, first diffs {diff}", cmd)
            return
    if not nan_equal(deq.reshape(x32.shape), dref) or deq.shape != shp:
        ck.fail(label, "dequant differs from the reference", cmd)
        return
    # k3 dequant of these files gives dequant.npy back
    os.rename(os.path.join(d, "out"), os.path.join(d, "q"))
    for f in ("codes", "scales", "tensor_scale"):
        p = os.path.join(d, "q", f + ".npy")
        if os.path.exists(p):
            os.replace(p, os.path.join(d, "in", f + ".npy"))
    rc, text, cmd = run(d, "dequant", opts if fmt != "nvfp4" else ["--format", "nvfp4"])
    if rc != 0 or not nan_equal(ck.out(d, "x"), deq) or ck.out(d, "x").shape != shp:
        ck.fail(label, f"k3 dequant of k3 quant's files: exit {rc} {text[:200]}", cmd)
        return
    ck.ok(label)


def special_bf16(rng, shape):
    x = rng.standard_normal(shape).astype(f32) * np.exp2(rng.integers(-20, 20, shape)).astype(f32)
    flat = x.reshape(-1)
    n = flat.size
    sub = rng.choice(n, n // 8, replace=False)
    flat[sub] = (rng.integers(1, 127, sub.size) * np.float64(2.0 ** -133) * rng.choice([-1, 1], sub.size)).astype(f32)  # bf16 subnormals
    return x.astype(ml_dtypes.bfloat16)


def quant_cases(rng):
    shapes_mx = [(64,), (2, 3, 96), (1, 1, 32), (5, 160)]
    for fmt in ("mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e2m3", "mxfp4"):
        for rule in ("floor", "rceil"):
            for shp in shapes_mx:
                x = (rng.standard_normal(shp) * np.exp2(rng.integers(-30, 30, shp[:-1] + (1,)))).astype(f32)
                quant_case(f"quant {fmt} {rule} {shp}", x, fmt, scale=rule)
            x = special_bf16(rng, (3, 2, 64))
            quant_case(f"quant {fmt} {rule} bf16 subnormals", x, fmt, scale=rule)
    # scale-rule boundaries: block amax at elem_max * 2^j (RCEIL exact), one ulp either side,
    # powers of two (FLOOR), float32 subnormal and maximal amax, all-zero blocks
    for fmt, elem in MXNAME.items():
        mx = ELEM[elem][1]
        amaxes = []
        for j in (-140, -127, -100, -1, 0, 3, 60, 112):
            a = np.float32(np.ldexp(mx, j))
            if np.isfinite(a) and a > 0:
                amaxes += [a, np.nextafter(a, f32(0)), np.nextafter(a, f32(np.inf))]
            amaxes += [np.float32(np.ldexp(1.0, j)), np.nextafter(np.float32(np.ldexp(1.0, j)), f32(0))]
        amaxes += [np.float32(2.0 ** -149), np.float32(3 * 2.0 ** -149), np.finfo(f32).max, f32(0), np.finfo(f32).tiny]
        amaxes = np.array([a for a in amaxes if a >= 0], f32)
        x = (rng.uniform(-1, 1, (len(amaxes), 32)) * amaxes[:, None]).astype(f32)
        pos = rng.integers(0, 32, len(amaxes))
        x[np.arange(len(amaxes)), pos] = amaxes * rng.choice([-1, 1], len(amaxes)).astype(f32)
        for rule in ("floor", "rceil"):
            quant_case(f"quant {fmt} {rule} amax boundaries", x, fmt, scale=rule)
    for elem in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"):  # element names with --block 32
        quant_case(f"quant {elem} --block 32", rng.standard_normal((4, 64)).astype(f32), elem, block="32", scale="rceil")
    # float64 input: rounded to float32 first (1e39 becomes Inf: that block is NaN)
    x = rng.standard_normal((3, 64)) * 100
    x[1, 40] = 1e39
    x[0, 5] = -np.inf
    x[2, 3] = 1 + 2.0 ** -24 + 2.0 ** -40  # just above a float32 rounding midpoint
    for fmt, blk in (("mxfp8", None), ("e4m3", "1x128"), ("nvfp4", None)):
        quant_case(f"quant {fmt} float64 input", x, fmt, block=blk)
    # NaN / Inf blocks (bf16): MX scale 0xFF, the block dequantises to NaN, other blocks unaffected
    x = rng.standard_normal((2, 3, 64)).astype(f32)
    x[0, 1, 5], x[1, 2, 40], x[1, 0, 33] = np.nan, np.inf, -np.inf
    for fmt in ("mxfp8", "mxfp4", "mxfp6", "nvfp4", "e4m3"):
        quant_case(f"quant {fmt} nan/inf bf16", x.astype(ml_dtypes.bfloat16), fmt)
    for shp in [(200,), (3, 2, 130), (129, 1), (130, 257), (1, 1, 5)]:
        for block in ("1x128", "128x128", "128x1"):
            for sc in ("fp32", "ue8m0"):
                x = (rng.standard_normal(shp) * 10.0 ** rng.uniform(-6, 6)).astype(f32)
                quant_case(f"quant e4m3 {block} {sc} {shp}", x, "e4m3", block=block, scale=sc)
    am = []
    for j in (-20, -13, -12, 0, 10, 100, 118):
        a = np.float32(np.ldexp(448.0, j))
        am += [a, np.nextafter(a, f32(0)), np.nextafter(a, f32(np.inf))]
    am += [f32(1e-4), np.nextafter(f32(1e-4), f32(0)), np.nextafter(f32(1e-4), f32(1)), f32(0), np.finfo(f32).max, f32(1e-40)]
    am = np.array(am, f32)
    x = (rng.uniform(-1, 1, (len(am), 130)) * am[:, None]).astype(f32)
    x[np.arange(len(am)), rng.integers(0, 130, len(am))] = am
    x[np.arange(len(am)), 128 + rng.integers(0, 2, len(am))] = am[::-1]  # the partial tile gets another amax
    for sc in ("fp32", "ue8m0"):
        quant_case(f"quant e4m3 1x128 {sc} amax boundaries", x, "e4m3", block="1x128", scale=sc)
        quant_case(f"quant e4m3 128x1 {sc} amax boundaries", x.T.copy(), "e4m3", block="128x1", scale=sc)
    # NVFP4: blocks far below the tensor amax (UE4M3 scale clamped at 2^-6), tiny tensors
    x = (rng.standard_normal((6, 64)) * np.array([1, 1e-2, 1e-4, 1e-6, 1e3, 0])[:, None]).astype(f32)
    quant_case("quant nvfp4 mixed magnitudes", x, "nvfp4")
    for mag in (1e-20, 1e-33, 1e-38, 1e30):  # below amax 2.4e-39 k3 documents all-zero codes (g = 1)
        quant_case(f"quant nvfp4 tensor amax ~{mag:g}", (rng.standard_normal((2, 32)) * mag).astype(f32), "nvfp4")
    quant_case("quant e4m3 1x128 bf16 subnormals", special_bf16(rng, (2, 2, 200)), "e4m3", block="1x128")
    for shp in [(16,), (2, 3, 48), (7, 32)]:
        quant_case(f"quant nvfp4 {shp}", (rng.standard_normal(shp) * 3).astype(f32), "nvfp4")
    quant_case("quant nvfp4 bf16", rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16), "nvfp4")
    # extents that must be rejected, options that do not fit the format
    for fmt, shp, must in (("mxfp4", (3, 48), "32"), ("mxfp8", (40,), "32"), ("nvfp4", (2, 24), "16"), ("nvfp4", (8,), "16")):
        d = ck.newdir()
        save(d, "x", np.ones(shp, f32))
        expect_error(f"quant bad {fmt} {shp}", d, "quant", ["--format", fmt], must)
    for opts, must in ((["--format", "mxfp8", "--scale", "fp32"], "floor|rceil"), (["--format", "e4m3", "--scale", "floor"], "fp32|ue8m0"),
                       (["--format", "nvfp4", "--block", "32"], "16"), (["--format", "mxfp6", "--block", "1x128"], "32"),
                       (["--format", "e2m1", "--block", "16"], "32"), (["--format", "fp8"], "format")):
        d = ck.newdir()
        save(d, "x", np.ones((2, 128), f32))
        expect_error(f"quant bad {' '.join(opts)}", d, "quant", opts, must)

    # k3 dequant of random bytes from elsewhere (ml_dtypes decodes them)
    for fmt, elem in MXNAME.items():
        for shp in [(3, 64), (2, 1, 96), (32,)]:
            K = shp[-1]
            P = rng.integers(0, 256, shp[:-1] + (K,), dtype=np.uint8)
            if elem in ("e3m2", "e2m3"):
                P &= 0x3F
            if elem == "e2m1":
                P &= 0x0F
            X = rng.integers(0, 256, shp[:-1] + (K // 32,), dtype=np.uint8)
            X.reshape(-1)[:3] = [0, 254, 255][:X.size]
            codes = pack4(P.reshape(-1, K)).reshape(shp[:-1] + (K // 2,)) if elem == "e2m1" else P
            d = ck.newdir()
            save(d, "codes", codes)
            save(d, "scales", X)
            rc, text, cmd = run(d, "dequant", ["--format", fmt])
            Xf = X.reshape(-1, K // 32).astype(np.int64)
            with np.errstate(over="ignore"):
                ref = decode(P.reshape(-1, K), elem) * np.repeat(np.ldexp(1.0, Xf - 127), 32, 1).astype(f32)
            ref = np.where(np.repeat(Xf == 255, 32, 1), np.nan, ref).astype(f32)
            if rc != 0 or not nan_equal(ck.out(d, "x").reshape(-1, K), ref) or ck.out(d, "x").shape != shp:
                ck.fail(f"dequant {fmt} random bytes {shp}", f"exit {rc} {text[:200]}", cmd)
            else:
                ck.ok(f"dequant {fmt} random bytes {shp}")
    for block, (tr, tc) in (("1x128", (1, 128)), ("128x128", (128, 128)), ("128x1", (128, 1))):
        shp = (3, 2, 150)
        q = rng.integers(0, 256, shp, dtype=np.uint8)
        rows = 6
        S = (rng.standard_normal((-(-rows // tr), -(-150 // tc))) * 1e-3).astype(f32)
        d = ck.newdir()
        save(d, "codes", q)
        save(d, "scales", S)
        rc, text, cmd = run(d, "dequant", ["--format", "e4m3", "--block", block])
        ref = (q.reshape(rows, 150).view(ml_dtypes.float8_e4m3fn).astype(f32) *
               np.repeat(np.repeat(S, tr, 0)[:rows], tc, 1)[:, :150]).astype(f32)
        if rc != 0 or not nan_equal(ck.out(d, "x").reshape(rows, 150), ref):
            ck.fail(f"dequant e4m3 {block} random bytes", f"exit {rc} {text[:200]}", cmd)
        else:
            ck.ok(f"dequant e4m3 {block} random bytes")
    P = rng.integers(0, 16, (4, 64), dtype=np.uint8)
    sb = rng.integers(0, 0x7F, (4, 4), dtype=np.uint8)
    g = f32(0.0123)
    d = ck.newdir()
    save(d, "codes", pack4(P))
    save(d, "scales", sb)
    save(d, "tensor_scale", np.array([g], f32))
    rc, text, cmd = run(d, "dequant", ["--format", "nvfp4"])
    ref = (decode(P, "e2m1") * np.repeat((sb.view(ml_dtypes.float8_e4m3fn).astype(f32) * g).astype(f32), 16, 1)).astype(f32)
    if rc != 0 or not nan_equal(ck.out(d, "x"), ref):
        ck.fail("dequant nvfp4 random bytes", f"exit {rc} {text[:200]}", cmd)
    else:
        ck.ok("dequant nvfp4 random bytes")

    # malformed scales: wrong dtype, wrong shape (incl. a transposed / re-split leading shape)
    c = np.zeros((2, 3, 64), np.uint8)
    for fmt, scales, must in (("mxfp8", np.zeros((2, 3, 2), f32), "scales"), ("mxfp8", np.zeros((2, 3, 3), np.uint8), "scales"),
                              ("mxfp8", np.zeros((3, 2, 2), np.uint8), "scales"), ("mxfp8", np.zeros((12,), np.uint8), "scales"),
                              ("mxfp8", np.zeros((6, 1, 2), np.uint8), "scales"), ("mxfp4", np.zeros((2, 3, 2), np.uint8), "scales"),
                              ("e4m3", np.zeros((6, 1), np.uint8), "scales"), ("e4m3", np.zeros((6, 1, 1), f32), "scales"),
                              ("e4m3", np.zeros((1, 6), f32), "scales"), ("mxfp6", np.zeros((6, 2), np.uint16), "scales")):
        d = ck.newdir()
        save(d, "codes", c)
        save(d, "scales", scales)
        expect_error(f"dequant bad scales {fmt} {scales.dtype}{scales.shape}", d, "dequant", ["--format", fmt], must)
    d = ck.newdir()
    save(d, "codes", c)
    save(d, "scales", np.zeros((6, 2), np.uint8))  # the flattened 2-D form is accepted
    rc, text, cmd = run(d, "dequant", ["--format", "mxfp8"])
    if rc != 0 or ck.out(d, "x").shape != (2, 3, 64):
        ck.fail("dequant 2-D scales for 3-D codes", f"exit {rc} {text[:200]}", cmd)
    else:
        ck.ok("dequant 2-D scales for 3-D codes")
    for nm, arr, must in (("scales", np.full((2, 4), 0x88, np.uint8), "scales"), ("scales", np.full((2, 4), 0xFF, np.uint8), "scales"),
                          ("codes", np.zeros((2, 64), f32), "codes"), ("tensor_scale", np.array([0.0], f32), "tensor_scale"),
                          ("tensor_scale", np.array([1.0, 2.0], f32), "tensor_scale"), ("tensor_scale", np.array([np.nan], f32), "tensor_scale")):
        d = ck.newdir()
        save(d, "codes", np.zeros((2, 32), np.uint8))
        save(d, "scales", np.zeros((2, 4), np.uint8))
        save(d, "tensor_scale", np.array([1.0], f32))
        save(d, nm, arr)
        expect_error(f"dequant nvfp4 bad {nm} {arr.tolist()}", d, "dequant", ["--format", "nvfp4"], must)


# ------------------------------------------------------------------------------------------------
# attnres (spec 2.1, 5.2)

def attn_ref(V, w, g, eps):
    """V [n, T, d] (complex allowed for the complex step), w, g [d] -> h [T, d]."""
    d = V.shape[-1]
    u = g * w
    r = 1.0 / np.sqrt((V * V).sum(-1) / d + eps)
    sc = r * (V @ u)
    sc = sc - sc.real.max(0, keepdims=True)
    e = np.exp(sc)
    a = e / e.sum(0, keepdims=True)
    return (a[..., None] * V).sum(0)


def attn_case(label, n, T, d, part, dtype=np.float64, eps=1e-5, mag=1.0, order="C", rng=None, wdtype=None):
    bank = (rng.standard_normal((n, T, d)) * mag).astype(dtype)
    P = (rng.standard_normal((T, d)) * mag).astype(dtype) if part else None
    w = rng.standard_normal(d).astype(wdtype or dtype)
    g = (1 + 0.3 * rng.standard_normal(d)).astype(wdtype or dtype)
    dh = rng.standard_normal((T, d)).astype(dtype)
    dd = ck.newdir()
    save(dd, "sources", np.asfortranarray(bank) if order == "F" else bank)
    if part:
        save(dd, "partial", np.asfortranarray(P) if order == "F" else P)
    save(dd, "w", w)
    save(dd, "gain", g)
    save(dd, "dh", np.asfortranarray(dh) if order == "F" else dh)
    rc, text, cmd = run(dd, "attnres", ["--backward", "--eps", repr(eps)])
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:300]}", cmd)
        return
    V = bank.astype(np.float64)
    if part:
        V = np.concatenate([V, P.astype(np.float64)[None]], 0)
    w64, g64 = w.astype(np.float64), g.astype(np.float64)
    ceps = eps if dtype == np.float64 else float(f32(eps))
    h = attn_ref(V, w64, g64, ceps)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    got = ck.out(dd, "h")
    if got.dtype != dtype:
        ck.fail(label, f"h dtype {got.dtype}", cmd)
    compare(ck, label, got, h, tol, cmd, "h")
    # gradients: complex step along each coordinate (tiny shapes) of <dh, h>
    hstep = 1e-30
    dh64 = dh.astype(np.float64)

    def grad(fn, x):
        gr = np.zeros(x.shape)
        for i in np.ndindex(x.shape):
            xc = x.astype(np.complex128)
            xc[i] += 1j * hstep
            gr[i] = (fn(xc) * dh64).sum().imag / hstep
        return gr

    gV = grad(lambda Vc: attn_ref(Vc, w64, g64, ceps), V)
    gw = grad(lambda wc: attn_ref(V.astype(np.complex128), wc, g64, ceps), w64)
    gg = grad(lambda gc: attn_ref(V.astype(np.complex128), w64, gc, ceps), g64)
    gtol = 1e-10 if dtype == np.float64 else 2e-5
    compare(ck, label, ck.out(dd, "dsources"), gV[:n], gtol, cmd, "dsources")
    if part:
        compare(ck, label, ck.out(dd, "dpartial"), gV[n], gtol, cmd, "dpartial")
    elif os.path.exists(os.path.join(dd, "out", "dpartial.npy")):
        ck.fail(label, "dpartial.npy written without a partial", cmd)
    compare(ck, label, ck.out(dd, "dw"), gw, gtol, cmd, "dw")
    compare(ck, label, ck.out(dd, "dgain"), gg, gtol, cmd, "dgain")


def attn_cases(rng):
    for (n, T, d, part) in ((1, 1, 1, False), (0, 1, 1, True), (0, 3, 5, True), (1, 2, 1, True), (1, 1, 7, False),
                            (3, 1, 1, False), (2, 4, 1, True), (5, 1, 3, True), (1, 5, 2, True)):
        attn_case(f"attnres n={n} T={T} d={d} partial={part}", n, T, d, part, rng=rng)
    attn_case("attnres fortran order", 3, 4, 5, True, order="F", rng=rng)
    attn_case("attnres fortran order f32", 2, 3, 6, True, dtype=np.float32, order="F", rng=rng)
    attn_case("attnres f32 sources, f64 w/gain", 3, 2, 4, True, dtype=np.float32, wdtype=np.float64, rng=rng)
    attn_case("attnres eps 0 d=1", 2, 3, 1, True, eps=0.0, rng=rng)
    attn_case("attnres eps 1e3 tiny values", 3, 2, 3, False, eps=1e3, mag=1e-3, rng=rng)
    attn_case("attnres huge d=1", 3, 2, 1, True, mag=1e100, rng=rng)
    # mixed dtypes that are errors
    for nm, arr, must in (("partial", np.zeros((2, 3), f32), "partial"), ("dh", np.zeros((2, 3), np.int64), "dh"),
                          ("w", np.zeros(3, np.int32), "w"), ("dh", np.zeros((3, 2)), "dh"), ("partial", np.zeros((2, 4)), "partial"),
                          ("sources", np.zeros((2, 2, 3), np.int32), "sources"), ("gain", np.zeros((1, 3)), "gain")):
        d = ck.newdir()
        save(d, "sources", np.ones((2, 2, 3)))
        save(d, "w", np.ones(3))
        save(d, "gain", np.ones(3))
        save(d, "partial", np.ones((2, 3)))
        save(d, "dh", np.ones((2, 3)))
        save(d, nm, arr)
        expect_error(f"attnres bad {nm} {arr.dtype}{arr.shape}", d, "attnres", ["--backward"], must)


def main():
    rng = np.random.default_rng(20261130)
    if ck.want("route"):
        route_cases(rng)
    if ck.want("quant"):
        quant_cases(rng)
    if ck.want("attnres"):
        attn_cases(rng)
    ck.finish()


if __name__ == "__main__":
    main()
