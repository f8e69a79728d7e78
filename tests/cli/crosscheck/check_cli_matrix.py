#!/usr/bin/env python3
"""Cross-op checks of the `k3` tool's input handling, independent of any op's maths:
  * every input file of every subcommand (required and optional) replaced by a malformed or
    unexpected .npy: truncated, trailing bytes, Fortran order and big-endian (read: same outputs), object/complex/float16/
    int16/uint32 dtypes, 0-d, wrong rank, a huge declared shape, zero-size shapes with huge other
    extents, empty file, bad magic/version/header, a directory. Each run must end cleanly under
    a 3 GiB address-space limit: exit 0, or exit 1/2 with exactly one line on stderr (no crash,
    no hang, no std::bad_alloc); the malformed ones must fail and name the file or argument;
    format version 2 must give the same outputs as version 1.
  * consistent but absurd shapes (nothing to compute, huge outputs): one clear line.
  * every option listed by `k3 <op> --help` is accepted by the parser, the others are not.
  * --threads 0/1/2/7 give the same results (bitwise for route/kda/quant/dequant, to rounding for dplr/attnres).
  * bfloat16 dumped from PyTorch as '<u2' gives the same outputs as ml_dtypes' '|V2'."""
import os
import resource
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, save, write_raw_npy  # noqa: E402

f32 = np.float32


def base_inputs(rng, op):
    """Valid inputs (name -> array) and options for one small run of `op`, every optional input present."""
    B, T, H, K, V = 1, 5, 2, 3, 4
    r = lambda *s: rng.standard_normal(s).astype(f32)  # noqa: E731
    if op == "kda":
        return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=-rng.random((B, T, H, K)).astype(f32),
                    beta=rng.random((B, T, H)).astype(f32), h0=r(2, H, K, V), cu_seqlens=np.array([0, 2, 5], np.int64),
                    do=r(B, T, H, V), dht=r(2, H, K, V)), ["--backward"]
    if op == "dplr":
        return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), a=r(B, T, H, K), b=r(B, T, H, K),
                    gk=-rng.random((B, T, H, K)).astype(f32), h0=r(2, H, K, V), cu_seqlens=np.array([0, 2, 5], np.int64),
                    do=r(B, T, H, V), dht=r(2, H, K, V)), ["--backward", "--threads", "2"]
    if op == "attnres":
        return dict(sources=r(3, 4, 8), w=r(8), gain=np.ones(8, f32), partial=r(4, 8), dh=r(4, 8)), ["--backward", "--threads", "2"]
    if op == "route":
        return dict(scores=rng.random((8, 16)).astype(f32), bias=np.zeros(16, f32), mask=np.ones(8, np.int32)), ["--k", "4", "--threads", "2"]
    if op == "quant":
        return dict(x=r(4, 64)), ["--format", "nvfp4"]
    if op == "dequant":
        return dict(codes=rng.integers(0, 255, (4, 32)).astype(np.uint8), scales=rng.integers(100, 130, (4, 4)).astype(np.uint8),
                    tensor_scale=np.ones(1, f32)), ["--format", "nvfp4"]
    raise ValueError(op)


def header(descr, shape, fortran="False"):
    return "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape)


