#!/usr/bin/env python3
"""Load a full checkpoint with transformers and compare its logits.

usage: check_hf.py MODEL_DIR LOGITS.safetensors [--tol X] [--dtype D] [--key K]

MODEL_DIR is what `from_pretrained` reads (config.json + safetensors, sharded
or not), e.g. written by `kt-export --hf`.  LOGITS.safetensors holds
`input_ids` I64 [B,S] and the logits to match (`logits` F32 [B,S,V], or --key).
Prints the max difference relative to the largest |expected logit|.
Exit 0 within --tol, 1 outside, 2 on a usage or load error, 77 (skip) when
torch / transformers cannot be imported.
"""
import argparse
import os
import sys

SKIP = 77


def parse(argv):
    ap = argparse.ArgumentParser(
        description="Run transformers' from_pretrained(MODEL_DIR) on the input_ids "
                    "of LOGITS.safetensors and compare with its logits.")
    ap.add_argument("model_dir")
    ap.add_argument("logits")
    ap.add_argument("--tol", type=float, default=1e-5,
                    help="max |diff| / max |expected| (default 1e-5)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                    help="dtype to load and compute in (default float32: a bf16 "
                         "checkpoint is widened exactly)")
    ap.add_argument("--key", default="logits", help="tensor to compare (default logits)")
    ap.add_argument("--inputs", help="take input_ids from this file (e.g. the fixture's "
                    "reference, when LOGITS is kt-run's output)")
    return ap.parse_args(argv)


def import_torch():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch  # noqa: F401
    import transformers
    from safetensors.torch import load_file  # noqa: F401
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def load_model(model_dir, dtype):
    import torch
    import transformers
    dt = "auto" if dtype == "auto" else getattr(torch, dtype)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dt, attn_implementation="eager",
        experts_implementation="eager")
    return m.eval()


def compare(model, logits_path, key, tol, what, inputs_path=None):
    """inputs_path: take input_ids from this file instead (kt-run's output has none)."""
    import torch
    from safetensors.torch import load_file
    ref = load_file(logits_path)
    ids_file = inputs_path or logits_path
    ids = load_file(ids_file)
    for k, d, p in (("input_ids", ids, ids_file), (key, ref, logits_path)):
        if k not in d:
            print("%s: %s: no tensor %r" % (what, p, k), file=sys.stderr)
            return 2
    with torch.no_grad():
        got = model(input_ids=ids["input_ids"]).logits.float()
    want = ref[key].float()
    if got.shape != want.shape:
        print("%s: logits shape %s, expected %s" % (what, list(got.shape), list(want.shape)),
              file=sys.stderr)
        return 1
    scale = max(float(want.abs().max()), 1e-30)
    diff = float((got - want).abs().max()) / scale
    ok = diff <= tol
    print("%s: max relative logit difference %.3g (tol %.3g): %s"
          % (what, diff, tol, "ok" if ok else "MISMATCH"))
    return 0 if ok else 1


def main(argv=None):
    args = parse(argv)
    try:
        import_torch()
    except ImportError as e:
        print("check_hf: skipped: cannot import torch/transformers: %s" % e)
        return SKIP
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print("check_hf: %s: no config.json" % args.model_dir, file=sys.stderr)
        return 2
    try:
        model = load_model(args.model_dir, args.dtype)
    except Exception as e:  # transformers raises many kinds
        print("check_hf: %s: cannot load: %s" % (args.model_dir, e), file=sys.stderr)
        return 2
    return compare(model, args.logits, args.key, args.tol, "check_hf", args.inputs)


if __name__ == "__main__":
    sys.exit(main())
