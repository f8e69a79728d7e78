#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_npy into the directory given as argv[1]: valid files of
every supported dtype in .npy format versions 1.0, 2.0 and 3.0 (written by numpy), and a few
hand-made malformed ones. Without numpy it writes only the hand-made seeds."""
import os
import struct
import sys


def raw(version, header, payload=b""):
    h = header.encode("latin1")
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + payload
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(h)) + h + payload


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    seeds = {
        "bad_magic": b"\x93NUMPX\x01\x00\x10\x00" + b" " * 16,
        "short": b"\x93NUMPY\x01",
        "len_past_end": b"\x93NUMPY\x01\x00\xff\xff{}",
        "fortran": raw(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }\n", b"\0" * 4),
        "big_endian": raw(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }\n", b"\0" * 4),
        "truncated": raw(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }\n", b"\0" * 40),
        "huge_shape": raw(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (576460752303423487, 576460752303423487), }\n"),
        # found by review, fixed: fits uint64 but not int64 before the trailing 0
        "int64_prefix_overflow": raw(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 2147483648, 0), }\n"),
        "zero_dim": raw(2, "{'descr': '<i8', 'fortran_order': False, 'shape': (0, 7), }\n"),
        "scalar": raw(3, "{'descr': '|u1', 'fortran_order': False, 'shape': (), }\n", b"\x07"),
        "py2_long": raw(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (1L,), }\n", b"\1\0\0\0"),
    }
    try:
        import io
        import numpy as np

        arrays = {
            "f4": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
            "f8": np.array([np.pi, -0.0, np.inf], dtype=np.float64),
            "i4": np.arange(-3, 3, dtype=np.int32).reshape(3, 2),
            "i8": np.array([2**40, -1], dtype=np.int64),
            "u1": np.arange(5, dtype=np.uint8),
            "u2": np.array([0x3F80, 0x7FC0], dtype=np.uint16),  # bfloat16 bits as torch writes them
        }
        try:
            import ml_dtypes

            arrays["bf16"] = np.array([[1.0, -2.5], [np.nan, 0.125]], dtype=ml_dtypes.bfloat16)
        except ImportError:
            pass
        for name, a in arrays.items():
            for version in ((1, 0), (2, 0), (3, 0)):
                buf = io.BytesIO()
                np.lib.format.write_array(buf, a, version=version, allow_pickle=False)
                seeds[f"{name}_v{version[0]}"] = buf.getvalue()
    except ImportError:
        print("make_corpus.py: numpy not found; writing hand-made seeds only", file=sys.stderr)
    for name, data in seeds.items():
        with open(os.path.join(out, name + ".npy"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