def variants(a):
    """(label, must_fail, writer) for one array; writer(path) writes the file."""
    sh, raw, ds = str(tuple(a.shape)), a.tobytes(), a.dtype.str
    raw_ = lambda h, p, v=(1, 0): (lambda path: write_raw_npy(path, h, p, v))  # noqa: E731
    np_ = lambda x, **kw: (lambda path: np.save(path, x, **kw))  # noqa: E731
    big = {1: "(0,)", 2: "(0, 17179869184)", 3: "(0, 4294967296, 4294967296)", 4: "(0, 65536, 65536, 65536)"}.get(a.ndim, "(0,)")
    big2 = {1: "(0,)", 2: "(17179869184, 0)", 3: "(4294967296, 0, 4294967296)", 4: "(65536, 65536, 65536, 0)"}.get(a.ndim, "(0,)")
    v = [("truncated", True, raw_(header(ds, sh), raw[: len(raw) // 2])),
         ("trailing bytes", True, raw_(header(ds, sh), raw + b"\0\0\0\0")),
         ("C bytes under fortran_order True", False, raw_(header(ds, sh, "True"), raw)),  # another valid array
         ("fortran order", False, np_(np.asfortranarray(a))),
         ("object dtype", True, raw_(header("|O", sh), raw)),
         ("float16", True, np_(a.astype(np.float16))),
         ("int16", True, np_(a.astype(np.int16))),
         ("uint32", True, np_(a.astype(np.uint32))),
         ("complex64", True, np_(a.astype(np.complex64))),
         ("huge declared shape", True, raw_(header(ds, "(1099511627776, 1099511627776)"), raw)),
         ("negative extent", True, raw_(header(ds, "(-1, 4)"), raw)),
         ("header without fortran_order", True, raw_("{'descr': '%s', 'shape': %s, }" % (ds, sh), raw)),
         ("version 9", True, raw_(header(ds, sh), raw, (9, 0))),
         ("empty file", True, lambda p: open(p, "wb").close()),
         ("magic only", True, lambda p: open(p, "wb").write(b"\x93NUMPY\x01\x00")),
         ("not npy", True, lambda p: open(p, "wb").write(b"PK\x03\x04 this is a zip, not an npy" * 4)),
         ("directory", True, lambda p: os.makedirs(p)),
         ("version 2", False, raw_(header(ds, sh), raw, (2, 0))),
         ("0-d", False, np_(np.array(a.ravel()[0] if a.size else 0, a.dtype))),
         ("rank+1", False, np_(a[None])),
         ("rank-1", False, np_(a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1))),
         ("empty", False, np_(np.zeros((0,) * max(a.ndim, 1), a.dtype))),
         ("zero with huge extents", False, raw_(header(ds, big), b"")),
         ("huge extents with zero", False, raw_(header(ds, big2), b"")),
         ("float64", False, np_(a.astype(np.float64))),
         ("bool", False, np_(a.astype(bool))),
         ("nan", False, np_(np.full(a.shape, np.nan, a.dtype) if a.dtype.kind == "f" else a))]
    if ds.startswith("<"):
        v.append(("big-endian", False, np_(a.astype(a.dtype.newbyteorder(">")))))
        v.append(("little-endian bytes under a big-endian descr", False, raw_(header(">" + ds[1:], sh), raw)))
    return v


def limit_memory():
    # K3_CC_NO_MEMORY_LIMIT=1 for sanitizer builds (ASan reserves terabytes of address space)
    if not os.environ.get("K3_CC_NO_MEMORY_LIMIT"):
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def run_limited(ck, d, op, opts, timeout=30):
    cmd = [ck.k3, op, "--in", os.path.join(d, "in"), "--out", os.path.join(d, "out")] + list(opts)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return None, "", cmd
    return r.returncode, r.stderr, cmd


def clean_outcome(ck, label, rc, err, cmd, must_fail, names):
    lines = [x for x in err.strip().splitlines() if x.strip()]
    if rc is None:
        return ck.fail(label, "hang (timeout)", cmd)
    if rc < 0 or rc > 2:
        return ck.fail(label, f"crash: exit {rc}: {err.strip()[:300]}", cmd)
    if rc == 0:
        if must_fail:
            return ck.fail(label, "expected an error, got exit 0", cmd)
        return ck.ok(label)
    if len(lines) != 1:
        return ck.fail(label, f"expected one error line, got {len(lines)}: {err.strip()[:300]}", cmd)
    if "bad_alloc" in err or "std::" in err or "basic_string" in err or "vector::" in err:
        return ck.fail(label, f"error is not a clear message: {lines[0]}", cmd)
    if must_fail and not any(n in lines[0] for n in names):
        return ck.fail(label, f"error names neither the file nor the argument ({names}): {lines[0]}", cmd)
    ck.ok(label)


def malformed_matrix(ck, rng):
    for op in ("kda", "dplr", "attnres", "route", "quant", "dequant"):
        arrs, opts = base_inputs(rng, op)
        # the valid base run, and its outputs for the version-2 comparison
        d = ck.newdir()
        for nm, x in arrs.items():
            save(d, nm, x)
        rc, err, cmd = run_limited(ck, d, op, opts)
        if rc != 0:
            ck.fail(f"matrix {op} base", f"exit {rc}: {err[:300]}", cmd)
            continue
        ref = {f: np.load(os.path.join(d, "out", f)) for f in os.listdir(os.path.join(d, "out"))}
        for nm in arrs:
            for vname, must_fail, write in variants(arrs[nm]):
                label = f"matrix {op} {nm}.npy {vname}"
                if not ck.want(label):
                    continue
                d = ck.newdir()
                for other, x in arrs.items():
                    if other != nm:
                        save(d, other, x)
                write(os.path.join(d, "in", nm + ".npy"))
                # nothing to compute in a zero-size input: a quick exit (quant walked 2^34 empty rows for 15 s)
                rc, err, cmd = run_limited(ck, d, op, opts, timeout=10 if "zero" in vname else 30)
                clean_outcome(ck, label, rc, err, cmd, must_fail, [nm])
                if vname in ("version 2", "fortran order", "big-endian") and rc == 0:
                    for f, a in ref.items():
                        b = np.load(os.path.join(d, "out", f))
                        if not (a.shape == b.shape and np.array_equal(a, b, equal_nan=True)):
                            ck.fail(label, f"{f} differs from the C-order little-endian version-1 run", cmd)


def absurd_shapes(ck):
    """Consistent inputs whose outputs would need terabytes: one clear line, never a crash."""
    cases = {
        "kda K=V=65536 T=0": ("kda", dict(q=np.zeros((1, 0, 1, 65536), f32), k=np.zeros((1, 0, 1, 65536), f32),
                                          v=np.zeros((1, 0, 1, 65536), f32), g=np.zeros((1, 0, 1, 65536), f32),
                                          beta=np.zeros((1, 0, 1), f32)), []),
        "dplr K=V=65536 T=0": ("dplr", {**{n: np.zeros((1, 0, 1, 65536), f32) for n in ("q", "k", "a", "b", "gk")},
                                        "v": np.zeros((1, 0, 1, 65536), f32)}, []),
    }
    for label, (op, arrs, opts) in cases.items():
        if not ck.want("absurd " + label):
            continue
        d = ck.newdir()
        for nm, x in arrs.items():
            save(d, nm, x)
        rc, err, cmd = run_limited(ck, d, op, opts)
        clean_outcome(ck, "absurd " + label, rc, err, cmd, False, [])
    # zero-size inputs whose extents multiply past 2^63 in an output (state K x V = 2^64, or
    # 2^64 - 1, or one that wraps to a small positive number): refused, never a wrapped allocation
    for K, V in ((2 ** 32, 2 ** 32), (2 ** 32 + 1, 2 ** 32 - 1), (2 ** 33 + 1, 2 ** 31 + 3)):
        for op in ("kda", "dplr"):
            lab = f"absurd {op} overflowing state K={K} V={V}"
            if not ck.want(lab):
                continue
            d = ck.newdir()
            names = ("q", "k", "g") if op == "kda" else ("q", "k", "a", "b", "gk")
            for nm in names:
                write_raw_npy(os.path.join(d, "in", nm + ".npy"), header("<f4", (1, 0, 1, K)), b"")
            write_raw_npy(os.path.join(d, "in", "v.npy"), header("<f4", (1, 0, 1, V)), b"")
            if op == "kda":
                write_raw_npy(os.path.join(d, "in", "beta.npy"), header("<f4", (1, 0, 1)), b"")
            rc, err, cmd = run_limited(ck, d, op, [])
            clean_outcome(ck, lab, rc, err, cmd, True, ["ht", "state", "memory"])
    if ck.want("absurd attnres"):
        d = ck.newdir()
        write_raw_npy(os.path.join(d, "in", "sources.npy"), header("<f4", (0, 2 ** 32 + 1, 2 ** 32 - 1)), b"")
        save(d, "w", np.ones(4, f32))
        save(d, "gain", np.ones(4, f32))
        rc, err, cmd = run_limited(ck, d, "attnres", [])
        clean_outcome(ck, "absurd attnres sources [0, 2^32+1, 2^32-1]", rc, err, cmd, True, ["sources", "'h'"])
    if ck.want("absurd dequant"):
        d = ck.newdir()
        write_raw_npy(os.path.join(d, "in", "codes.npy"), header("|u1", (0, 2 ** 62)), b"")
        write_raw_npy(os.path.join(d, "in", "scales.npy"), header("|u1", (0, 2 ** 58)), b"")
        save(d, "tensor_scale", np.ones(1, f32))
        rc, err, cmd = run_limited(ck, d, "dequant", ["--format", "nvfp4"])
        clean_outcome(ck, "absurd dequant nvfp4 codes [0, 2^62]", rc, err, cmd, False, [])
    # a header declaring a zero-size array with 2^34 experts
    if ck.want("absurd route n=2^34"):
        d = ck.newdir()
        write_raw_npy(os.path.join(d, "in", "scores.npy"), header("<f4", "(0, 17179869184)"), b"")
        rc, err, cmd = run_limited(ck, d, "route", ["--k", "2"])
        clean_outcome(ck, "absurd route n=2^34", rc, err, cmd, False, [])


def help_lists_options(ck):
    """Every option in `k3 <op> --help` is known to the parser; an unlisted one is refused."""
    h = subprocess.run([ck.k3, "--help"], capture_output=True, text=True).stdout
    ops = [ln.split()[0] for ln in h.split("ops:", 1)[1].splitlines() if ln.strip()]
    for op in ops:
        text = subprocess.run([ck.k3, op, "--help"], capture_output=True, text=True)
        if text.returncode != 0:
            ck.fail(f"help {op}", f"exit {text.returncode}")
            continue
        opts = [ln.split()[0][2:] for ln in text.stdout.split("options:", 1)[1].splitlines() if ln.strip().startswith("--")]
        for o in opts:
            if o == "help":
                continue
            takes = "VALUE" in next(ln for ln in text.stdout.splitlines() if ln.strip().startswith("--" + o + " ") or ln.strip() == "--" + o)
            args = [op, "--" + o] + (["x"] if takes else [])
            r = subprocess.run([ck.k3] + args, capture_output=True, text=True, timeout=30)
            if "unknown option" in r.stderr or "takes no value" in r.stderr or "needs a value" in r.stderr:
                ck.fail(f"help {op} --{o}", f"listed in --help but refused: {r.stderr.strip()}")
            else:
                ck.ok(f"help {op} --{o}")


def threads_invariance(ck, rng):
    """--threads must not change results beyond rounding (route, kda, quant, dequant: not at all)."""
    runs = {
        "route": (dict(scores=rng.random((700, 40)).astype(f32), bias=(rng.standard_normal(40) * 0.05).astype(f32),
                       mask=(rng.random(700) < 0.8)), ["--k", "6"], 0.0),
        "route exact": (dict(scores=rng.random((300, 24)).astype(f32), mask=(rng.random(300) < 0.8)), ["--k", "5", "--update", "exact"], 0.0),
        "dplr": (dict(q=rng.standard_normal((2, 150, 3, 9)), k=rng.standard_normal((2, 150, 3, 9)) / 3, v=rng.standard_normal((2, 150, 3, 5)),
                      a=rng.standard_normal((2, 150, 3, 9)) / 3, b=rng.standard_normal((2, 150, 3, 9)) / 3,
                      gk=-rng.random((2, 150, 3, 9)), do=rng.standard_normal((2, 150, 3, 5))), ["--backward", "--chunk-size", "16"], 1e-12),
        "dplr segment-maps": (dict(q=rng.standard_normal((1, 300, 1, 9)), k=rng.standard_normal((1, 300, 1, 9)) / 3,
                                   v=rng.standard_normal((1, 300, 1, 5)), a=rng.standard_normal((1, 300, 1, 9)) / 3,
                                   b=rng.standard_normal((1, 300, 1, 9)) / 3, gk=-rng.random((1, 300, 1, 9)),
                                   cu_seqlens=np.array([0, 0, 1, 290, 300])),
                              ["--long-sequence", "segment-maps", "--chunk-size", "16"], 1e-12),
        "attnres": (dict(sources=rng.standard_normal((5, 97, 33)), w=rng.standard_normal(33), gain=rng.random(33) + 0.5,
                         partial=rng.standard_normal((97, 33)), dh=rng.standard_normal((97, 33))), ["--backward"], 1e-12),
        "kda": (dict(q=rng.standard_normal((2, 70, 2, 9)), k=rng.standard_normal((2, 70, 2, 9)) / 3, v=rng.standard_normal((2, 70, 4, 5)),
                     g=-rng.random((2, 70, 4, 9)), beta=rng.random((2, 70, 4)), do=rng.standard_normal((2, 70, 4, 5))),
                ["--backward"], 0.0),
        "quant 1x128": (dict(x=rng.standard_normal((300, 300)).astype(f32)), ["--format", "e4m3"], 0.0),
        "quant nvfp4": (dict(x=rng.standard_normal((3, 100, 64)).astype(f32)), ["--format", "nvfp4"], 0.0),
        "dequant mxfp8": (dict(codes=rng.integers(0, 256, (300, 256)).astype(np.uint8),
                               scales=rng.integers(100, 150, (300, 8)).astype(np.uint8)), ["--format", "mxfp8"], 0.0),
    }
    for label, (arrs, opts, tol) in runs.items():
        lab = f"threads {label}"
        if not ck.want(lab):
            continue
        op = label.split()[0]
        d = ck.newdir()
        for nm, x in arrs.items():
            save(d, nm, x)
        outs = {}
        for th in (1, 0, 2, 7):
            rc, err, cmd = run_limited(ck, d, op, opts + ["--threads", str(th)])
            if rc != 0:
                ck.fail(lab, f"--threads {th}: exit {rc}: {err[:300]}", cmd)
                break
            outs[th] = {f: np.load(os.path.join(d, "out", f)) for f in os.listdir(os.path.join(d, "out"))}
            shutil.rmtree(os.path.join(d, "out"))
        else:
            for th in (0, 2, 7):
                for f, a in outs[1].items():
                    b = outs[th][f]
                    a64, b64 = a.astype(np.float64), b.astype(np.float64)
                    if tol == 0.0:  # bit for bit (NaN codes included)
                        e = 0.0 if a.dtype == b.dtype and a.tobytes() == b.tobytes() else float("inf")
                    else:
                        e = np.abs(a64 - b64).max() / max(np.abs(a64).max(), 1e-300) if a.size else 0.0
                    if a.shape != b.shape or not e <= tol:
                        ck.fail(lab, f"{f}: --threads {th} differs from --threads 1 by {e:.3e} (tolerance {tol:.0e})", cmd)
                    else:
                        ck.ok(f"{lab} {f} th{th}")


def bf16_spellings(ck, rng):
    """A bfloat16 input dumped from PyTorch (.view(torch.uint16) -> '<u2') must give the same
    outputs as the ml_dtypes spelling ('|V2'), for every op that takes bfloat16."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    cases = {
        "attnres": (dict(sources=rng.standard_normal((3, 5, 16)).astype(bf), w=rng.standard_normal(16).astype(bf),
                         gain=(rng.random(16) + 0.5).astype(bf), partial=rng.standard_normal((5, 16)).astype(bf),
                         dh=rng.standard_normal((5, 16)).astype(bf)), ["--backward"]),
        "route": (dict(scores=rng.random((40, 12)).astype(bf), bias=(rng.standard_normal(12) * 0.05).astype(bf)), ["--k", "3"]),
        "route logits": (dict(logits=rng.standard_normal((40, 12)).astype(bf)), ["--k", "3", "--update", "exact"]),
        "quant": (dict(x=rng.standard_normal((3, 64)).astype(bf)), ["--format", "mxfp8"]),
    }
    for label, (arrs, opts) in cases.items():
        lab = f"bf16 as <u2 {label}"
        if not ck.want(lab):
            continue
        op = label.split()[0]
        outs = []
        for spelling in ("V2", "u2"):
            d = ck.newdir()
            for nm, x in arrs.items():
                save(d, nm, x if spelling == "V2" else x.view(np.uint16))
            rc, err, cmd = run_limited(ck, d, op, opts)
            if rc != 0:
                ck.fail(lab, f"{spelling}: exit {rc}: {err[:300]}", cmd)
                break
            outs.append({f: np.load(os.path.join(d, "out", f)) for f in os.listdir(os.path.join(d, "out"))})
        else:
            for f, a in outs[0].items():
                b = outs[1].get(f)
                if b is None or a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                    ck.fail(lab, f"{f}: '<u2' input gives other outputs than '|V2'", cmd)
                else:
                    ck.ok(f"{lab} {f}")


def main():
    ck = Checker("cli_matrix")
    rng = np.random.default_rng(6000)
    if ck.want("help"):
        help_lists_options(ck)
    threads_invariance(ck, rng)
    bf16_spellings(ck, rng)
    absurd_shapes(ck)
    malformed_matrix(ck, rng)
    ck.finish()


if __name__ == "__main__":
    main()
