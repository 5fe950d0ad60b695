#!/usr/bin/env python3
"""KTransformers' kt-kernel INT8 / INT4 SFT MoE, the peer kt-bench moe --dtype int8|int4 is
measured against.

Runs in kt-kernel's own virtual environment (it pins its own torch). It reads the inputs
kt-bench wrote (a safetensors file: gate/up/down as the values libkt multiplies by, i.e. the
dequantized weights, x, ids, w and grad_y), hands the weights to kt-kernel's SFT wrapper as
bf16 (kt-kernel quantizes them itself, into its own INT8 / INT4 layout), prints
{"ready": true, ...} and then times one call per request read from stdin, "fwd C" or
"fwdbwd C" (C: the call's index, for its ids), answering {"ms": T}, until "quit": the protocol
of moe_torch_peer.py (tools/kt-bench/moe_peer.c).

Classes: --mode frozen -> AMXINT8_SFT_SkipLoRA / AMXINT4_SFT_SkipLoRA (the base weights frozen,
no adapters: backward gives grad_x and the routing weights' grads, as libkt's frozen mode);
--mode lora -> AMXINT8_SFT / AMXINT4_SFT with rank-R adapters on gate, up and down (their
grads too). A call is KTMoEWrapper.forward (and .backward), the calls a user of the wrapper
makes, with its copies into and out of its staging buffers.

usage: moe_ktkernel_peer.py INPUTS.safetensors --mode frozen|lora --dtype int8|int4
                            [--threads N] [--lora-rank R] [--lora-alpha A] [--rotate N]
                            [--shift S]
       moe_ktkernel_peer.py --probe
The environment's KT_KERNEL_CPU_VARIANT (amx, avx512_bf16, ...) picks kt-kernel's build, as
kt-kernel itself reads it. Exit 77 when kt-kernel (or what it needs) cannot be used: the caller
reports the peer as null.
"""
import argparse
import json
import os
import sys
import time


def fail(msg, code=77):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(code)


try:
    import torch
    from safetensors.torch import load_file
except ImportError as e:
    fail(f"torch or safetensors missing: {e}")

try:
    import kt_kernel
    from kt_kernel import KTMoEWrapper
    from kt_kernel import kt_kernel_ext as ext
except Exception as e:  # ImportError, or kt-kernel's own refusal of this CPU
    fail(f"kt-kernel not usable: {type(e).__name__}: {e}")

METHODS = {("frozen", "int8"): "AMXINT8_SFT_SkipLoRA", ("frozen", "int4"): "AMXINT4_SFT_SkipLoRA",
           ("lora", "int8"): "AMXINT8_SFT", ("lora", "int4"): "AMXINT4_SFT"}
CLASSES = {"AMXINT8_SFT_SkipLoRA": "AMXInt8_SFT_MOE_SkipLoRA",
           "AMXINT4_SFT_SkipLoRA": "AMXInt4_SFT_MOE_SkipLoRA",
           "AMXINT8_SFT": "AMXInt8_SFT_MOE", "AMXINT4_SFT": "AMXInt4_SFT_MOE"}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def probe_info():
    flags = cpu_flags()
    moe = getattr(ext, "moe", None)
    names = sorted(n for n in dir(moe) if "SFT" in n) if moe is not None else []
    return {
        "ktkernel_version": getattr(kt_kernel, "__version__", None),
        "cpu_variant": getattr(kt_kernel, "__cpu_variant__", None),
        "int8_kernel": getattr(kt_kernel, "__int8_kernel__", None),
        "cpu_variant_env": os.environ.get("KT_KERNEL_CPU_VARIANT"),
        "torch_version": torch.__version__,
        "cpu_has_amx": all(f in flags for f in ("amx_tile", "amx_int8", "amx_bf16")),
        "cpu_has_avx512_vnni": "avx512_vnni" in flags,
        "cpu_has_avx512_bf16": "avx512_bf16" in flags,
        "sft_classes": names,
        "int_sft_classes_present": {c: moe is not None and getattr(moe, c, None) is not None
                                    for c in sorted(set(CLASSES.values()))},
    }


def make_wrapper(method, E, k, H, I, threads, qlen, rank, alpha):
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=k, hidden_size=H,
                     moe_intermediate_size=I, gpu_experts_mask=None, cpuinfer_threads=threads,
                     threadpool_count=1, weight_path="", chunked_prefill_size=qlen,
                     method=method, mode="sft", num_gpu_experts=0, lora_rank=rank,
                     lora_alpha=alpha, lora_dropout=0.0, max_cache_depth=1,
                     full_weight_grad=False)
    # a single layer: the backward weights packed once at load (read when the C++ config is
    # built), as a model whose layers each keep their own
    w.share_backward_bb = False
    w.share_cache_pool = False
    return w


