#!/usr/bin/env python3
"""Largest absolute difference between the float tensors of two safetensors
files (same names and shapes required). Used by test_distributed.sh.

    python3 compare_safetensors.py a.safetensors b.safetensors
prints the max |a - b| over all elements and the max |a|."""
import json
import struct
import sys

FORMATS = {"F32": "f", "F64": "d"}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in FORMATS:
            continue
        begin, end = info["data_offsets"]
        fmt = "<" + FORMATS[info["dtype"]]
        out[name] = (info["shape"], [v[0] for v in struct.iter_unpack(fmt, data[base + begin : base + end])])
    return out


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    if sorted(a) != sorted(b):
        sys.exit("different tensor names: %s vs %s" % (sorted(a), sorted(b)))
    diff = scale = 0.0
    for name in a:
        (sa, va), (sb, vb) = a[name], b[name]
        if sa != sb:
            sys.exit("%s: shapes %s vs %s" % (name, sa, sb))
        for x, y in zip(va, vb):
            diff = max(diff, abs(x - y))
            scale = max(scale, abs(x))
    print("%.3e %.3e" % (diff, scale))


if __name__ == "__main__":
    main()
