#!/usr/bin/env python3
"""PyTorch's CPU scaled_dot_product_attention, the peer kt-bench attention measures libkt against.

Reads the inputs kt-bench used (a safetensors file with q [B,T,Hq,D], k [B,S,Hkv,D],
v [B,S,Hkv,Dv], grad_o [B,T,Hq,Dv] and libkt's output o), lays them out as SDPA wants them
([B,H,T,D], contiguous; outside the timed region), checks its own output against libkt's once,
prints {"ready": true, ...} with what it found, then times one call per request read from
stdin, "fwd C" or "fwdbwd C" (C is ignored: every call sees the same inputs), answering
{"ms": T}, until "quit" (the protocol of tools/kt-bench/moe_peer.c).

Grouped-query attention (Hkv < Hq) goes through SDPA's enable_gqa where this torch has it;
without it the K/V heads are repeated (repeat_interleave) once, before the timed calls, and the
ready line says so. Causal attention with S == T is SDPA's is_causal; with S != T (libkt aligns
the causal diagonal to the end, SDPA's is_causal to the start) and with a window the visibility
goes in as a boolean mask, which may leave the fused CPU kernel.

usage: attn_torch_peer.py INPUTS.safetensors --dtype bf16|f32 [--threads N] [--causal 0|1]
                          [--scale F] [--window N] [--softcap F]
Exit 77 when torch >= 2 with scaled_dot_product_attention is missing, or when the
configuration has no SDPA equivalent (a softcap): the caller reports the peer as null.
"""
import argparse
import json
import struct
import sys
import time


def refuse(why):
    print(json.dumps({"error": why}), flush=True)
    sys.exit(77)


try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # the caller prints a note and a null ratio
    refuse(f"no torch in {sys.executable}: {e}")
if not hasattr(F, "scaled_dot_product_attention"):
    refuse(f"torch {torch.__version__} in {sys.executable} has no scaled_dot_product_attention "
           "(torch >= 2 needed: --torch-python or KT_TORCH_PYTHON)")


def load(path):
    """The safetensors file as a dict of tensors (the format by hand: safetensors itself is
    often absent from a fresh virtual environment)."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I32": torch.int32, "I64": torch.int64}
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        b, e = d["data_offsets"]
        t = torch.frombuffer(bytearray(blob[base + b:base + e]), dtype=dtypes[d["dtype"]])
        out[name] = t.reshape(d["shape"])
    return out


def serve(run, info):
    """Times one call per request line ("fwd C", "fwdbwd C"; "quit" ends)."""
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] not in ("fwd", "fwdbwd") or len(words) != 2:
            print(json.dumps({"error": f"bad request {line.strip()!r}"}), flush=True)
            sys.exit(2)
        t0 = time.perf_counter()
        run(words[0] == "fwdbwd")
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs")
    ap.add_argument("--dtype", choices=["bf16", "f32"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--scale", type=float, default=0.0)  # 0: 1/sqrt(D), as libkt
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--softcap", type=float, default=0.0)
    args = ap.parse_args()
    if args.softcap != 0.0:
        refuse("SDPA has no logit softcap")

    torch.set_num_threads(args.threads)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t = load(args.inputs)
    # [B,T,H,D] -> [B,H,T,D], contiguous: SDPA's layout, made before any call is timed
    q, k, v, go = (t[n].to(dt).transpose(1, 2).contiguous() for n in ("q", "k", "v", "grad_o"))
    kt_o = t["o"].float().transpose(1, 2)
    del t
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = args.scale if args.scale > 0 else D ** -0.5

    extra = {}
    gqa = "none"
    if Hkv != Hq:
        try:  # enable_gqa came after 2.0
            F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=True)
            extra["enable_gqa"] = True
            gqa = "enable_gqa"
        except TypeError:
            k = k.repeat_interleave(Hq // Hkv, dim=1).contiguous()
            v = v.repeat_interleave(Hq // Hkv, dim=1).contiguous()
            gqa = "repeat_interleave"
    mask = None
    if args.causal and (S != T or args.window > 0):
        pos = torch.arange(T).unsqueeze(1) + (S - T)  # query t's aligned position
        j = torch.arange(S).unsqueeze(0)
        mask = j <= pos
        if args.window > 0:
            mask = mask & (pos - j < args.window)
    elif not args.causal and args.window > 0:
        refuse("a window without causal has no SDPA equivalent here")
    is_causal = bool(args.causal) and mask is None

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, **extra)

    # the output against libkt's, once (the same inputs, the same attention)
    with torch.no_grad():
        o = attend(q, k, v)
    diff = (o.float() - kt_o).abs().max().item()
    # which kernel SDPA picks: the backward node's name says it
    node = type(attend(q.detach().requires_grad_(), k, v).grad_fn).__name__

    def run(backward):
        if not backward:
            with torch.no_grad():
                return attend(q, k, v)
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        o = attend(qq, kk, vv)
        o.backward(go)
        return o

    serve(run, {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
                "gqa": gqa, "mask": mask is not None, "backward_node": node,
                "max_abs_diff": diff})


if __name__ == "__main__":
    main()
