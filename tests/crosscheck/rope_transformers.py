#!/usr/bin/env python3
"""libkt's rope against transformers' own rotary embeddings.

For each case, transformers builds cos/sin (or freqs_cis) with the model's RotaryEmbedding
class from a config (default, linear and yarn rope parameters, DeepSeek's mscale split) and
applies them with the model's function: Llama's apply_rotary_pos_emb (rotate_half; partial
rotary as the first rotary_dim elements, the rest passed through), DeepSeek-V2's
apply_rotary_emb (interleaved pairs, a complex multiply) and DeepSeek-V3's
apply_rotary_pos_emb_interleave ([evens | odds]). torch's autograd through the same function
gives the input gradient. libkt's forward and backward run in rope_helper on the same data.

transformers forms position * inv_freq in f32, libkt in float64 (lib/ops/rope_freqs.c), so the
two differ by about position * 2^-24 rad: the bound is 4e-6 + max_position * 2^-24 relative to
the output's scale (measured: 1.9e-6 below position 64, 9.4e-5 below 4096).

usage: rope_transformers.py ROPE_HELPER
Exit 77 (skipped) when torch or transformers is missing.
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    from transformers.models.llama import modeling_llama as llama
except ImportError as e:
    print(f"SKIPPED: torch/transformers not installed ({e})")
    sys.exit(77)

B, T, H = 2, 24, 3


def rope_parameters(case):
    p = {"rope_type": case.get("scaling", "default"), "rope_theta": case["theta"]}
    for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim"):
        if k in case:
            p[k] = case[k]
    return p


def transformers_rope(case, x, pos):
    """y = the model's rope of x [B,T,H,D] (torch, f32) at positions pos [B,T]."""
    r, d = case["rotary_dim"], x.shape[-1]
    q = x.transpose(1, 2)  # [B,H,T,D], as the models hold it
    max_pos = case["max_positions"]
    if case.get("scaling") == "yarn":  # the stretched context, as a yarn config states it
        max_pos = int(case["factor"] * case["original_max_position_embeddings"])
    common = dict(num_attention_heads=H, max_position_embeddings=max_pos,
                  rope_parameters=rope_parameters(case))
    if case["style"] == "half":
        cfg = LlamaConfig(hidden_size=H * r, head_dim=r, **common)
        cos, sin = llama.LlamaRotaryEmbedding(cfg)(q, pos)
        rot, _ = llama.apply_rotary_pos_emb(q[..., :r], q[..., :r], cos, sin)
    elif case["style"] == "interleaved":
        cfg = DeepseekV2Config(hidden_size=H * r, qk_rope_head_dim=r, **common)
        freqs_cis = v2.DeepseekV2RotaryEmbedding(cfg)(q, pos)
        rot, _ = v2.apply_rotary_emb(q[..., :r], q[..., :r], freqs_cis)
    else:
        cfg = DeepseekV3Config(hidden_size=H * r, qk_rope_head_dim=r, **common)
        cos, sin = v3.DeepseekV3RotaryEmbedding(cfg)(q, pos)
        rot, _ = v3.apply_rotary_pos_emb_interleave(q[..., :r], q[..., :r], cos, sin)
    return torch.cat([rot, q[..., r:]], dim=-1).transpose(1, 2) if r < d else rot.transpose(1, 2)


def libkt_rope(helper, work, case, x, pos, gy):
    paths = {k: os.path.join(work, k + ".bin") for k in ("x", "pos", "gy", "y", "gx")}
    x.numpy().astype("<f4").tofile(paths["x"])
    pos.numpy().astype("<i8").tofile(paths["pos"])
    gy.numpy().astype("<f4").tofile(paths["gy"])
    attrs = [f"theta={case['theta']}", f"rotary_dim={case['rotary_dim']}",
             f"max_positions={case['max_positions']}",
             f"interleaved={int(case['style'] != 'half')}",
             f"deinterleave={int(case['style'] == 'deinterleave')}"]
    names = {"factor": "factor", "original_max_position_embeddings": "original_max_positions",
             "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
             "mscale_all_dim": "mscale_all_dim"}
    if "scaling" in case:
        attrs.append(f"scaling={case['scaling']}")
    attrs += [f"{names[k]}={case[k]}" for k in names if k in case]
    subprocess.run([helper, paths["x"], paths["pos"], paths["gy"], paths["y"], paths["gx"],
                    str(B), str(T), str(H), str(x.shape[-1])] + attrs, check=True)
    shape = tuple(x.shape)
    y = np.fromfile(paths["y"], dtype="<f4").reshape(shape)
    gx = np.fromfile(paths["gx"], dtype="<f4").reshape(shape)
    return torch.from_numpy(y), torch.from_numpy(gx)


def rel(a, b):
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6))


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    helper = sys.argv[1]
    cases = []
    for style in ("half", "interleaved", "deinterleave"):
        for pmax in (64, 4096):
            base = dict(style=style, theta=10000.0, rotary_dim=16, d=16, max_positions=pmax,
                        pmax=pmax)
            cases.append(dict(base, name="default"))
            cases.append(dict(base, name="partial, theta 1e6", theta=1e6, rotary_dim=8, d=12))
            cases.append(dict(base, name="linear", scaling="linear", factor=4.0))
            cases.append(dict(base, name="yarn", scaling="yarn", factor=40.0,
                              original_max_position_embeddings=4096))
            cases.append(dict(base, name="yarn mscale split", scaling="yarn", factor=40.0,
                              original_max_position_embeddings=4096, mscale=0.707,
                              mscale_all_dim=0.707, rotary_dim=64, d=64))
            cases.append(dict(base, name="yarn mscale 1/0.5", scaling="yarn", factor=16.0,
                              original_max_position_embeddings=256, beta_fast=8.0,
                              beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5))
    gen = torch.Generator().manual_seed(29)
    failed = 0
    with tempfile.TemporaryDirectory() as work:
        for case in cases:
            x = torch.rand(B, T, H, case["d"], generator=gen) * 4 - 2
            pos = torch.randint(0, case["pmax"], (B, T), generator=gen)
            gy = torch.randn(B, T, H, case["d"], generator=gen)
            xr = x.clone().requires_grad_(True)
            y_ref = transformers_rope(case, xr, pos)
            (y_ref * gy).sum().backward()
            y, gx = libkt_rope(helper, work, case, x, pos, gy)
            bound = 4e-6 + case["pmax"] * 2.0 ** -24
            ey, eg = rel(y, y_ref.detach()), rel(gx, xr.grad)
            ok = ey <= bound and eg <= bound
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {case['style']:12} {case['name']:20} "
                  f"positions < {case['pmax']:5}: y {ey:.2e}, dx {eg:.2e} (bound {bound:.1e})")
    print(f"{len(cases) - failed} of {len(cases)} cases agree with transformers")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
