#!/usr/bin/env bash
# LoRA fine-tuning with quantized frozen experts against bf16 ones, on the main job's model
# (examples/moe_lm.ktg) and data: a base model is trained first (full, f32 experts), then
# fine-tuned with LoRA from it twice, once with its experts in bf16 and once quantized
# (--moe-dtype int4 by default), the same steps, data and seed; the held-out losses are
# printed and compared (exit 1 when the quantized run's is more than 2% above the bf16 run's).
#   bash examples/finetune_quant.sh [BUILD] [BASE_STEPS] [FINETUNE_STEPS] [DTYPE]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build} base_steps=${2:-300} steps=${3:-100} dtype=${4:-int4}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
for n in "$base_steps" "$steps"; do
  case "$n" in '' | *[!0-9]* | 0*) echo "finetune_quant.sh: step counts must be positive numbers, not '$n'" >&2; exit 2 ;; esac
done
case "$dtype" in int8 | int4) ;; *) echo "finetune_quant.sh: DTYPE is int8 or int4, not '$dtype'" >&2; exit 2 ;; esac
for tool in kt-data kt-graphc kt-train; do
  [ -x "$build/tools/$tool" ] || { echo "finetune_quant.sh: $build/tools/$tool is missing (build first)" >&2; exit 1; }
done
out="$build/finetune_quant"
mkdir -p "$out"
bash "$root/examples/lm_data.sh" "$build/tools/kt-data" "$out/data" > /dev/null
"$build/tools/kt-graphc" "$root/examples/moe_lm.ktg" -o "$out/moe_lm.ktp" > /dev/null
data=(--data "$out/data/train.safetensors" --eval-data "$out/data/heldout.safetensors")

echo "base model: $base_steps steps, full training, f32 experts"
"$build/tools/kt-train" "$out/moe_lm.ktp" "${data[@]}" --steps "$base_steps" --lr 3e-3 \
  --schedule cosine --warmup 20 --min-lr 3e-4 --log-every 100 --eval-every "$base_steps" \
  --save "$out/base.safetensors" > "$out/base.log"
grep "held-out loss" "$out/base.log" | tail -1

heldout() { sed -n 's/^held-out loss \([0-9.]*\) .*/\1/p' "$1" | tail -1; }
for d in bf16 "$dtype"; do
  echo "LoRA fine-tune, $d experts: $steps steps"
  "$build/tools/kt-train" "$out/moe_lm.ktp" "${data[@]}" --params "$out/base.safetensors" \
    --moe-dtype "$d" --moe-mode lora --steps "$steps" --lr 3e-4 --seed 7 --log-every 50 \
    --eval-every "$steps" > "$out/lora_$d.log"
  grep "MoE layer\|held-out loss" "$out/lora_$d.log" | tail -2
done
a=$(heldout "$out/lora_bf16.log") b=$(heldout "$out/lora_$dtype.log")
awk -v a="$a" -v b="$b" -v d="$dtype" 'BEGIN {
  r = b / a
  printf "held-out loss: bf16 experts %.4f, %s experts %.4f: %.4f of bf16'"'"'s (at most 1.02)\n", a, d, b, r
  exit r <= 1.02 ? 0 : 1 }'
