#!/usr/bin/env bash
# An example model trains: kt-graphc compiles it, kt-train runs STEPS AdamW steps on this
# repository's documentation read as bytes, and the loss falls: the mean of the last five
# steps' losses is below FRACTION of the first step's (one step's loss depends on its window
# of text, so the end is a mean, not one step).
#
# usage: example_trains.sh KT_GRAPHC KT_TRAIN MODEL.ktg WORKDIR STEPS FRACTION [kt-train option...]
set -uo pipefail
graphc=$1 train=$2 model=$3 work=$4 steps=$5 fraction=$6
shift 6
src=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work" || exit 1
"$graphc" "$model" -o "$work/model.ktp" || { echo "FAIL: $model does not compile"; exit 1; }
cat "$src"/README.md "$src"/docs/*.md > "$work/text.bin"
"$train" "$work/model.ktp" --data "$work/text.bin" --data-format u8 --steps "$steps" \
  --log-every 5 --losses "$work/losses.txt" --threads 1 "$@" ||
  { echo "FAIL: kt-train exited $?"; exit 1; }
n=$(wc -l < "$work/losses.txt")
[ "$n" -eq "$steps" ] || { echo "FAIL: $n losses, want $steps"; exit 1; }
awk -v f="$fraction" 'NR == 1 { first = $1 } { v[NR] = $1 }
  END {
    for (i = NR - 4; i <= NR; i++) last += v[i] / 5
    printf "loss: first step %.4f, mean of the last five %.4f (want below %.4f)\n", first, last, f * first
    exit !(first == first && last == last && last < f * first)
  }' "$work/losses.txt" || { echo "FAIL: the loss did not fall"; exit 1; }
echo "ok: $(basename "$model") trains"
