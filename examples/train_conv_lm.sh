#!/usr/bin/env bash
# The second example: trains the context-parallel conv-MoE language model (examples/lm.ktg:
# embedding, causal-conv blocks with a CPU MoE each, next-token cross-entropy) on this
# repository's own text, read as bytes, with kt-train, on one rank or several; prints the
# loss as it falls and saves the trained parameters. (The main job, a transformer MoE, is
# examples/train_lm.sh.)
#
# usage: examples/train_conv_lm.sh [BUILD_DIR] [STEPS] [RANKS]
#   BUILD_DIR  where kt-graphc/kt-train were built (default: build)
#   STEPS      optimizer steps (default 200: 15-25 s on 2 cores)
#   RANKS      1 (default), or context-parallel over that many local ranks with kt-launch
#              (the 256-token window split along the sequence; needs the UCX build)
# Output goes to BUILD_DIR/conv_lm/: the program, the text, losses.txt and lm.safetensors (the
# parameters, the experts and the optimizer state, one file).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build} steps=${2:-200} ranks=${3:-1}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
out="$build/conv_lm"
mkdir -p "$out"
tokens=256
if [ $((tokens % ranks)) -ne 0 ]; then
  echo "train_conv_lm.sh: $ranks ranks do not divide the $tokens-token window" >&2
  exit 2
fi

# the model, compiled for one rank's slice of the window
"$build/tools/kt-graphc" "$root/examples/lm.ktg" -o "$out/lm.ktp" -D T=$((tokens / ranks))
# the data: the repository's documentation and model files, as bytes (vocabulary 512 > 256)
cat "$root"/README.md "$root"/docs/*.md "$root"/examples/*.ktg > "$out/text.bin"
echo "training on $(wc -c < "$out/text.bin") bytes of text, $steps steps, $ranks rank(s)"

train=("$build/tools/kt-train" "$out/lm.ktp" --data "$out/text.bin" --data-format u8
       --steps "$steps" --log-every 20 --losses "$out/losses.txt" --save "$out/lm.safetensors")
if [ "$ranks" -gt 1 ]; then
  "$build/tools/kt-launch" -n "$ranks" -- "${train[@]}"
else
  "${train[@]}"
fi
# one step's loss depends on its window of text (a table of numbers is harder than prose), so
# the end is the mean of the last 20 steps
first=$(head -1 "$out/losses.txt")
tail20=$(tail -20 "$out/losses.txt" | awk '{ s += $1 } END { if (NR) printf "%.4f over %d steps", s / NR, NR }')
echo "loss: first step $first, mean of the last ones $tail20 (a model that knew nothing: ln 512 = 6.24)"
