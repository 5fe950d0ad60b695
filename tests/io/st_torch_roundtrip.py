#!/usr/bin/python3
"""Cross-checks libkt's safetensors against the reference implementation.

usage: st_torch_roundtrip.py path/to/st_helper

C -> Python: st_helper writes a file; safetensors.torch.load_file must read exactly the
tensors (names, dtypes, shapes, values) and metadata below.
Python -> C: safetensors.torch.save_file writes the same tensors; st_helper check must
accept them, also split into two shards with an index as transformers' save_pretrained
writes them. The value formulas match tests/io/st_helper.c.
Conversions: float tensors of every dtype torch writes (f32, bf16, f16, f64), random and at
the rounding edges, read by libkt into f32, bf16 and f16 must equal torch's .to(dtype) bit for
bit; except f64 into bf16 / f16, where torch rounds twice (through f32) and libkt once: those
are checked against an exact rounding computed here.

Exits 77 (ctest's SKIP_RETURN_CODE) when torch or safetensors is not installed.
"""
import json
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

        sharded = os.path.join(d, "sharded")
        os.mkdir(sharded)
        want = expected()
        names = sorted(want)
        parts = [names[: len(names) // 2], names[len(names) // 2 :]]
        weight_map = {}
        for k, part in enumerate(parts):
            shard = f"model-{k + 1:05d}-of-00002.safetensors"
            save_file({n: want[n] for n in part}, os.path.join(sharded, shard),
                      metadata={"source": "torch"})
            weight_map.update({n: shard for n in part})
        total = sum(t.numel() * t.element_size() for t in want.values())
        with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
        subprocess.run([helper, "check", sharded], check=True)
        print("ok: libkt reads the sharded checkpoint (index + 2 shards) torch wrote")

        check_conversions(helper, d)
        print("ok: libkt's float conversions equal torch's (f64 into 16 bits: one rounding)")


def round_f64_exact(x, dtype):
    """x (float64) rounded once to nearest even into bfloat16 / float16, as float64."""
    import math
    info = torch.finfo(dtype)
    mant = 8 if dtype == torch.bfloat16 else 11  # significand bits
    out = []
    for v in x.tolist():
        if math.isnan(v) or math.isinf(v) or v == 0:
            out.append(v)
            continue
        e = max(math.frexp(v)[1] - mant, math.frexp(info.tiny)[1] - mant)  # subnormals
        q = v / 2.0**e  # exact: a power-of-two scaling
        r = round(q)  # Python rounds half to even
        y = math.copysign(r * 2.0**e, v)  # an underflow keeps its sign
        if abs(y) > info.max:
            y = math.copysign(math.inf, v)
        out.append(y)
    return torch.tensor(out, dtype=torch.float64).to(dtype)


def check_conversions(helper, d):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (4000,), generator=g).to(torch.float64))
    # ties and near-ties of each target, overflow, subnormals, signed zero
    edges = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11,
                          1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40, 65519.0, 65520.0, -65504.0,
                          3.4e38, 1e300, -1e-300, 2**-140, 2**-25, 2**-24 * 1.5, -0.0, 0.1],
                         dtype=torch.float64)
    x = torch.cat([base, edges])
    tensors = {"f64": x, "f32": x.float(), "bf16": x.float().bfloat16(),
               "f16": x.float().half()}
    src = os.path.join(d, "conv_in.safetensors")
    out = os.path.join(d, "conv_out.safetensors")
    save_file(tensors, src)
    subprocess.run([helper, "convert", src, out], check=True)
    got = load_file(out)
    targets = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    for name, t in tensors.items():
        for tname, tdtype in targets.items():
            if name == "f64" and tdtype != torch.float32:
                want = round_f64_exact(t, tdtype)
            else:
                want = t.to(tdtype)
            g = got[f"{name}.{tname}"]
            if g.dtype != tdtype or not torch.equal(g.view(torch.int16 if tdtype != torch.float32
                                                           else torch.int32),
                                                    want.view(torch.int16 if tdtype != torch.float32
                                                              else torch.int32)):
                bad = (g.double() != want.double()).nonzero()[:5].flatten().tolist()
                sys.exit(f"FAIL: {name} -> {tname} differs at {bad}: "
                         f"{[t[i].item() for i in bad]} gave {[g[i].item() for i in bad]}, "
                         f"expected {[want[i].item() for i in bad]}")


if __name__ == "__main__":
    main()
