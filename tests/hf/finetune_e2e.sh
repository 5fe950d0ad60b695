#!/usr/bin/env bash
# The fine-tuning path end to end, as docs/training.md tells a user to run it: kt-data turns
# prompt/response JSON lines into a prepared file with a tokenizer.json that fits the fixture's
# vocabulary (a small BPE trained here), kt-import imports the tiny transformers checkpoint
# with LoRA, kt-train fine-tunes on the prepared file, kt-export writes the PEFT adapter.
# Checked:
#   - the loss falls (the mean of the last 5 steps below 0.8x the first 5)
#   - the prompt tokens are masked: kt-train's loss on the first window with the trained
#     parameters equals kt-run's loss with labels built here from the file (-100 on prompt
#     tokens and document starts) within 1e-5, and differs from the loss with every label
#     counted; with torch, transformers and peft, PEFT's loss with those labels on the
#     exported adapter equals it too (1e-4)
# The fixture's vocabulary (128) is below bytes mode's 256, so there is no bytes variant:
# without `tokenizers` the test is skipped (exit 77), saying so.
#
# usage: finetune_e2e.sh FIXTURE_DIR WORKDIR KT_DATA KT_IMPORT KT_TRAIN KT_RUN KT_EXPORT [PYTHON]
set -uo pipefail
fixture=$1 work=$2 data=$3 import=$4 train=$5 run=$6 export=$7 cmake_py=${8:-}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*" >&2; exit 1; }

py="" torch_py=""
for p in "${KT_HF_PYTHON:-}" "$cmake_py" /work/venv-torch/bin/python python3; do
  [ -n "$p" ] && command -v "$p" > /dev/null 2>&1 || continue
  [ -z "$py" ] && "$p" -c "import tokenizers, numpy, safetensors" 2> /dev/null && py=$p
  [ -z "$torch_py" ] && "$p" -c "import tokenizers, torch, transformers, peft" 2> /dev/null &&
    torch_py=$p
done
if [ -z "$py" ]; then
  echo "skipped: kt-data's tokenizer path needs a Python with tokenizers, numpy and" \
       "safetensors (set KT_HF_PYTHON); the fixture's vocabulary (128) leaves no bytes variant"
  exit 77
fi
vocab=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
  "$fixture/config.json")

# prompt/response pairs: sums written out, the answer the response
for a in 1 2 3 4 5 6 7; do
  for b in 1 2 3 4 5 6 7 8; do
    printf '{"prompt": "what is %d plus %d? answer:", "response": " %d"}\n' "$a" "$b" $((a + b))
  done
done > pairs.jsonl
"$py" "$here/finetune_check.py" tokenizer tok.json "$vocab" pairs.jsonl || fail "the tokenizer"
"$py" "$data" pairs.jsonl -o prep --tokenizer tok.json --heldout-fraction 0.1 > data.log 2>&1 ||
  fail "kt-data: $(cat data.log)"
grep -q "masked)" data.log && cat data.log || fail "kt-data's summary: $(cat data.log)"

B=2 S=16
lora=(--lora-rank 4 --lora-alpha 8)
"$import" "$fixture" -o model --batch $B --seq $S "${lora[@]}" > import.log 2>&1 ||
  fail "kt-import: $(cat import.log)"
common=(--data prep/train.safetensors --allow-cross-document --moe-mode lora "${lora[@]}"
        --threads 2)
"$train" model/model.ktp --params "$fixture" "${common[@]}" --steps 40 --lr 0.02 \
  --log-every 40 --losses losses.txt --save run.safetensors > train.log 2>&1 ||
  fail "kt-train: $(cat train.log)"
read -r first last < <(awk '{ l[NR] = $1 } END {
  for (i = 1; i <= 5; i++) { f += l[i]; t += l[NR - 5 + i] } print f / 5, t / 5 }' losses.txt)
awk -v f="$first" -v t="$last" 'BEGIN { exit !(t < 0.8 * f) }' ||
  fail "the loss did not fall: the first 5 steps' mean $first, the last 5's $last"
echo "ok: 40 LoRA steps on the prepared pairs: mean loss $first -> $last"

# the first window again, with the trained parameters: kt-train's loss (step 1 reads window 0)
"$train" model/model.ktp --params run.safetensors "${common[@]}" --steps 1 --lr 1e-9 \
  --losses one.txt > one.log 2>&1 || fail "kt-train on the trained run: $(cat one.log)"
fed=$(cat one.txt)
"$py" "$here/finetune_check.py" window prep/train.safetensors $B $S window.safetensors \
  > window.log || fail "the window"
# kt-run on the same window: with the labels built here, and with every label counted
"$py" - window.safetensors <<'EOF' || fail "splitting the window"
import sys
from safetensors.numpy import load_file, save_file
w = load_file(sys.argv[1])
save_file({"input_ids": w["input_ids"], "labels": w["labels"]}, "masked.safetensors")
save_file({"input_ids": w["input_ids"], "labels": w["labels_all"]}, "all.safetensors")
EOF
for k in masked all; do
  "$run" model/model.ktp --params run.safetensors --inputs $k.safetensors --out run_$k.safetensors \
    --backward --moe-mode lora "${lora[@]}" --allow-unused --threads 2 > run_$k.log 2>&1 ||
    fail "kt-run ($k): $(cat run_$k.log)"
done
loss_of() { "$py" -c "from safetensors.numpy import load_file; import sys; \
  print('%.9g' % float(load_file(sys.argv[1])['loss'].reshape(-1)[0]))" "$1"; }
masked=$(loss_of run_masked.safetensors) all=$(loss_of run_all.safetensors)
awk -v a="$fed" -v b="$masked" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }' ||
  fail "kt-train's loss on window 0 ($fed) is not kt-run's with the prompt masked ($masked)"
awk -v a="$masked" -v b="$all" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d > 1e-3 * a) }' ||
  fail "masking the prompt did not change the loss ($masked vs $all): the check proves nothing"
echo "ok: kt-train fed the masked labels ($(cat window.log)): loss $fed = kt-run's $masked;" \
     "every label counted: $all"

"$export" run.safetensors --import model/import.json --peft peft > export.log 2>&1 ||
  fail "kt-export --peft: $(cat export.log)"
if [ -z "$torch_py" ]; then
  echo "skipped: the PEFT loss check needs a Python with torch, transformers and peft" \
       "(set KT_HF_PYTHON); the libkt half ran"
  exit 77
fi
hf=$(PYTHONWARNINGS=ignore "$torch_py" "$here/finetune_check.py" peft-loss "$fixture" peft \
  window.safetensors labels) ||
  fail "transformers + PEFT"
awk -v a="$hf" -v b="$masked" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * b) }' ||
  fail "PEFT's loss on the exported adapter ($hf) is not libkt's ($masked)"
echo "ok: transformers + PEFT on the exported adapter, the same labels: loss $hf"
