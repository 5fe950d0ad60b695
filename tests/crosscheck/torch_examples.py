#!/usr/bin/env python3
"""Cross-check of the example models against PyTorch.

For examples/mlp.ktg and examples/conv_stack.ktg: compile with kt-graphc, write random
parameters and inputs as safetensors, run kt-run --backward, compute the same model in
PyTorch (float32, autograd) from the same files, and compare the outputs, the loss and every
parameter gradient: max |libkt - torch| / max |torch| must be under 1e-5 for each tensor.

usage: torch_examples.py KT_GRAPHC KT_RUN EXAMPLES_DIR
Exit 77 (skipped) when torch or safetensors is missing.
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"SKIPPED: torch/safetensors not installed ({e})")
    sys.exit(77)

TOLERANCE = 1e-5


def mlp(p, x, y):
    h = F.silu(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return {"logits": logits}, F.cross_entropy(logits, y.long(), ignore_index=-100)


def conv_causal(x, w):
    """libkt conv1d, causal, full: x [B, T, Cin], w [Cout, K, Cin] -> [B, T, Cout]."""
    k = w.shape[1]
    xt = F.pad(x.transpose(1, 2), (k - 1, 0))
    return F.conv1d(xt, w.permute(0, 2, 1)).transpose(1, 2)


def conv_depthwise_same(x, w):
    """libkt conv1d, same, depthwise: x [B, T, C], w [C, K]; left pad K/2, right K-1-K/2."""
    k = w.shape[1]
    xt = F.pad(x.transpose(1, 2), (k // 2, k - 1 - k // 2))
    return F.conv1d(xt, w.unsqueeze(1), groups=w.shape[0]).transpose(1, 2)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def conv_stack(p, x, y):
    h = conv_causal(x, p["embed.w"])
    layer = 0
    while f"conv{layer}.w" in p:
        a = F.silu(conv_causal(h, p[f"conv{layer}.w"]))
        a = conv_depthwise_same(a, p[f"dw{layer}.w"])
        h = rmsnorm(h + a, p[f"norm{layer}.w"], 1e-5)
        layer += 1
    logits = h.reshape(-1, h.shape[-1]) @ p["head.w"]
    return {"logits": logits}, F.cross_entropy(logits, y.long(), ignore_index=-100)


# name -> (model, parameter shapes, input shapes, number of classes)
MODELS = {
    "mlp": (mlp, {"w1": (16, 64), "b1": (64,), "w2": (64, 10), "b2": (10,)},
            {"x": (32, 16), "y": (32,)}, 10),
    "conv_stack": (conv_stack,
                   dict({"embed.w": (32, 1, 12), "head.w": (32, 8)},
                        **{k: v for l in range(4) for k, v in
                           ((f"conv{l}.w", (32, 3, 32)), (f"dw{l}.w", (32, 5)),
                            (f"norm{l}.w", (32,)))}),
                   {"x": (4, 64, 12), "y": (4 * 64,)}, 8),
}


def rel_err(a, b):
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-30)


def check(name, graphc, run, examples, tmp):
    model, pshapes, ishapes, classes = MODELS[name]
    gen = torch.Generator().manual_seed(1234)
    params = {k: torch.randn(*s, generator=gen) * (0.3 if len(s) > 1 else 0.5) + (1.0 if k.startswith("norm") else 0.0)
              for k, s in pshapes.items()}
    inputs = {"x": torch.randn(*ishapes["x"], generator=gen),
              "y": torch.randint(0, classes, ishapes["y"], generator=gen, dtype=torch.int32)}
    inputs["y"][3] = -100  # one ignored target
    ktp, pfile, ifile, ofile = (os.path.join(tmp, f"{name}.{e}") for e in
                                ("ktp", "params.safetensors", "in.safetensors", "out.safetensors"))
    save_file(params, pfile)
    save_file(inputs, ifile)
    subprocess.run([graphc, os.path.join(examples, f"{name}.ktg"), "-o", ktp], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([run, ktp, "--params", pfile, "--inputs", ifile, "--out", ofile,
                    "--backward", "--threads", "2"], check=True, stderr=subprocess.DEVNULL)
    got = load_file(ofile)

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    outputs, loss = model(leaves, inputs["x"], inputs["y"])
    loss.backward()
    worst = 0.0
    failures = []
    checks = [(k, got[k], v.detach()) for k, v in outputs.items()]
    checks.append(("loss", got["loss"].reshape(()), loss.detach()))
    checks += [(f"grad.{k}", got[f"grad.{k}"], v.grad) for k, v in leaves.items()]
    for label, mine, ref in checks:
        e = rel_err(mine.float(), ref.float())
        worst = max(worst, e)
        if not e < TOLERANCE:
            failures.append(f"{label}: relative error {e:.3g}")
    status = "ok" if not failures else "FAILED"
    print(f"{name}: {len(checks)} tensors compared, worst relative error {worst:.3g} "
          f"(tolerance {TOLERANCE:g}): {status}")
    for f in failures:
        print(f"  {f}")
    return not failures


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    graphc, run, examples = sys.argv[1:]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ok = all([check(n, graphc, run, examples, tmp) for n in MODELS])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
