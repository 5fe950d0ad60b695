#!/usr/bin/env python3
"""The main job's model trains as transformers does: kt-train's first 20 losses on
examples/moe_lm.ktg equal those of transformers' Qwen3MoeForCausalLM (with torch's AdamW)
from the same initial weights on the same windows, within 1e-4 relative (f32).

The losses come from tests/train/fixtures/lm_losses.json (tests/train/make_lm_reference.py
wrote it; no torch is needed here). kt-train draws the same initial weights from the seed the
fixture names, so the fixture holds no weights. The layer sizes are the main job's (the .ktg's
defaults, checked below); the batch is smaller, as the fixture says.

usage: lm_reference_test.py KT_GRAPHC KT_TRAIN WORKDIR
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "train", "fixtures", "lm_losses.json")
TOLERANCE = 1e-4


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def ktg_consts(path):
    consts = {}
    with open(path) as f:
        for line in f:
            parts = line.split("#")[0].split()
            if len(parts) == 4 and parts[0] == "const" and parts[2] == "=" and parts[3].isdigit():
                consts[parts[1]] = int(parts[3])
    return consts


def main():
    if len(sys.argv) != 4:
        print(__doc__.strip().split("\n")[-1], file=sys.stderr)
        sys.exit(2)
    graphc, train, work = sys.argv[1:]
    if not os.path.isfile(FIXTURE):
        fail("the fixture %s is missing (tests/train/make_lm_reference.py writes it)" % FIXTURE)
    with open(FIXTURE) as f:
        fx = json.load(f)
    sizes, steps, ref = fx["sizes"], fx["steps"], fx["losses"]
    if len(ref) != steps or steps < 20:
        fail("the fixture holds %d losses for %d steps (want 20 or more)" % (len(ref), steps))

    # the fixture must be of the main job's model as it is now
    ktg = os.path.join(ROOT, fx["ktg"])
    consts = ktg_consts(ktg)
    for k, v in sizes.items():
        if k not in ("B", "T") and consts.get(k) != v:
            fail("%s says %s = %s, the fixture was made with %d: rerun "
                 "tests/train/make_lm_reference.py" % (fx["ktg"], k, consts.get(k), v))
    data = os.path.join(ROOT, fx["data"])
    with open(data, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if sha != fx["data_sha256"]:
        fail("%s changed since the fixture was made (SHA-256 %s, want %s)"
             % (fx["data"], sha, fx["data_sha256"]))

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ktp = os.path.join(work, "lm.ktp")
    losses = os.path.join(work, "losses.txt")
    defs = []
    for k, v in sizes.items():
        defs += ["-D", "%s=%d" % (k, v)]
    subprocess.run([graphc, ktg, "-o", ktp] + defs, check=True)
    subprocess.run([train, ktp, "--data", data, "--data-format", "u8", "--steps", str(steps),
                    "--log-every", "5", "--losses", losses] + fx["kt_train_flags"], check=True)
    with open(losses) as f:
        got = [float(x) for x in f.read().split()]
    if len(got) != steps:
        fail("kt-train wrote %d losses, want %d" % (len(got), steps))
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, ref)):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        flag = "" if rel <= TOLERANCE else "  <- off"
        print("step %2d  kt-train %.7f  transformers %.7f  rel %.1e%s" % (i + 1, a, b, rel, flag))
    if not worst <= TOLERANCE:
        fail("kt-train's losses differ from transformers' by up to %.2e relative (want %g)"
             % (worst, TOLERANCE))
    print("ok: %d losses within %.1e relative of transformers' (worst %.1e)"
          % (steps, TOLERANCE, worst))


if __name__ == "__main__":
    main()