def load_bf16(w, gate, up, down, E):
    """The bf16 weights into kt-kernel, which quantizes them in C++. INT8_SFT's Python
    load_weights_from_tensors refuses tensors (it wants kt-kernel's pre-quantized .kt files);
    the SkipLoRA INT8 name and the INT4 names take them. Where it refuses, the weights are set
    as load_weights_from_tensors sets them and load_weights is called: the C++ class is given
    bf16 pointers as kt-kernel gives them when it re-quantizes updated weights
    (update_base_weights); the ready line's rel_err checks the result."""
    p2l = torch.arange(E, dtype=torch.int64)
    try:
        w.load_weights_from_tensors(gate, up, down, p2l)
        return "load_weights_from_tensors"
    except ValueError as e:
        if "pre-quantized" not in str(e):
            raise
    w.gate_proj, w.up_proj, w.down_proj = gate, up, down
    w.load_weights(p2l)
    return "load_weights (bf16 pointers; load_weights_from_tensors refuses INT8_SFT)"


def reference(x, ids, wts, gate, up, down, n_tok):
    """float32 output of the first n_tok tokens on the given (dequantized) weights."""
    out = torch.zeros(n_tok, x.shape[1])
    for t in range(n_tok):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xe = x[t].float()
            g = gate[e].float() @ xe
            u = up[e].float() @ xe
            a = torch.nn.functional.silu(g) * u
            out[t] += float(wts[t, j]) * (down[e].float() @ a)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="?")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--mode", choices=["frozen", "lora", "full"])
    ap.add_argument("--dtype", choices=["int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--rotate", type=int, default=1)
    ap.add_argument("--shift", type=int, default=None)
    args = ap.parse_args()

    if args.probe:
        print(json.dumps(probe_info()), flush=True)
        return
    if args.inputs is None or args.mode is None or args.dtype is None:
        fail("needs INPUTS, --mode and --dtype (or --probe)", 2)
    if args.mode == "full":
        fail("kt-kernel's INT8/INT4 SFT classes train no quantized base weights (full mode)")
    method = METHODS[(args.mode, args.dtype)]
    torch.set_num_threads(1)  # kt-kernel's own pool does the work; torch only copies

    t = load_file(args.inputs)
    gate = t["gate"].to(torch.bfloat16).contiguous()
    up = t["up"].to(torch.bfloat16).contiguous()
    down = t["down"].to(torch.bfloat16).contiguous()
    x0 = t["x"].to(torch.bfloat16).contiguous()
    ids = t["ids"].long().contiguous()
    w0 = t["w"].float().contiguous()
    gy = t["grad_y"].to(torch.bfloat16).contiguous()
    del t
    E, I, H = gate.shape
    qlen, k = ids.shape

    rank = args.lora_rank  # SkipLoRA (frozen) wants a positive rank too, and skips the adapters
    try:
        w = make_wrapper(method, E, k, H, I, args.threads, qlen, rank, args.lora_alpha)
    except Exception as e:
        fail(f"{method} refused: {type(e).__name__}: {e}")
    if args.mode == "lora":
        r = args.lora_rank
        gen = torch.Generator().manual_seed(0)

        def a_of(i):
            return (torch.randn(E, r, i, generator=gen) * 0.01).to(torch.bfloat16).contiguous()

        def b_of(o):
            return torch.zeros(E, o, r, dtype=torch.bfloat16)

        lw = [a_of(H), b_of(I), a_of(H), b_of(I), a_of(I), b_of(H)]
        lg = [torch.zeros_like(p) for p in lw]
        w.init_lora_weights(*lw, *lg)
    t0 = time.perf_counter()
    try:
        how = load_bf16(w, gate, up, down, E)
    except Exception as e:
        fail(f"{method}: loading bf16 weights failed: {type(e).__name__}: {e}")
    load_s = time.perf_counter() - t0

    rotations = max(1, args.rotate)
    shift = args.shift if args.shift is not None else E // rotations
    ids_by_call = [((ids + r * shift) % E).contiguous() for r in range(rotations)]

    # kt-kernel's error against float32 on the weights it was given (its own quantization on
    # top of libkt's), on a few tokens: a check that the bf16 weights were taken
    n_chk = min(qlen, 4)
    y = w.forward(x0, ids, w0, save_for_backward=False)
    ref = reference(x0, ids, w0, gate, up, down, n_chk)
    rel = float((y[:n_chk].float() - ref).norm() / ref.norm().clamp_min(1e-30))

    def run(backward, ids_c):
        if not backward:
            w.forward(x0, ids_c, w0, save_for_backward=False)
            return
        w.forward(x0, ids_c, w0, save_for_backward=True)
        w.backward(gy)

    info = probe_info()
    info.pop("sft_classes", None)
    info.pop("int_sft_classes_present", None)
    info.update({"method": method, "class": CLASSES[method], "load": how,
                 "load_s": round(load_s, 3), "threads": args.threads,
                 "rel_err_fwd": rel})
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] not in ("fwd", "fwdbwd") or len(words) != 2:
            fail(f"bad request {line.strip()!r}", 2)
        ids_c = ids_by_call[int(words[1]) % len(ids_by_call)]
        t0 = time.perf_counter()
        run(words[0] == "fwdbwd", ids_c)
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)


if __name__ == "__main__":
    main()
