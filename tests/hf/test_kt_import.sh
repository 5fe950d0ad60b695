#!/usr/bin/env bash
# kt-import end to end: --help, usage errors (exit 2), an import of every fixture (exit 0,
# the three files), refusals (exit 1, the message naming the key or the tensor, OUT not
# created or left as it was).
#
# usage: test_kt_import.sh KT_IMPORT FIXTURES WORKDIR
set -uo pipefail
imp=$1 fixtures=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir" || exit 1
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# expect NAME STATUS PATTERN args...: exits STATUS, stderr (or stdout for 0) matches PATTERN
expect() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "$imp" "$@" > "$dir/stdout" 2> "$dir/stderr"
  local got=$?
  [ "$got" = "$want" ] || { fail "$name: exit $got, expected $want"; cat "$dir/stderr" >&2; return; }
  grep -q -- "$pattern" "$dir/stdout" "$dir/stderr" ||
    { fail "$name: output lacks '$pattern'"; cat "$dir/stderr" >&2; }
}

expect help 0 "usage: kt-import MODEL_DIR -o OUT" --help
expect no-args 2 "no model directory" 
expect no-out 2 "no output directory" "$fixtures/llama"
expect bad-option 2 "unknown option '--frobnicate'" "$fixtures/llama" -o "$dir/x" --frobnicate
expect bad-batch 2 "--batch needs a whole number" "$fixtures/llama" -o "$dir/x" --batch 0
expect bad-dtype 2 "--dtype is f32 or bf16" "$fixtures/llama" -o "$dir/x" --dtype f16
expect bf16-no-lora 2 "needs LoRA" "$fixtures/llama" -o "$dir/x" --dtype bf16
expect rank-no-alpha 2 "needs --lora-alpha" "$fixtures/llama" -o "$dir/x" --lora-rank 4
[ -e "$dir/x" ] && fail "a usage error created the output"

n=0
for arch in mixtral qwen2_moe qwen3_moe olmoe deepseek_v2 deepseek_v3 llama qwen2 qwen3; do
  [ -f "$fixtures/$arch/config.json" ] || { echo "note: no fixture $arch"; continue; }
  expect "import-$arch" 0 "imported" "$fixtures/$arch" -o "$dir/$arch" --batch 2 --seq 16
  for f in model.ktg model.ktp import.json; do
    [ -s "$dir/$arch/$f" ] || fail "import-$arch: no $f"
  done
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no fixtures in $fixtures: nothing imported" >&2; exit 1; }

if [ -f "$fixtures/qwen3_moe/config.json" ]; then
  # LoRA and aux loss are written into the description and the manifest
  expect lora 0 "imported" "$fixtures/qwen3_moe" -o "$dir/lora" --lora-rank 4 --lora-alpha 8 \
    --lora-targets q_proj,o_proj --aux-loss
  grep -q "lora_A.weight: f32\[R, H\]" "$dir/lora/model.ktg" || fail "lora: no adapter in model.ktg"
  grep -q "load_balance_loss" "$dir/lora/model.ktg" || fail "lora: no aux loss"
  grep -q '"lora_targets": \["q_proj", "o_proj"\]' "$dir/lora/import.json" || fail "lora: import.json"
  # refusals: OUT (an earlier import) stays as it was
  cp "$dir/lora/model.ktg" "$dir/before.ktg"
  mkdir -p "$dir/bad" && cp "$fixtures/qwen3_moe/model.safetensors" "$dir/bad/"
  sed 's/"silu"/"relu"/' "$fixtures/qwen3_moe/config.json" > "$dir/bad/config.json"
  expect bad-act 1 "'hidden_act' = \"relu\"" "$dir/bad" -o "$dir/lora"
  cmp -s "$dir/before.ktg" "$dir/lora/model.ktg" || fail "bad-act: the earlier import changed"
  echo '{"model_type": ' > "$dir/bad/config.json"
  expect not-json 1 "config.json: not JSON" "$dir/bad" -o "$dir/new"
  [ -e "$dir/new" ] && fail "not-json: the output was created"
  cp "$fixtures/qwen3_moe/config.json" "$dir/bad/"
  head -c 2000 "$fixtures/qwen3_moe/model.safetensors" > "$dir/bad/model.safetensors"
  expect truncated 1 "bad/model.safetensors" "$dir/bad" -o "$dir/new"
  [ -e "$dir/new" ] && fail "truncated: the output was created"
  expect deepseek-aux 1 "no load-balancing loss" "$fixtures/deepseek_v3" -o "$dir/new" --aux-loss
fi

[ "$failures" = 0 ] || { echo "$failures failure(s)" >&2; exit 1; }
echo "kt-import: all checks passed ($n architectures)"
