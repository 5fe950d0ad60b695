#!/usr/bin/env python3
"""A stand-in for train_torch_peer.py (no torch needed): checks the arguments kt-bench train
passes, then answers as the peer does, with figures the test knows. FAKE_TRAIN_PEER=77 makes
it exit as the peer does without torch."""
import json
import os
import sys

if os.environ.get("FAKE_TRAIN_PEER") == "77":
    print(json.dumps({"error": "torch or transformers missing: stand-in"}))
    sys.exit(77)
args = sys.argv[1:]
opts = dict(zip(args[::2], args[1::2]))
for k in ("--config", "--threads", "--batch", "--seq", "--steps", "--warmup", "--experts-impl"):
    if k not in opts:
        sys.exit(f"fake peer: no {k} in {args}")
if opts["--config"] == "main":
    for k in ("--vocab", "--hidden", "--heads", "--kv-heads", "--head-dim", "--experts",
              "--top-k", "--inter", "--layers", "--aux-coef"):
        if k not in opts:
            sys.exit(f"fake peer: main without {k}")
    if os.environ.get("FAKE_TRAIN_PEER_ARGS"):  # for the test to compare with the model's
        with open(os.environ["FAKE_TRAIN_PEER_ARGS"], "w") as f:
            json.dump(opts, f)
elif not os.path.isfile(os.path.join(opts.get("--model", ""), "config.json")):
    sys.exit(f"fake peer: lora without a checkpoint: {args}")
print("a line that is not the result")
print(json.dumps({"tokens_per_s": 100.0, "step_ms": 10.0, "peak_rss_bytes": 1,
                  "trainable_params": 5, "losses": [1.0, 2.0]}))
