#!/usr/bin/env python3
"""Cross-check `k3 quant` and `k3 dequant` against an independent numpy reference written from
shared/spec/quantization.md B.3-B.7 (element encodes via ml_dtypes RNE after an explicit clamp to
+-max, i.e. the saturating mode; special inputs as documented in k3/quant.hpp):
  DeepSeek E4M3 tiles 1x128 / 128x128 / 128x1: s = max(amax, 1e-4)/448 (fp32) or its bitwise
    power-of-two ceiling (UE8M0, exponent field clamped to [1, 254]); codes = e4m3(x * (1/s));
    a tile holding NaN/Inf -> s = NaN, codes 0x7F.
  MX (32-blocks): FLOOR se = floor(log2 amax) - emax_elem, RCEIL se = ceil(log2(amax/max_elem));
    se clamped below at -127; zero block -> 0x00; NaN/Inf block -> 0xFF (decodes to NaN);
    P = elem(clamp(x * 2^-se, +-max)); FP4 packed two per byte, even element in the low nibble.
  NVFP4: g = finite amax/(448*6) (1 for all-zero), sb = ue4m3(clamp(bamax/6/g, 2^-6, 448)),
    P = e2m1(clamp(x * ((1/g)/sb), +-6)) in fp32 (torchao's current form; x / (g*sb) where that
    reciprocal overflows); NaN/Inf block -> scale 0x7F."""
import os
import sys

import ml_dtypes as md
import numpy as np

np.seterr(over="ignore", invalid="ignore")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, same_outputs, save, write_raw_npy  # noqa: E402

f32 = np.float32
BF16 = md.bfloat16
ELEM = {  # name: (ml_dtypes type, emax_elem, max, NaN code or None)
    "e4m3": (md.float8_e4m3fn, 8, 448.0, 0x7F), "e5m2": (md.float8_e5m2, 15, 57344.0, 0x7F),
    "e3m2": (md.float6_e3m2fn, 4, 28.0, None), "e2m3": (md.float6_e2m3fn, 2, 7.5, None), "e2m1": (md.float4_e2m1fn, 2, 6.0, None)}
MXFMT = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp6": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1"}


def enc(y, elem):
    t, _, mx, _ = ELEM[elem]
    y = np.clip(np.asarray(y, f32), -mx, mx)
    return y.astype(t).view(np.uint8)


def dec(c, elem):
    t = ELEM[elem][0]
    return np.asarray(c, np.uint8).view(t).astype(f32)


def ceil_pow2_bits(s):
    b = np.asarray(s, f32).view(np.uint32)
    e = ((b >> 23) & 0xFF).astype(np.int64)
    man = b & 0x7FFFFF
    e = np.where(e == 0, np.where(man > 0x400000, 1, 0), np.where((man != 0) & (e != 0xFE), e + 1, e))
    return e


def e8m0_val(e):
    return np.ldexp(np.float64(1), np.asarray(e, np.int64) - 127).astype(f32)


