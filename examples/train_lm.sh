#!/usr/bin/env bash
# The main job: trains a small Qwen3-MoE-style language model (examples/moe_lm.ktg: 13M
# parameters, attention with RoPE and q/k norms, a CPU MoE layer per block) on text every
# machine has (this repository's README.md and docs/*.md, and Debian's
# /usr/share/common-licenses), read as bytes; prints the held-out loss against the unigram
# baseline, and a sample of what the model writes.
#
# usage: examples/train_lm.sh [BUILD_DIR] [STEPS]
#   BUILD_DIR  where the tools were built (default: build)
#   STEPS      optimizer steps (default 400: about 4 minutes on 2 quiet cores); a few (< 20) is
#              the quick check ctest runs: the same pipeline, a smaller held-out evaluation
# Output goes to BUILD_DIR/lm/: the prepared data (data/), the run directory (run/:
# metrics.jsonl, loss.svg, checkpoints) and the trained model, lm.safetensors.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build} steps=${2:-400}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
case "$steps" in '' | *[!0-9]* | 0*) echo "train_lm.sh: STEPS must be a positive number, not '$steps'" >&2; exit 2 ;; esac
for tool in kt-data kt-graphc kt-train; do
  [ -x "$build/tools/$tool" ] || { echo "train_lm.sh: $build/tools/$tool is missing (build first)" >&2; exit 1; }
done
out="$build/lm"
mkdir -p "$out"

# The text: files as documents, so that a held-out document is text the model never saw.
# Only regular files: Debian's GPL, LGPL and GFDL are links to a version also there.
bash "$root/examples/lm_data.sh" "$build/tools/kt-data" "$out/data"

"$build/tools/kt-graphc" "$root/examples/moe_lm.ktg" -o "$out/moe_lm.ktp"
rm -rf "$out/run" # a fresh run each time (kt-train --resume "$out/run" would continue one)
quick=()
if [ "$steps" -lt 20 ]; then quick=(--eval-windows 2); fi
# AdamW at 3e-3, a warm-up, then a cosine down to a tenth; gradients clipped to norm 1 (the
# default); the held-out loss every 150 steps and at the end, against the unigram baseline
"$build/tools/kt-train" "$out/moe_lm.ktp" --data "$out/data/train.safetensors" \
  --eval-data "$out/data/heldout.safetensors" --eval-every 150 "${quick[@]}" \
  --steps "$steps" --lr 3e-3 --schedule cosine --warmup 20 --min-lr 3e-4 \
  --log-every 25 --run-dir "$out/run" --save "$out/lm.safetensors"

# a sample, when kt-generate is built
if [ -x "$build/tools/kt-generate" ]; then
  # the context is the 64 positions the model trained on (moe_lm.ktg's T)
  # its speed lines (stderr) after the sample, not inside it
  sample=$("$build/tools/kt-generate" "$root/examples/moe_lm_decode.ktg" -D C=64 \
    --params "$out/lm.safetensors" --prompt "The " --max-new 60 --temperature 0.8 \
    --top-k 40 --seed 1 --eos 256 2> "$out/generate.log") ||
    { cat "$out/generate.log" >&2; exit 1; }
  echo "a sample (kt-generate, temperature 0.8, top-k 40, the prompt 'The ' and what follows):"
  printf '  The %s\n' "$sample"
  cat "$out/generate.log"
else
  echo "(no sample: $build/tools/kt-generate is not built)"
fi
echo "the run: $out/run (metrics.jsonl, loss.svg, checkpoints); the model: $out/lm.safetensors"
