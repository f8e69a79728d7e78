#!/usr/bin/env python3
"""Mutation evidence for the CUDA kernels on the SIMT host runtime.

Each mutation breaks one kernel file on purpose (a barrier removed, an index shifted, an
atomic made a plain read-modify-write) in a throwaway copy of include/, rebuilds the
emulated test of that kernel against the copy, and runs it. A mutation is caught when the
test fails (or deadlocks, or is reported as a race by ThreadSanitizer). Prints one table row
per mutation; exits 1 if any mutation survives.

  tests/backend/simt/mutations.py --build BUILD [--tsan-build TSAN_BUILD]

BUILD is a configured and built tree (the *_emulated targets); TSAN_BUILD, if given, one
configured with -DK3_SANITIZE=thread, used for the mutations marked tsan (races that a
sequential fiber schedule cannot show by value).
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (kernel file under include/k3, line, text on that line, replacement, emulated test, needs tsan, what)
MUTATIONS = [
    ("kda/cuda/chunk_fwd.cuh", 92, "__syncthreads();", "", "test_kda_cuda_emulated", False, "barrier after the cumsums removed"),
    ("kda/cuda/chunk_fwd.cuh", 128, "__syncthreads();", "", "test_kda_cuda_emulated", False, "barrier after the substitution removed"),
    ("kda/cuda/chunk_fwd.cuh", 135, "j <= r", "j < r", "test_kda_cuda_emulated", False, "diagonal of Aqk dropped from o"),
    ("kda/cuda/chunk_fwd.cuh", 142, "(L - 1) * K", "(L - 2 > 0 ? L - 2 : 0) * K", "test_kda_cuda_emulated", False, "state decayed to the wrong token"),
    ("kda/cuda/chunk_bwd.cuh", 49, "__syncwarp();", "", "test_kda_cuda_emulated", True, "warp barrier after the token load removed"),
    ("kda/cuda/chunk_bwd.cuh", 112, "dP * P", "dP * se[d]", "test_kda_cuda_emulated", False, "dg from the wrong factor"),
    ("kda/cuda/common.cuh", 52, "o > 0", "o > 1", "test_kda_cuda_emulated", False, "warp sum skips the last butterfly step"),
    ("kda/cuda/decode.cuh", 23, "__syncthreads();", "", "test_kda_cuda_emulated", False, "barrier after staging k, q, e^g removed"),
    ("kda/cuda/decode.cuh", 16, "slot < 0 ||", "", "test_kda_cuda_emulated", False, "padding slot not skipped"),
    ("kda/cuda/preprocess.cuh", 31, "o > 0", "o > 1", "test_kda_preprocess_cuda_emulated", False, "rescaled L2 norm's max skips a step"),
    ("kda/cuda/preprocess.cuh", 123, "atomicAdd(&dA_log[h], da)", "dA_log[h] += da", "test_kda_preprocess_cuda_emulated", True, "dA_log atomic dropped"),
    ("kda/cuda/preprocess.cuh", 215, "atomicAdd(&dbias[c], d)", "dbias[c] += d", "test_kda_preprocess_cuda_emulated", True, "conv bias-gradient atomic dropped"),
    ("attnres/cuda.cuh", 44, "__syncthreads();", "", "test_attnres_cuda_emulated", False, "block_sum reads partial sums before every warp wrote"),
    ("attnres/cuda.cuh", 40, "__syncthreads();", "", "test_attnres_cuda_emulated", True, "block_sum overwrites scratch still being read"),
    ("attnres/cuda.cuh", 142, "atomicAdd(du + k, dus)", "du[k] += dus", "test_attnres_cuda_emulated", True, "du atomic dropped"),
    ("moe/cuda.cuh", 67, "__syncthreads();", "", "test_route_cuda_emulated", False, "top-k merge before every warp's candidate"),
    ("moe/cuda.cuh", 24, "j < i", "j > i", "test_route_cuda_emulated", False, "ties go to the higher expert index"),
    ("moe/cuda.cuh", 95, "atomicAdd(a.hist + static_cast<std::int64_t>(j) * a.bins + static_cast<int>(f), 1ull)",
     "a.hist[static_cast<std::int64_t>(j) * a.bins + static_cast<int>(f)] += 1ull", "test_route_cuda_emulated", True, "histogram atomic dropped"),
    ("quant/cuda.cuh", 46, "__syncthreads();", "", "test_quant_cuda_emulated", False, "scale read before every warp's amax"),
    ("quant/cuda.cuh", 21, "off > 0", "off > 1", "test_quant_cuda_emulated", False, "warp max skips its last step"),
    ("quant/cuda.cuh", 45, "atomicMax(&amax_s, a)", "(amax_s = a > amax_s ? a : amax_s)", "test_quant_cuda_emulated", True, "shared amax atomic dropped"),
    ("quant/cuda.cuh", 166, "__syncthreads();", "", "test_quant_cuda_emulated", True, "GEMM panel overwritten while read"),
    # (line 0: the one line of the file that holds the text)
    ("kda/cuda/preprocess.cuh", 0, "float const c = gx * rstd * rstd;", "float const c = gx * rstd;", "test_kda_preprocess_cuda_emulated", False, "l2norm backward: wrong projection"),
    ("kda/cuda/preprocess.cuh", 0, "y[i] = st<S>(s * dsigmoid(ld(x[i])));", "y[i] = st<S>((s > 1.f ? 1.f : s) * dsigmoid(ld(x[i])));", "test_kda_preprocess_cuda_emulated", False, "beta forward ignores the negative-eigenvalue scale"),
    ("kda/cuda/preprocess.cuh", 0, "dsigmoid(v) * dsigmoid(-v)", "dsigmoid(v) * dsigmoid(v)", "test_kda_preprocess_cuda_emulated", False, "beta backward: wrong derivative"),
    ("kda/cuda/preprocess.cuh", 0, "p.lower_bound * dsigmoid(a * u)", "p.lower_bound * dsigmoid(u)", "test_kda_preprocess_cuda_emulated", False, "lower-bounded gate ignores A"),
    ("kda/cuda/preprocess.cuh", 0, "y[i] = st<S>(p.silu ? z * dsigmoid(z) : z);", "y[i] = st<S>(z);", "test_kda_preprocess_cuda_emulated", False, "conv forward drops SiLU"),
    ("kda/cuda/preprocess.cuh", 0, "fin[i] = conv_in(p, x, init, q, q.len - (p.W - 1) + s, c);", "fin[i] = conv_in(p, x, init, q, q.len - p.W + s, c);", "test_kda_preprocess_cuda_emulated", False, "conv final state shifted by one token"),
    ("kda/cuda/preprocess.cuh", 0, "for (index_t j = 0; j <= s; ++j)", "for (index_t j = 0; j < s; ++j)", "test_kda_preprocess_cuda_emulated", False, "conv initial-state gradient drops a tap"),
    ("kda/cuda/preprocess.cuh", 0, "if (p.W > 1) sp[p.W - 2] = xv;", "if (p.W > 1) sp[0] = xv;", "test_kda_preprocess_cuda_emulated", False, "conv decode shifts its state wrongly"),
    ("attnres/cuda.cuh", 0, "for (index_t j = 0; j < m; ++j) acc += a[j] * ld(row(bank, n, partial, T, d, j, t)[k]);",
     "for (index_t j = 0; j + 1 < m; ++j) acc += a[j] * ld(row(bank, n, partial, T, d, j, t)[k]);", "test_attnres_cuda_emulated", False, "mix forward drops the partial source"),
    ("attnres/cuda.cuh", 0, "dg[k] = du[k] * w[k];", "dg[k] = du[k] * g[k] + 0.f * w[k];", "test_attnres_cuda_emulated", False, "fold_grads: gain gradient from the wrong factor"),
    ("attnres/cuda.cuh", 0, "if (k < d) u[k] = w[k] * g[k];", "if (k + 1 < d) u[k] = w[k] * g[k];", "test_attnres_cuda_emulated", False, "fold_query leaves the last channel"),
    ("attnres/cuda.cuh", 0, "rinv[t] = rsqrtf(acc[0] / float(d) + eps);", "rinv[t] = rsqrtf(acc[0] + eps);", "test_attnres_cuda_emulated", False, "block_rinv forgets the mean"),
    ("attnres/cuda.cuh", 0, "for (index_t j = 0; j < n; ++j) s += a[j] * ld(bank[(j * T + t) * d + k]);",
     "for (index_t j = 1; j < n; ++j) s += a[j] * ld(bank[(j * T + t) * d + k]);", "test_attnres_cuda_emulated", False, "phase 1 drops the first source"),
    ("attnres/cuda.cuh", 0, "float const p = 1.f / (1.f + expf(lse[t] - s2));", "float const p = 1.f / (1.f + expf(s2 - lse[t]));", "test_attnres_cuda_emulated", False, "phase 2 merges with the wrong sign"),
    ("quant/cuda.cuh", 0, "y(i, j) = decode<e4m3_format>(q(i, j)) * s(i / t.rows, j / t.cols);", "y(i, j) = decode<e4m3_format>(q(i, j)) * s(i / t.rows, 0);",
     "test_quant_cuda_emulated", False, "fp8 dequantize: the first column tile's scale everywhere"),
    ("quant/cuda.cuh", 0, "mx_block_scale<F>(warp_max(detail::abs_bits(v)), rule)", "mx_block_scale<F>(detail::abs_bits(v), rule)",
     "test_quant_cuda_emulated", False, "MX scale from each lane's own element"),
    ("quant/cuda.cuh", 0, "decode<F>(c) * decode<e8m0_format>(s(i, j / mx_block))", "decode<F>(c) * decode<e8m0_format>(s(i, 0))",
     "test_quant_cuda_emulated", False, "MX dequantize: the first block's scale everywhere"),
    ("quant/cuda.cuh", 0, "warp_max(detail::abs_bits(v), 16)", "warp_max(detail::abs_bits(v), 8)", "test_quant_cuda_emulated", False,
     "NVFP4 amax over half its block"),
    ("quant/cuda.cuh", 0, "(decode<ue4m3_format>(s(i, j / nvfp4_block)) * g)", "(decode<ue4m3_format>(s(i, j / nvfp4_block)) * (g > 0.f ? 1.f : g))",
     "test_quant_cuda_emulated", False, "NVFP4 dequantize drops the tensor scale"),
    ("quant/cuda.cuh", 0, "if (v < detail::nonfinite_bits && v > a) a = v;", "if (v > a) a = v;", "test_quant_cuda_emulated", False,
     "NVFP4 tensor amax counts non-finite values"),
    ("backend/cuda/backend.cuh", 73, "i < n;", "i + 1 < n;", "test_stream_backend_emulated", False, "for_each drops the last index"),
]


def commands_for(build, target):
    """The compile and link commands ninja runs for `target` (wrapper object and executable)."""
    out = subprocess.run(["ninja", "-C", build, "-t", "commands", target], check=True, capture_output=True, text=True).stdout
    lines = [l for l in out.splitlines() if l.strip()]
    compile_cmd = next(l for l in reversed(lines) if f"{target}.cpp.o" in l and " -c " in l)
    link_cmd = lines[-1]
    # ": && c++ ... -o exe && cd ... && cmake (test discovery)": keep the link itself
    link_cmd = next(part for part in link_cmd.split(" && ") if " -o " in part)
    return compile_cmd, link_cmd


def run_mutant(build, target, include_dir, timeout):
    compile_cmd, link_cmd = commands_for(build, target)
    tmp = tempfile.mkdtemp(prefix="k3-mutant-")
    obj = os.path.join(tmp, "mutant.o")
    exe = os.path.join(tmp, "mutant")
    inc = os.path.join(ROOT, "include")
    cc = shlex.split(compile_cmd)
    cc = [a for a in cc if a != "ccache"]
    cc = [("-I" + include_dir) if a == "-I" + inc else a for a in cc]
    if "-o" in cc:
        cc[cc.index("-o") + 1] = obj
    cc = [a for i, a in enumerate(cc) if not (a in ("-MD",) or (i > 0 and cc[i - 1] in ("-MT", "-MF")) or a in ("-MT", "-MF"))]
    r = subprocess.run(cc, cwd=build, capture_output=True, text=True)
    if r.returncode != 0:
        return "does not compile", r.stderr[-2000:]
    lk = shlex.split(link_cmd)
    lk = [a for a in lk if a != "ccache"]
    objs = [a for a in lk if a.endswith(f"{target}.cpp.o")]
    lk = [obj if a in objs else a for a in lk]
    lk[lk.index("-o") + 1] = exe
    r = subprocess.run(lk, cwd=build, capture_output=True, text=True)
    if r.returncode != 0:
        return "does not link", r.stderr[-2000:]
    try:
        r = subprocess.run([exe], cwd=build, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66"))
    except subprocess.TimeoutExpired:
        return "caught (timeout)", ""
    shutil.rmtree(tmp, ignore_errors=True)
    text = r.stdout + r.stderr
    if r.returncode == 0:
        return "SURVIVED", text[-1500:]
    if "ThreadSanitizer" in text:
        return "caught (race)", text
    if "deadlock" in text:
        return "caught (deadlock)", text
    m = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", text)
    if m and m.group(3) == "0":
        return "UNCLEAR (exit %d, no failing case)" % r.returncode, text
    return ("caught (%s of %s cases fail)" % (m.group(3), m.group(1))) if m else "caught (exit %d)" % r.returncode, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--tsan-build")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--only", help="run only the mutations whose description contains this text")
    args = ap.parse_args()
    survived = 0
    print("| kernel file | line | mutation | test | result |")
    print("| --- | --- | --- | --- | --- |")
    for rel, line, old, new, target, tsan, what in MUTATIONS:
        if args.only and args.only not in what:
            continue
        build = args.tsan_build if tsan and args.tsan_build else args.build
        work = tempfile.mkdtemp(prefix="k3-mutant-include-")
        inc = os.path.join(work, "include")
        shutil.copytree(os.path.join(ROOT, "include"), inc)
        path = os.path.join(inc, "k3", rel)
        lines = open(path).read().split("\n")
        if line == 0:
            hits = [i + 1 for i, l in enumerate(lines) if old in l]
            line = hits[0] if len(hits) == 1 else -1
        if line < 1 or old not in lines[line - 1]:
            print(f"| {rel} | {line} | {what} | {target} | mutation does not apply (text not on one line) |")
            survived += 1
            continue
        lines[line - 1] = lines[line - 1].replace(old, new, 1)
        open(path, "w").write("\n".join(lines))
        result, text = run_mutant(build, target, inc, args.timeout)
        shutil.rmtree(work, ignore_errors=True)
        mode = " (tsan)" if build == args.tsan_build and tsan else ""
        print(f"| {rel} | {line} | {what} | {target}{mode} | {result} |", flush=True)
        if result in ("SURVIVED", "does not compile", "does not link") or result.startswith("UNCLEAR"):
            survived += 1
            sys.stderr.write(text + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
