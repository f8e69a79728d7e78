#!/usr/bin/env python3
"""Cross-checks k3's .npy reader and writer against numpy.

usage: npy_crosscheck.py WRITER_EXE WORK_DIR

1. WRITER_EXE write WORK_DIR/k3: numpy loads every file k3 wrote and compares dtype, shape
   and values (bit for bit) with the closed formulas below.
2. numpy writes the same cases (format versions 1, 2 and 3; bfloat16 both as ml_dtypes'
   |V2 and as <u2 bits, as torch users write it) plus a Fortran-order, a big-endian and a
   complex file into WORK_DIR/np; WRITER_EXE check WORK_DIR/np verifies them in C++.
Exits 77 (ctest: skipped) when numpy is missing.
"""
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("numpy not found: skipping the cross-check")
    sys.exit(77)
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

CASES = [  # name, kind, shape: must match npy_crosscheck_writer.cpp
    ("f32_2d", "f32", (3, 5)),
    ("f64_1d", "f64", (7,)),
    ("f64_scalar", "f64", ()),
    ("bf16_3d", "bf16", (2, 3, 4)),
    ("i32_2d", "i32", (4, 1)),
    ("i64_1d", "i64", (3,)),
    ("i64_empty", "i64", (0, 3)),
    ("u8_1d", "u8", (10,)),
    ("u16_1d", "u16", (6,)),
]


def real(n):
    return np.arange(n, dtype=np.float64) * 0.37 - 3.1


def bf16_bits(n):
    """Round-to-nearest-even float32 -> bfloat16, computed on the bits (independent of k3)."""
    u = real(n).astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7F800000) == 0x7F800000
    nan &= (u & 0x007FFFFF) != 0
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def expected(kind, shape):
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.int64)
    if kind == "f32":
        v = real(n).astype(np.float32)
    elif kind == "f64":
        v = real(n)
    elif kind == "bf16":
        v = bf16_bits(n)
    elif kind == "i32":
        v = (i * 7919 - 1000).astype(np.int32)
    elif kind == "i64":
        v = i * (1 << 33) - 5
    elif kind == "u8":
        v = ((i * 37) % 256).astype(np.uint8)
    else:
        v = ((i * 1009) % 65536).astype(np.uint16)
    return v.reshape(shape)


def main():
    writer, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    k3_dir, np_dir = os.path.join(work, "k3"), os.path.join(work, "np")
    os.makedirs(k3_dir)
    os.makedirs(np_dir)
    failures = []

    # 1. k3 writes, numpy reads.
    subprocess.run([writer, "write", k3_dir], check=True)
    for name, kind, shape in CASES:
        a = np.load(os.path.join(k3_dir, name + ".npy"), allow_pickle=False)
        want = expected(kind, shape)
        if a.dtype != want.dtype or a.shape != want.shape or a.tobytes() != want.tobytes():
            failures.append(f"k3 wrote {name}: got {a.dtype} {a.shape}, expected {want.dtype} {want.shape}")
        if kind == "bf16" and ml_dtypes is not None:  # the <u2 bits are real bfloat16 values
            as_bf16 = a.view(ml_dtypes.bfloat16).astype(np.float32)
            if not np.array_equal(as_bf16, real(want.size).astype(np.float32).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32).reshape(shape)):
                failures.append(f"k3 wrote {name}: bfloat16 values differ from ml_dtypes' rounding")
    col = np.load(os.path.join(k3_dir, "f64_column.npy"))
    if not np.array_equal(col, real(12).reshape(4, 3)[:, 1]):
        failures.append("k3 wrote f64_column: strided view not gathered in C order")

    # 2. numpy writes, k3 reads.
    for name, kind, shape in CASES:
        a = expected(kind, shape)
        if kind == "bf16":
            np.save(os.path.join(np_dir, name + "_u2.npy"), a)  # torch: t.view(torch.uint16).numpy()
            if ml_dtypes is None:
                print("ml_dtypes not found: writing bfloat16 only as <u2")
                a_bf16 = None
            else:
                a_bf16 = a.view(ml_dtypes.bfloat16)
            a = a_bf16
        for version in (1, 2, 3):
            if a is None:
                a_out = expected(kind, shape)  # ml_dtypes missing: <u2 in every version
            else:
                a_out = a
            with open(os.path.join(np_dir, f"{name}_v{version}.npy"), "wb") as f:
                np.lib.format.write_array(f, a_out, version=(version, 0), allow_pickle=False)
    for name, kind, shape in CASES:  # bfloat16 as <u2 bits here: ml_dtypes has no big-endian form
        a = expected(kind, shape)
        f = (lambda x: np.asfortranarray(x) if x.ndim else x)  # asfortranarray makes a 0-d array 1-d
        np.save(os.path.join(np_dir, name + "_fortran.npy"), f(a))
        np.save(os.path.join(np_dir, name + "_big.npy"), f(a.astype(a.dtype.newbyteorder(">"))))
        np.save(os.path.join(np_dir, name + "_big_c.npy"), a.astype(a.dtype.newbyteorder(">")))
    np.save(os.path.join(np_dir, "complex.npy"), np.ones(3, dtype=np.complex64))
    if ml_dtypes is None:
        # Without ml_dtypes the bf16 _vN files hold <u2: the checker would expect bfloat16.
        for version in (1, 2, 3):
            os.replace(os.path.join(np_dir, f"bf16_3d_v{version}.npy"), os.path.join(np_dir, "bf16_3d_u2.npy"))
        failures.append("ml_dtypes missing: cannot check the |V2 spelling")
    r = subprocess.run([writer, "check", np_dir])
    if r.returncode != 0:
        failures.append("k3 failed to read numpy's files (see above)")

    for f in failures:
        print("FAIL:", f)
    if not failures:
        print(f"numpy {np.__version__} and k3 agree on every case")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
