#!/usr/bin/env python3
"""PyTorch's usual CPU MoE, the peer kt-bench moe measures libkt against.

The Hugging Face SparseMoeBlock loop without the router: for each expert hit, gather its
tokens (index_select), gate/up/down with F.linear, weight by the routing weights and
index_add_ back. Reads the same inputs kt-bench used (a safetensors file with the expert
weights, x, ids, w and grad_y), prints {"ready": true, ...} once they are loaded, then times
one call per request read from stdin, "fwd C" or "fwdbwd C" (C: the call's index, for its
ids), answering {"ms": T}, until "quit": kt-bench alternates these calls with its own, so that
both are measured in the same minutes of a machine whose speed drifts (tools/kt-bench/
moe_peer.c).

usage: moe_torch_peer.py INPUTS.safetensors --mode frozen|lora|full --dtype bf16|f32
                         [--threads N] [--lora-rank R] [--rotate N] [--shift S]
Exit 77 when torch or safetensors is missing (the caller reports the peer as null).
"""
import argparse
import json
import sys
import time

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
except ImportError as e:  # the caller prints a note and a null ratio
    print(json.dumps({"error": f"torch or safetensors missing: {e}"}))
    sys.exit(77)


def moe_forward(x, ids, w, gate, up, down, lora):
    """y = sum_j w[t, j] * down(silu(gate(x)) * up(x)) for the experts in ids."""
    qlen, hidden = x.shape
    n_experts = len(gate)
    y = torch.zeros(qlen, hidden, dtype=x.dtype)
    mask = F.one_hot(ids, num_classes=n_experts).permute(2, 1, 0)  # [E, k, qlen]
    hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten().tolist()
    for e in hit:
        slot, tok = torch.where(mask[e])
        xe = x.index_select(0, tok)
        g = F.linear(xe, gate[e])
        u = F.linear(xe, up[e])
        if lora is not None:
            (ag, bg), (au, bu), (ad, bd), scale = lora[e]
            g = g + scale * F.linear(F.linear(xe, ag), bg)
            u = u + scale * F.linear(F.linear(xe, au), bu)
        a = F.silu(g) * u
        d = F.linear(a, down[e])
        if lora is not None:
            d = d + scale * F.linear(F.linear(a, ad), bd)
        d = d * w[tok, slot, None]
        y.index_add_(0, tok, d.to(y.dtype))
    return y


def serve(run, ids_by_call, info):
    """Times one call per request line ("fwd C", "fwdbwd C"; "quit" ends)."""
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] not in ("fwd", "fwdbwd") or len(words) != 2:
            print(json.dumps({"error": f"bad request {line.strip()!r}"}), flush=True)
            sys.exit(2)
        ids = ids_by_call[int(words[1]) % len(ids_by_call)]
        t0 = time.perf_counter()
        run(words[0] == "fwdbwd", ids)
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs")
    ap.add_argument("--mode", choices=["frozen", "lora", "full"], required=True)
    ap.add_argument("--dtype", choices=["bf16", "f32"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    # call i routes to the experts ids + (i mod N) * S, mod E (S: --shift, E // N without),
    # as kt-bench does at a few tokens, so that no call finds the last one's experts in the
    # CPU's caches
    ap.add_argument("--rotate", type=int, default=1)
    ap.add_argument("--shift", type=int, default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t = load_file(args.inputs)
    # One tensor per expert, as the Hugging Face block holds one nn.Linear per expert: a
    # slice of one stacked parameter would make every expert's backward allocate and add a
    # gradient the size of all experts (measured: 78x slower in full mode).
    gate, up, down = ([w.clone() for w in t[name].to(dt).unbind(0)]
                      for name in ("gate", "up", "down"))
    x0, ids, w0, gy = t["x"].to(dt), t["ids"].long(), t["w"].to(dt), t["grad_y"].to(dt)
    del t  # the weights are copied out: the file's tensors need not stay (two peers stay up)
    n_experts, (inter, hidden) = len(gate), gate[0].shape

    lora = None
    if args.mode == "lora":
        r, scale = args.lora_rank, args.lora_alpha / args.lora_rank
        gen = torch.Generator().manual_seed(0)
        lora = []
        for _ in range(n_experts):
            def pair(i, o):
                a = (torch.randn(r, i, generator=gen) * 0.01).to(dt).requires_grad_()
                b = torch.zeros(o, r, dtype=dt).requires_grad_()
                return a, b
            lora.append((pair(hidden, inter), pair(hidden, inter), pair(inter, hidden), scale))
    if args.mode == "full":
        for p in (*gate, *up, *down):
            p.requires_grad_()

    rotations = max(1, args.rotate)
    shift = args.shift if args.shift is not None else n_experts // rotations
    ids_by_call = [(ids + r * shift) % n_experts for r in range(rotations)]

    def run(backward, ids):
        x = x0.detach().clone().requires_grad_(backward)
        w = w0.detach().clone().requires_grad_(backward)
        if args.mode == "full":
            for p in (*gate, *up, *down):
                p.grad = None  # zero_grad(set_to_none=True)
        if not backward:
            with torch.no_grad():
                return moe_forward(x, ids, w, gate, up, down, lora)
        y = moe_forward(x, ids, w, gate, up, down, lora)
        y.backward(gy)
        return y

    serve(run, ids_by_call,
          {"torch_version": torch.__version__, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