def deepseek_ref(x, tr, tc, ue8m0):
    M, K = x.shape
    sr, sc = -(-M // tr), -(-K // tc)
    codes = np.zeros((M, K), np.uint8)
    scales = np.zeros((sr, sc), f32)
    for bi in range(sr):
        for bj in range(sc):
            blk = x[bi * tr:(bi + 1) * tr, bj * tc:(bj + 1) * tc]
            if not np.isfinite(blk).all():
                scales[bi, bj] = np.nan
                codes[bi * tr:(bi + 1) * tr, bj * tc:(bj + 1) * tc] = 0x7F
                continue
            amax = max(f32(np.abs(blk).max()), f32(1e-4))
            s = f32(amax / f32(448))
            if ue8m0:
                e = int(np.clip(ceil_pow2_bits(s), 1, 254))
                s = e8m0_val(e)
            inv = f32(f32(1) / s)
            codes[bi * tr:(bi + 1) * tr, bj * tc:(bj + 1) * tc] = enc((blk * inv).astype(f32), "e4m3")
            scales[bi, bj] = s
    return codes, scales


def deepseek_deq(codes, scales, tr, tc):
    M, K = codes.shape
    s = np.repeat(np.repeat(scales, tr, 0), tc, 1)[:M, :K]
    return (dec(codes, "e4m3") * s).astype(f32)


def floor_log2(a):
    m, e = np.frexp(np.float64(a))
    return int(e) - 1


def mx_ref(x, elem, rule):
    M, K = x.shape
    _, emax, mx, nan = ELEM[elem]
    nb = K // 32
    codes = np.zeros((M, K), np.uint8)
    scales = np.zeros((M, nb), np.uint8)
    for i in range(M):
        for b in range(nb):
            blk = x[i, b * 32:(b + 1) * 32]
            if not np.isfinite(blk).all():
                scales[i, b] = 0xFF
                codes[i, b * 32:(b + 1) * 32] = nan if nan is not None else enc(np.full(32, mx), elem)
                continue
            amax = f32(np.abs(blk).max())
            if amax == 0:
                se = -127
            elif rule == "floor":
                se = floor_log2(amax) - emax
            else:
                se = int(ceil_pow2_bits(f32(amax / f32(mx)))) - 127
            se = max(se, -127)
            scales[i, b] = se + 127
            inv = f32(np.ldexp(1.0, -se))
            codes[i, b * 32:(b + 1) * 32] = enc((blk * inv).astype(f32), elem)
    if elem == "e2m1":
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return codes, scales


def unpack4(c):
    out = np.zeros(c.shape[:-1] + (c.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = c & 0xF
    out[..., 1::2] = c >> 4
    return out


def mx_deq(codes, scales, elem):
    if elem == "e2m1":
        codes = unpack4(codes)
    M, K = codes.shape
    s = np.repeat(scales, 32, 1)[:, :K]
    v = dec(codes, elem) * e8m0_val(s)
    return np.where(s == 0xFF, np.nan, v).astype(f32)


def nvfp4_ref(x):
    M, K = x.shape
    fin = x[np.isfinite(x)]
    amax = f32(np.abs(fin).max()) if fin.size else f32(0)
    g = f32(amax / f32(448 * 6))
    if not (g > 0) or g < np.finfo(f32).tiny:
        g = f32(1)
    codes = np.zeros((M, K), np.uint8)
    scales = np.zeros((M, K // 16), np.uint8)
    for i in range(M):
        for b in range(K // 16):
            blk = x[i, b * 16:(b + 1) * 16]
            if not np.isfinite(blk).all():
                scales[i, b] = 0x7F
                codes[i, b * 16:(b + 1) * 16] = 0  # element codes unspecified for a NaN block
                continue
            bs = f32(f32(np.abs(blk).max()) / f32(6))
            r = np.clip(f32(bs / g), f32(2.0 ** -6), f32(448))
            sc = enc(np.array([r]), "e4m3")[0]
            scales[i, b] = sc
            sbf = f32(dec(np.array([sc]), "e4m3")[0])
            with np.errstate(over="ignore"):
                rec = f32(f32(f32(1) / g) / sbf)
            y = (blk * rec).astype(f32) if np.isfinite(rec) else (blk / f32(g * sbf)).astype(f32)
            codes[i, b * 16:(b + 1) * 16] = enc(np.clip(y, -6, 6), "e2m1")
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales, g


def nvfp4_deq(codes, scales, g):
    c = unpack4(codes)
    s = np.repeat(scales, 16, 1)
    v = dec(c, "e2m1").astype(np.float64) * dec(s, "e4m3").astype(np.float64) * np.float64(g)
    return np.where(s == 0x7F, np.nan, v)


def make_x(rng, shape, kind):
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
    if kind == "special":
        flat = x.reshape(-1)
        n = flat.size
        pos = rng.permutation(n)
        vals = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 3.0e38, 464.0, 400.0, 2.0 ** -10, 1.5 * 2 ** -10, 0.25, 0.75, 5.0,
                2.0 ** -130]
        for p, v in zip(pos, vals):
            flat[p] = v
        if x.shape[-1] >= 64 and x.size:  # an all-zero block and a tiny-amax block
            x.reshape(-1, x.shape[-1])[0, :64] = 0.0
            x.reshape(-1, x.shape[-1])[-1, 32:64] = rng.standard_normal(32) * 2.0 ** -128
    elif kind == "ties":  # values on element rounding ties after power-of-two scaling
        x = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 464.0, 400.0, 416.0, 448.0, 500.0, 0.0, -0.0], shape)
        x *= rng.choice([-1, 1], shape)
    return x


def equal_bytes(ck, label, name, got, ref, cmd, mask=None):
    if got.shape != ref.shape or got.dtype != ref.dtype:
        ck.fail(label, f"{name}: {got.dtype}{list(got.shape)} != expected {ref.dtype}{list(ref.shape)}", cmd)
        return False
    g2 = got if mask is None else got[mask]
    r2 = ref if mask is None else ref[mask]
    if ref.dtype == np.uint8:
        bad = g2 != r2
    else:
        bad = ~((g2 == r2) | (np.isnan(g2) & np.isnan(r2)))
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        ck.fail(label, f"{name}: {bad.sum()} of {bad.size} differ; first flat {i}: got {g2.reshape(-1)[i]!r}, expected {r2.reshape(-1)[i]!r}",
                cmd)
        return False
    ck.ok(label + " " + name)
    return True


def run_case(ck, label, rng, shape, fmt, block=None, scale=None, kind="normal", xdtype=f32):
    x = make_x(rng, shape, kind)
    xin = x.astype(xdtype)
    x32 = xin.astype(f32)
    d = ck.newdir()
    save(d, "x", xin)
    opts = ["--format", fmt]
    if block:
        opts += ["--block", block]
    if scale:
        opts += ["--scale", scale]
    rc, text, cmd = ck.run(d, opts)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:400]}", cmd)
        return
    M = int(np.prod(shape[:-1]))
    K = shape[-1]
    X = x32.reshape(M, K)
    codes, scales, deq = ck.out(d, "codes"), ck.out(d, "scales"), ck.out(d, "dequant")
    if deq.shape != tuple(shape) or deq.dtype != f32:
        ck.fail(label, f"dequant: {deq.dtype}{list(deq.shape)}, expected float32{list(shape)}", cmd)
        return
    if fmt == "e4m3" and (block or "1x128") != "32":
        tr, tc = {"1x128": (1, 128), "128x128": (128, 128), "128x1": (128, 1)}[block or "1x128"]
        rc_, rs = deepseek_ref(X, tr, tc, scale == "ue8m0")
        equal_bytes(ck, label, "codes", codes.reshape(M, K), rc_, cmd)
        equal_bytes(ck, label, "scales", scales, rs, cmd)
        equal_bytes(ck, label, "dequant", deq.reshape(M, K), deepseek_deq(rc_, rs, tr, tc), cmd)
        deq_opts = ["--format", fmt] + (["--block", block] if block else [])
        ref_deq = deepseek_deq(rc_, rs, tr, tc)
    elif fmt == "nvfp4":
        rc_, rs, g = nvfp4_ref(X)
        tsc = ck.out(d, "tensor_scale")
        if tsc.shape != (1,) or tsc.dtype != f32 or tsc[0] != g:
            ck.fail(label, f"tensor_scale: got {tsc!r}, expected [{g!r}]", cmd)
        equal_bytes(ck, label, "scales", scales.reshape(M, K // 16), rs, cmd)
        nanblk = np.repeat(rs == 0x7F, 8, 1)
        equal_bytes(ck, label, "codes", codes.reshape(M, K // 2), rc_, cmd, mask=~nanblk)
        ref_deq = nvfp4_deq(rc_, rs, g)
        gd = deq.reshape(M, K).astype(np.float64)
        bad = ~(np.isclose(gd, ref_deq, rtol=2e-7, atol=0) | (np.isnan(gd) & np.isnan(ref_deq)))
        if bad.any():
            ck.fail(label, f"dequant: {bad.sum()} differ, e.g. got {gd[bad][:3]}, expected {ref_deq[bad][:3]}", cmd)
        else:
            ck.ok(label + " dequant")
        deq_opts = ["--format", fmt]
    else:
        elem = MXFMT.get(fmt, fmt)
        rc_, rs = mx_ref(X, elem, scale or "floor")
        equal_bytes(ck, label, "scales", scales.reshape(M, K // 32), rs, cmd)
        nanblk = np.repeat(rs == 0xFF, 32 if elem != "e2m1" else 16, 1)
        equal_bytes(ck, label, "codes", codes.reshape(M, rc_.shape[1]), rc_, cmd, mask=~nanblk)
        ref_deq = mx_deq(rc_, rs, elem)
        equal_bytes(ck, label, "dequant", deq.reshape(M, K), ref_deq, cmd)
        deq_opts = ["--format", fmt] + (["--block", block] if block else [])
    # round trip through k3 dequant
    d2 = ck.newdir()
    for nm in ("codes", "scales", "tensor_scale"):
        p = os.path.join(d, "out", nm + ".npy")
        if os.path.exists(p):
            os.link(p, os.path.join(d2, "in", nm + ".npy"))
    rc, text, cmd2 = ck.run(d2, deq_opts, cmdname="dequant")
    if rc != 0:
        ck.fail(label + " dequant", f"exit {rc}: {text.strip()[:300]}", cmd2)
        return
    xd = ck.out(d2, "x")
    equal_bytes(ck, label + " k3 dequant", "x", xd, deq, cmd2)


def dequant_tables(ck):
    """Every code of every format through k3 dequant with unit scales."""
    for fmt, elem, bits in (("e4m3", "e4m3", 8), ("mxfp8_e5m2", "e5m2", 8), ("mxfp6", "e3m2", 6), ("mxfp6_e2m3", "e2m3", 6)):
        d = ck.newdir()
        n = 1 << bits
        codes = np.arange(n, dtype=np.uint8).reshape(-1, 32 if bits == 6 or fmt != "e4m3" else 128) if fmt != "e4m3" else \
            np.arange(256, dtype=np.uint8).reshape(2, 128)
        save(d, "codes", codes)
        if fmt == "e4m3":
            save(d, "scales", np.ones((2, 1), f32))
            ref = dec(codes, "e4m3")
        else:
            save(d, "scales", np.full((codes.shape[0], 1), 127, np.uint8))
            ref = dec(codes, elem)
        rc, text, cmd = ck.run(d, ["--format", fmt], cmdname="dequant")
        if rc != 0:
            ck.fail(f"table {fmt}", f"exit {rc}: {text[:300]}", cmd)
            continue
        equal_bytes(ck, f"table {fmt}", "x", ck.out(d, "x"), ref, cmd)
    d = ck.newdir()
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    save(d, "codes", codes)
    save(d, "scales", np.full((8, 2), 127, np.uint8))
    rc, text, cmd = ck.run(d, ["--format", "mxfp4"], cmdname="dequant")
    if rc != 0:
        ck.fail("table mxfp4", f"exit {rc}: {text[:300]}", cmd)
    else:
        equal_bytes(ck, "table mxfp4", "x", ck.out(d, "x"), dec(unpack4(codes), "e2m1"), cmd)
    # every E8M0 scale code
    d = ck.newdir()
    save(d, "codes", np.full((256, 32), 0x38, np.uint8))  # e4m3 1.0
    save(d, "scales", np.arange(256, dtype=np.uint8).reshape(256, 1))
    rc, text, cmd = ck.run(d, ["--format", "mxfp8"], cmdname="dequant")
    if rc != 0:
        ck.fail("table e8m0", f"exit {rc}: {text[:300]}", cmd)
    else:
        ref = np.repeat(np.where(np.arange(256) == 255, np.nan, e8m0_val(np.arange(256)))[:, None], 32, 1).astype(f32)
        equal_bytes(ck, "table e8m0", "x", ck.out(d, "x"), ref, cmd)
    # FP6 codes with a high bit set are not FP6 codes: a clear error (they were masked silently)
    for fmt in ("mxfp6", "mxfp6_e2m3"):
        for code in (0xC5, 0x40, 0x80):
            d = ck.newdir()
            cc = np.full((1, 32), 0x05, np.uint8)
            cc[0, 17] = code
            save(d, "codes", cc)
            save(d, "scales", np.full((1, 1), 127, np.uint8))
            ck.expect_error(f"dq bad: fp6 high bits {fmt} {code:#x}", d, ["--format", fmt], must_mention="codes")


def bad_inputs(ck, rng):
    def setup(files):
        d = ck.newdir()
        for k, v in files.items():
            save(d, k, v)
        return d

    x = rng.standard_normal((4, 64)).astype(f32)
    ck.expect_error("bad: missing --format", setup({"x": x}), [], must_mention="format")
    ck.expect_error("bad: --format fp9", setup({"x": x}), ["--format", "fp9"], must_mention="format")
    ck.expect_error("bad: mxfp8 K=40", setup({"x": rng.standard_normal((2, 40)).astype(f32)}), ["--format", "mxfp8"], must_mention=["32", "x"])
    ck.expect_error("bad: nvfp4 K=24", setup({"x": rng.standard_normal((2, 24)).astype(f32)}), ["--format", "nvfp4"], must_mention=["16", "x"])
    ck.expect_error("bad: mxfp4 K=1", setup({"x": rng.standard_normal((3, 1)).astype(f32)}), ["--format", "mxfp4"], must_mention=["32", "x"])
    ck.expect_error("bad: x float16", setup({"x": x.astype(np.float16)}), ["--format", "e4m3"], must_mention="x")  # float64 is rounded to float32 (check_random_sweeps)
    ck.expect_error("bad: x int32", setup({"x": x.astype(np.int32)}), ["--format", "e4m3"], must_mention="x")
    ck.expect_error("bad: x scalar", setup({"x": np.array(1.0, f32)}), ["--format", "e4m3"], must_mention="x")
    ck.expect_error("bad: --block 64", setup({"x": x}), ["--format", "e4m3", "--block", "64"], must_mention="block")
    ck.expect_error("bad: mxfp8 --block 1x128", setup({"x": x}), ["--format", "mxfp8", "--block", "1x128"], must_mention="block")
    ck.expect_error("bad: e4m3 --scale rceil (1x128)", setup({"x": x}), ["--format", "e4m3", "--scale", "rceil"], must_mention="scale")
    ck.expect_error("bad: mxfp8 --scale ue8m0", setup({"x": x}), ["--format", "mxfp8", "--scale", "ue8m0"], must_mention="scale")
    ck.expect_error("bad: nvfp4 --block 32", setup({"x": x}), ["--format", "nvfp4", "--block", "32"], must_mention="block")
    d = setup({"x": x})  # numpy's other layouts hold the same numbers: read, not rejected
    np.save(os.path.join(d, "in", "x.npy"), np.asfortranarray(x))
    same_outputs(ck, "Fortran x", setup({"x": x}), d, ["codes", "scales"], ["--format", "e4m3"])
    d = setup({"x": x})
    np.save(os.path.join(d, "in", "x.npy"), x.astype(">f4"))
    same_outputs(ck, "big-endian x", setup({"x": x}), d, ["codes", "scales"], ["--format", "e4m3"])
    d = setup({"x": x})
    write_raw_npy(os.path.join(d, "in", "x.npy"), "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 64), }", x.tobytes()[:-4])
    ck.expect_error("bad: truncated x", d, ["--format", "e4m3"], must_mention="x")
    # dequant
    c = np.zeros((4, 128), np.uint8)
    ck.expect_error("dq bad: scales shape", setup({"codes": c, "scales": np.ones((4, 2), f32)}), ["--format", "e4m3"], must_mention="'scales'")
    ck.expect_error("dq bad: scales rows", setup({"codes": c, "scales": np.ones((3, 1), f32)}), ["--format", "e4m3"], must_mention="'scales'")
    ck.expect_error("dq bad: scales dtype", setup({"codes": c, "scales": np.ones((4, 1), np.float64)}), ["--format", "e4m3"], must_mention="scales")
    ck.expect_error("dq bad: codes dtype", setup({"codes": c.astype(np.int32), "scales": np.ones((4, 1), f32)}), ["--format", "e4m3"],
                    must_mention="codes")
    ck.expect_error("dq bad: missing scales", setup({"codes": c}), ["--format", "e4m3"], must_mention="scales")
    ck.expect_error("dq bad: mx scales shape", setup({"codes": c, "scales": np.zeros((4, 3), np.uint8)}), ["--format", "mxfp8"], must_mention="'scales'")
    ck.expect_error("dq bad: mx scales as float", setup({"codes": c, "scales": np.zeros((4, 4), f32)}), ["--format", "mxfp8"], must_mention="scales")
    ck.expect_error("dq bad: mx codes K=40", setup({"codes": np.zeros((4, 40), np.uint8), "scales": np.zeros((4, 1), np.uint8)}),
                    ["--format", "mxfp8"], must_mention="32")
    ck.expect_error("dq bad: nvfp4 no tensor_scale", setup({"codes": np.zeros((4, 8), np.uint8), "scales": np.zeros((4, 1), np.uint8)}),
                    ["--format", "nvfp4"], must_mention="tensor_scale")
    for g in (0.0, -1.0, np.nan, np.inf):
        ck.expect_error(f"dq bad: tensor_scale {g}", setup({"codes": np.zeros((4, 8), np.uint8), "scales": np.zeros((4, 1), np.uint8),
                                                            "tensor_scale": np.array([g], f32)}), ["--format", "nvfp4"], must_mention="tensor_scale")
    ck.expect_error("dq bad: scales total size matches but shape differs (1x128)", setup({"codes": np.zeros((2, 256), np.uint8),
                    "scales": np.ones((4, 1), f32)}), ["--format", "e4m3"], must_mention="'scales'")
    # the option list is shared with k3 quant: a bad --scale is an error in k3 dequant too (was ignored)
    ck.expect_error("dq bad: --scale xx (mx)", setup({"codes": c, "scales": np.zeros((4, 4), np.uint8)}), ["--format", "mxfp8", "--scale", "xx"],
                    must_mention="scale")
    ck.expect_error("dq bad: --scale floor (DeepSeek)", setup({"codes": c, "scales": np.ones((4, 1), f32)}), ["--format", "e4m3", "--scale", "floor"],
                    must_mention="scale")
    ck.expect_error("dq bad: nvfp4 scales shape", setup({"codes": np.zeros((4, 16), np.uint8), "scales": np.zeros((4, 1), np.uint8),
                                                         "tensor_scale": np.ones(1, f32)}), ["--format", "nvfp4"], must_mention="'scales'")
    ck.expect_error("dq bad: codes scalar", setup({"codes": np.array(3, np.uint8), "scales": np.ones((1, 1), f32)}), ["--format", "e4m3"],
                    must_mention="codes")


def main():
    ck = Checker("quant")
    for seed in range(ck.args.seeds):
        rng = np.random.default_rng(5000 + seed)
        shapes_ds = [(128,), (2, 1, 3, 130), (1, 128), (3, 129), (130, 200), (2, 3, 1), (1, 1), (5, 31), (129, 257), (0, 128), (4, 0)]
        for i, sh in enumerate(shapes_ds):
            for block in ("1x128", "128x128", "128x1"):
                for scale in ("fp32", "ue8m0"):
                    kind = ["normal", "special", "ties"][(i + seed) % 3]
                    xd = [f32, BF16][(i + len(block)) % 2]
                    lab = f"s{seed} e4m3 {block} {scale} {list(sh)} {kind} {np.dtype(xd).name}"
                    if ck.want(lab):
                        run_case(ck, lab, rng, sh, "e4m3", block, scale, kind, xd)
        shapes_mx = [(64,), (2, 1, 3, 32), (1, 32), (3, 64), (2, 5, 96), (17, 32), (64, 320), (1, 0)]
        for i, sh in enumerate(shapes_mx):
            for fmt in ("mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e2m3", "mxfp4", "e5m2", "e2m1"):
                for rule in ("floor", "rceil"):
                    kind = ["normal", "special", "ties"][(i + seed + len(fmt)) % 3]
                    xd = [f32, BF16][(i + len(fmt)) % 2]
                    lab = f"s{seed} {fmt} {rule} {list(sh)} {kind} {np.dtype(xd).name}"
                    if ck.want(lab):
                        run_case(ck, lab, rng, sh, fmt, "32" if fmt in ("e5m2", "e2m1") else None, rule, kind, xd)
        for i, sh in enumerate([(1, 16), (3, 48), (2, 2, 64), (33, 160)]):
            for kind in ("normal", "special", "ties"):
                xd = [f32, BF16][i % 2]
                lab = f"s{seed} nvfp4 {list(sh)} {kind} {np.dtype(xd).name}"
                if ck.want(lab):
                    run_case(ck, lab, rng, sh, "nvfp4", None, None, kind, xd)
        lab = f"s{seed} nvfp4 zeros"
        if ck.want(lab):
            d = ck.newdir()
            save(d, "x", np.zeros((2, 32), f32))
            rc, text, cmd = ck.run(d, ["--format", "nvfp4"])
            if rc != 0 or not (ck.out(d, "dequant") == 0).all() or ck.out(d, "tensor_scale")[0] != 1:
                ck.fail(lab, f"exit {rc}: {text[:200]}", cmd)
            else:
                ck.ok(lab)
    if ck.want("table"):
        dequant_tables(ck)
    if ck.want("bad"):
        bad_inputs(ck, np.random.default_rng(11))
    ck.finish()


if __name__ == "__main__":
    main()
