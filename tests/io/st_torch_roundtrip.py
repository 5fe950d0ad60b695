#!/usr/bin/python3
"""Cross-checks libkt's safetensors against the reference implementation.

usage: st_torch_roundtrip.py path/to/st_helper

C -> Python: st_helper writes a file; safetensors.torch.load_file must read exactly the
tensors (names, dtypes, shapes, values) and metadata below.
Python -> C: safetensors.torch.save_file writes the same tensors; st_helper check must
accept them. The value formulas match tests/io/st_helper.c.

Exits 77 (ctest's SKIP_RETURN_CODE) when torch or safetensors is not installed.
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError:
    print("SKIPPED: torch/safetensors not installed")
    sys.exit(77)

# (name, dtype, shape), as in st_helper.c's specs[]
SPECS = [
    ("f32", torch.float32, (2, 3, 4)),
    ("bf16", torch.bfloat16, (7,)),
    ('weird "name" \u00e9\\', torch.float16, (3, 5)),
    ("i32", torch.int32, ()),
    ("i64", torch.int64, (2, 2, 2, 2)),
    ("empty", torch.float32, (0, 3)),
]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def values(dtype, shape):
    i = torch.arange(numel(shape), dtype=torch.int64)
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        v = (((i * 7) % 17 - 8).to(torch.float64) * 0.25).to(dtype)
    else:
        base = (i * 7919) % 4096 - 2048
        v = (base * (2**19 if dtype == torch.int32 else 2**40)).to(dtype)
    return v.reshape(shape)


def expected():
    return {name: values(dtype, shape) for name, dtype, shape in SPECS}


def check_from_c(path):
    got = load_file(path)
    want = expected()
    if sorted(got) != sorted(want):
        sys.exit(f"FAIL: names {sorted(got)} != {sorted(want)}")
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            sys.exit(f"FAIL: {name!r} is {g.dtype}{tuple(g.shape)}, "
                     f"expected {w.dtype}{tuple(w.shape)}")
        if not torch.equal(g, w):
            sys.exit(f"FAIL: {name!r} values differ:\n{g}\n{w}")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    want_meta = {"source": "kt", 'escape "me"': "line\nbreak"}
    if meta != want_meta:
        sys.exit(f"FAIL: metadata {meta!r} != {want_meta!r}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: st_torch_roundtrip.py path/to/st_helper")
    helper = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        from_c = os.path.join(d, "from_c.safetensors")
        subprocess.run([helper, "write", from_c], check=True)
        check_from_c(from_c)
        print("ok: torch reads the file libkt wrote")

        from_torch = os.path.join(d, "from_torch.safetensors")
        save_file(expected(), from_torch, metadata={"source": "torch"})
        subprocess.run([helper, "check", from_torch], check=True)
        print("ok: libkt reads the file torch wrote")


if __name__ == "__main__":
    main()
