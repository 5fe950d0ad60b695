#!/usr/bin/env python3
"""Write tests/train/fixtures/lm_losses.json: the first 20 training losses of the main job's
model (examples/moe_lm.ktg) as transformers' Qwen3MoeForCausalLM computes them, from the
initial weights kt-train draws from its seed, on the same windows, with torch's AdamW.

The ctest lm_reference_losses (tests/train/lm_reference_test.sh, no torch needed) runs
kt-train the same 20 steps and compares its losses with these within 1e-4 relative.

The fixture holds the losses, the configuration and the data file's SHA-256, not the
weights: the test draws the same initial weights with kt-train from the seed.

Run with the venv that has torch + transformers + safetensors, after building kt-graphc and
kt-train:
    /work/venv-torch/bin/python tests/train/make_lm_reference.py --build build
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "train", "fixtures")

# The main job's layer sizes (examples/moe_lm.ktg's defaults) with a small batch so that the
# ctest is quick; the sizes are checked against the .ktg below.
SIZES = dict(B=2, T=64, VOCAB=257, H=128, HQ=4, HKV=2, D=32, E=32, TOPK=2, INTER=256, L=4)
STEPS = 20
SEED = 1
# AdamW as kt-train runs it with these flags, every setting given (kt-train clips to norm 1
# by default: off here, as in torch's loop below)
OPT = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
TRAIN_FLAGS = ["--optimizer", "adamw", "--lr", "0.001", "--beta1", "0.9", "--beta2", "0.999",
               "--weight-decay", "0", "--clip", "0", "--schedule", "constant", "--warmup", "0",
               "--seed", str(SEED)]
DATA = os.path.join(FIXTURES, "lm_text.txt")


def fail(msg):
    print("make_lm_reference.py: " + msg, file=sys.stderr)
    sys.exit(1)


def ktg_defaults():
    """The consts of examples/moe_lm.ktg, which SIZES must agree with but for B and T."""
    consts = {}
    with open(os.path.join(ROOT, "examples", "moe_lm.ktg")) as f:
        for line in f:
            parts = line.split("#")[0].split()
            if len(parts) == 4 and parts[0] == "const" and parts[2] == "=" and parts[3].isdigit():
                consts[parts[1]] = int(parts[3])
    for k, v in SIZES.items():
        if k not in ("B", "T") and consts.get(k) != v:
            fail("SIZES[%s] = %d but examples/moe_lm.ktg says %s" % (k, v, consts.get(k)))


def kt_initial_state(build, work):
    """kt-train's initial parameters and experts from the seed (--steps 0 --save)."""
    ktp = os.path.join(work, "lm.ktp")
    init = os.path.join(work, "init.safetensors")
    defs = []
    for k, v in SIZES.items():
        defs += ["-D", "%s=%d" % (k, v)]
    subprocess.run([os.path.join(build, "tools", "kt-graphc"),
                    os.path.join(ROOT, "examples", "moe_lm.ktg"), "-o", ktp] + defs, check=True)
    subprocess.run([os.path.join(build, "tools", "kt-train"), ktp, "--data", DATA,
                    "--data-format", "u8", "--steps", "0", "--save", init] + TRAIN_FLAGS,
                   check=True)
    return init


def hf_model(init, work):
    """Qwen3MoeForCausalLM with the config of examples/moe_lm.ktg and kt-train's weights."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    s = SIZES
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=s["VOCAB"], hidden_size=s["H"], num_attention_heads=s["HQ"],
        num_key_value_heads=s["HKV"], head_dim=s["D"], num_hidden_layers=s["L"],
        num_experts=s["E"], num_experts_per_tok=s["TOPK"], moe_intermediate_size=s["INTER"],
        intermediate_size=4 * s["H"], decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=False, router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4 * s["T"], tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, pad_token_id=None,
        bos_token_id=None, eos_token_id=None)
    # only the model's tensors: the file also holds the optimizer state
    state = {k: v.float() for k, v in load_file(init).items()
             if k.startswith("model.") or k.startswith("lm_head.")}
    hf_dir = os.path.join(work, "hf")
    os.makedirs(hf_dir)
    cfg.save_pretrained(hf_dir)
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager")
    # every tensor came from kt-train's file, none from transformers' initialisation
    n_file = sum(v.numel() for v in state.values())
    n_model = sum(p.numel() for p in model.parameters())
    if n_file != n_model:
        fail("kt-train's file holds %d values, the transformers model %d" % (n_file, n_model))
    return cfg, model.train()


def hf_losses(model):
    import torch
    data = open(DATA, "rb").read()
    n = SIZES["B"] * SIZES["T"]
    if len(data) < STEPS * n + 1:
        fail("%s has %d bytes, %d steps need %d" % (DATA, len(data), STEPS, STEPS * n + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=OPT["lr"], betas=OPT["betas"],
                            eps=OPT["eps"], weight_decay=OPT["weight_decay"])
    losses = []
    for step in range(STEPS):
        # kt-train's step s reads the flat file's tokens s*n .. s*n+n (inputs) and one on
        window = torch.tensor(list(data[step * n:step * n + n + 1]), dtype=torch.long)
        ids = window[:n].view(SIZES["B"], SIZES["T"])
        targets = window[1:]
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(n, -1), targets)
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="the build directory with tools/kt-graphc and tools/kt-train")
    ap.add_argument("--out", default=os.path.join(FIXTURES, "lm_losses.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    ktg_defaults()
    with tempfile.TemporaryDirectory() as work:
        init = kt_initial_state(os.path.abspath(args.build), work)
        cfg, model = hf_model(init, work)
        losses = hf_losses(model)
    sha = hashlib.sha256(open(DATA, "rb").read()).hexdigest()
    fixture = {
        "what": "transformers' Qwen3MoeForCausalLM trained from kt-train's initial state",
        "ktg": "examples/moe_lm.ktg",
        "sizes": SIZES,
        "steps": STEPS,
        "kt_train_flags": TRAIN_FLAGS,
        "optimizer": {"kind": "torch.optim.AdamW", "lr": OPT["lr"], "betas": list(OPT["betas"]),
                      "eps": OPT["eps"], "weight_decay": OPT["weight_decay"],
                      "clipping": None, "schedule": "constant"},
        "data": os.path.relpath(DATA, ROOT),
        "data_sha256": sha,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "losses": losses,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print("wrote %s: losses %.6f .. %.6f" % (args.out, losses[0], losses[-1]))


if __name__ == "__main__":
    main()
