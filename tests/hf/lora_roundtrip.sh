#!/usr/bin/env bash
# A LoRA fine-tune end to end, as a user runs it: kt-import a fixture's checkpoint with
# adapters, kt-train a few steps (attention adapters in the graph, the routed experts' in the
# MoE layers), kt-run the trained run for its logits, kt-export the adapters for PEFT, and
# check that transformers + PEFT loading them computes libkt's logits (and that the trained
# adapters moved them away from the base model's, so the check can fail).
#
# usage: lora_roundtrip.sh FIXTURE_DIR WORKDIR KT_IMPORT KT_TRAIN KT_RUN KT_EXPORT CMAKE_PYTHON
# Exit 77 (skipped) when no Python with torch, transformers and peft is found.
set -uo pipefail
fixture=$1 work=$2 import=$3 train=$4 run=$5 export=$6 cmake_py=$7
here=$(cd "$(dirname "$0")" && pwd)
ref=$fixture/reference.safetensors
rm -rf "$work" && mkdir -p "$work" || exit 1
fail() { echo "FAIL: $*" >&2; exit 1; }

# training text: lowercase letters and spaces, ids below every fixture's vocabulary (128)
printf 'the quick brown fox jumps over the lazy dog while the experts learn %s\n' \
  $(seq 1 400) | tr -cd 'a-z \n' > "$work/text.txt"

lora=(--lora-rank 4 --lora-alpha 8)
"$import" "$fixture" -o "$work/model" --batch 2 --seq 8 "${lora[@]}" || fail "kt-import"
"$train" "$work/model/model.ktp" --params "$fixture" --data "$work/text.txt" --data-format u8 \
  --steps 6 --lr 0.02 --moe-mode lora "${lora[@]}" --threads 2 \
  --losses "$work/losses.txt" --save "$work/run.safetensors" || fail "kt-train"
"$run" "$work/model/model.ktp" --params "$work/run.safetensors" --inputs "$ref" \
  --out "$work/libkt.safetensors" --moe-mode lora "${lora[@]}" --allow-unused --threads 2 \
  2> "$work/run.log" || { cat "$work/run.log" >&2; fail "kt-run"; }
"$export" "$work/run.safetensors" --import "$work/model/import.json" --peft "$work/peft" ||
  fail "kt-export --peft"

py=""
for p in "${KT_HF_PYTHON:-}" "$cmake_py" python3; do
  [ -n "$p" ] && command -v "$p" > /dev/null 2>&1 &&
    "$p" -c "import torch, transformers, peft, safetensors" > /dev/null 2>&1 && { py=$p; break; }
done
if [ -z "$py" ]; then
  echo "skipped: the libkt half ran (import, train, run, export); the PEFT check needs a" \
       "Python with torch, transformers and peft (set KT_HF_PYTHON)"
  exit 77
fi
"$py" "$here/check_peft.py" "$fixture" "$work/peft" "$work/libkt.safetensors" --inputs "$ref" \
  --tol 1e-5 || fail "PEFT's logits are not libkt's"
# the base model alone must differ: otherwise the adapters did nothing and the check proves nothing
if "$py" "$here/check_hf.py" "$fixture" "$work/libkt.safetensors" --inputs "$ref" --tol 1e-3 \
     > "$work/base.log" 2>&1; then
  cat "$work/base.log"; fail "the trained adapters left the logits as the base model's"
fi
grep -q MISMATCH "$work/base.log" || { cat "$work/base.log"; fail "the base model check did not run"; }
echo "ok: PEFT on libkt's exported adapters gives libkt's logits; the base model's differ"
