#!/usr/bin/python3
"""Checks libkt's MoE layer against a Hugging Face-style MoE written in PyTorch.

usage: torch_moe_check.py path/to/moe_helper

For bf16 and f32 weights, frozen and full modes, both ways round:
- moe_helper writes the experts (HF naming, prefix "mlp."), the inputs, and libkt's
  forward/backward results as safetensors;
- this script writes the experts (as a Hugging Face checkpoint names them, under
  "model.layers.0.mlp.", next to the router's own weight) and the inputs with
  safetensors.torch, and moe_helper loads them (kt_moe_load, kt_st_read) and writes its results.
Either way this script builds the same layer the way Hugging Face models do (a loop over
experts with index_select, F.linear and index_add_), runs it in float64 on the same weights and
inputs, and compares y, grad_x, grad_weights and (full mode) every expert weight gradient.
Tolerance, relative to the largest reference value of each tensor: 1e-2 for bf16 weights, 1e-5
for f32.

Exits 77 (ctest's SKIP_RETURN_CODE) when torch or safetensors is not installed.
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
except ImportError:
    print("SKIPPED: torch/safetensors not installed")
    sys.exit(77)

PROJ = ("gate_proj", "up_proj", "down_proj")
H, I, E, K, Q = 64, 48, 8, 2, 33  # moe_helper's shape
TORCH_PREFIX = "model.layers.0.mlp."


def hf_moe(x, ids, w, experts):
    """experts[e] = (gate, up, down) weight tensors in nn.Linear layout."""
    y = torch.zeros_like(x)
    for e, (wg, wu, wd) in enumerate(experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x.index_select(0, tok)
        h = F.silu(F.linear(xe, wg)) * F.linear(xe, wu)
        out = F.linear(h, wd) * w[tok, slot].unsqueeze(-1)
        y = y.index_add(0, tok, out)
    return y


def rel_err(got, want):
    got = got.to(torch.float64)
    scale = max(want.abs().max().item(), 1e-6)
    return (got - want).abs().max().item() / scale


def write_torch_files(dtype, d, seed):
    """The experts and inputs as PyTorch code would save them (moe_helper's `read` mode)."""
    g = torch.Generator().manual_seed(seed)
    wdtype = torch.bfloat16 if dtype == "bf16" else torch.float32

    def uniform(*shape, lo=-0.25, hi=0.25):
        return torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo

    tensors = {TORCH_PREFIX + "gate.weight": uniform(E, H).to(wdtype)}  # the router's, not read
    for e in range(E):
        for p, shape in zip(PROJ, ((I, H), (I, H), (H, I))):
            tensors[f"{TORCH_PREFIX}experts.{e}.{p}.weight"] = uniform(*shape).to(wdtype)
    save_file(tensors, os.path.join(d, "weights.safetensors"))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(Q)]).to(torch.int64)
    inputs = {"x": uniform(Q, H, lo=-1, hi=1).float(), "ids": ids,
              "weights": uniform(Q, K, lo=0.1, hi=1.0).float(),
              "grad_y": uniform(Q, H, lo=-1, hi=1).float()}
    save_file(inputs, os.path.join(d, "inputs.safetensors"))


def check(helper, dtype, mode, d, torch_wrote):
    if torch_wrote:
        write_torch_files(dtype, d, seed=17 + (mode == "full") + 2 * (dtype == "f32"))
        subprocess.run([helper, d, dtype, mode, "read"], check=True)
    else:
        subprocess.run([helper, d, dtype, mode], check=True)
    prefix = TORCH_PREFIX if torch_wrote else "mlp."
    wts = load_file(os.path.join(d, "weights.safetensors"))
    inp = load_file(os.path.join(d, "inputs.safetensors"))
    out = load_file(os.path.join(d, "outputs.safetensors"))
    want_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    n_experts = E
    experts = []
    for e in range(n_experts):
        ws = []
        for p in PROJ:
            t = wts[f"{prefix}experts.{e}.{p}.weight"]
            if t.dtype != want_dtype:
                sys.exit(f"FAIL: {p} of expert {e} is {t.dtype}, expected {want_dtype}")
            ws.append(t.to(torch.float64).requires_grad_(mode == "full"))
        experts.append(tuple(ws))
    x = inp["x"].to(torch.float64).requires_grad_(True)
    w = inp["weights"].to(torch.float64).requires_grad_(True)
    y = hf_moe(x, inp["ids"], w, experts)
    y.backward(inp["grad_y"].to(torch.float64))
    tol = 1e-2 if dtype == "bf16" else 1e-5
    origin = "files PyTorch wrote" if torch_wrote else "files libkt wrote"
    pairs = [("y", out["y"], y.detach()), ("grad_x", out["grad_x"], x.grad),
             ("grad_weights", out["grad_weights"], w.grad)]
    if mode == "full":
        for e in range(n_experts):
            for p, wt in zip(PROJ, experts[e]):
                g = wt.grad if wt.grad is not None else torch.zeros_like(wt)
                pairs.append((f"experts.{e}.{p}.grad", out[f"experts.{e}.{p}.grad"], g))
    worst = 0.0
    for name, got, want in pairs:
        err = rel_err(got, want)
        worst = max(worst, err)
        if err >= tol:
            sys.exit(f"FAIL: {dtype} {mode} ({origin}): {name} relative error {err:.3g} >= {tol}")
    print(f"ok: {dtype} weights, {mode}, {origin}: worst relative error {worst:.3g} (tol {tol})")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: torch_moe_check.py path/to/moe_helper")
    for torch_wrote in (False, True):
        for dtype in ("bf16", "f32"):
            for mode in ("frozen", "full"):
                with tempfile.TemporaryDirectory() as d:
                    check(sys.argv[1], dtype, mode, d, torch_wrote)


if __name__ == "__main__":
    main()
