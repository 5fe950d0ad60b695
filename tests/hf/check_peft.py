#!/usr/bin/env python3
"""Load a PEFT adapter onto a transformers model and compare its logits.

usage: check_peft.py MODEL_DIR ADAPTER_DIR LOGITS.safetensors [--tol X] [--dtype D]
                     [--inputs IDS.safetensors]

MODEL_DIR: the base checkpoint (from_pretrained); ADAPTER_DIR: what
`peft.PeftModel.from_pretrained` reads (adapter_config.json +
adapter_model.safetensors, e.g. written by `kt-export --peft`);
LOGITS.safetensors: `input_ids` I64 [B,S] and `logits` F32 [B,S,V].
Exit 0 within --tol, 1 outside, 2 on a usage or load error, 77 (skip) when
torch / transformers / peft cannot be imported.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_hf  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Run peft.PeftModel.from_pretrained(from_pretrained(MODEL_DIR), "
                    "ADAPTER_DIR) on the input_ids of LOGITS.safetensors and compare "
                    "with its logits.")
    ap.add_argument("model_dir")
    ap.add_argument("adapter_dir")
    ap.add_argument("logits")
    ap.add_argument("--tol", type=float, default=1e-5,
                    help="max |diff| / max |expected| (default 1e-5)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                    help="dtype to load the base in (default float32)")
    ap.add_argument("--key", default="logits", help="tensor to compare (default logits)")
    ap.add_argument("--inputs", help="take input_ids from this file (e.g. the fixture's "
                    "reference, when LOGITS is kt-run's output)")
    args = ap.parse_args(argv)
    try:
        check_hf.import_torch()
        import peft
    except ImportError as e:
        print("check_peft: skipped: cannot import torch/transformers/peft: %s" % e)
        return check_hf.SKIP
    for d, f in ((args.model_dir, "config.json"), (args.adapter_dir, "adapter_config.json")):
        if not os.path.isfile(os.path.join(d, f)):
            print("check_peft: %s: no %s" % (d, f), file=sys.stderr)
            return 2
    try:
        base = check_hf.load_model(args.model_dir, args.dtype)
        model = peft.PeftModel.from_pretrained(base, args.adapter_dir).eval()
    except Exception as e:
        print("check_peft: %s + %s: cannot load: %s" % (args.model_dir, args.adapter_dir, e),
              file=sys.stderr)
        return 2
    return check_hf.compare(model, args.logits, args.key, args.tol, "check_peft", args.inputs)


if __name__ == "__main__":
    sys.exit(main())
