#!/usr/bin/env bash
# kt-run on a program with moe ops (tests/run/moe_hf.ktg: i64 input_ids and labels, a dense
# layer 0 and a routed MoE at layer 1 whose experts are named as Hugging Face names them):
# the experts come from --params by name, and the output file holds the logits, the loss and,
# with --backward, "grad.<name>" for every parameter and every expert weight (full mode) or
# LoRA adapter (lora mode), bitwise what a session of the fixture's own computes through the
# C API. Then the bad checkpoints: a missing, misshapen or extra expert tensor, no experts,
# no adapters, a contradicting --moe-inter: exit 1 naming the file and the tensor.
#
# usage: test_kt_run_moe.sh KT_RUN KT_GRAPHC MOE_FIXTURE SOURCE_DIR WORKDIR
set -uo pipefail
run=$1 graphc=$2 fixture=$3 src=$4 dir=$5
rm -rf "$dir" && mkdir -p "$dir" || exit 1
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

"$graphc" "$src/tests/run/moe_hf.ktg" -o "$dir/model.ktp" > /dev/null ||
  { echo "FAIL: moe_hf.ktg does not compile" >&2; exit 1; }
"$fixture" write "$dir/model.ktp" "$dir" || { echo "FAIL: the fixture" >&2; exit 1; }
common=(--inputs "$dir/inputs.safetensors" --threads 2)

# run NAME MODE [backward] kt-run-arguments...: kt-run, then the fixture's bitwise check
run_check() {
  local name=$1 mode=$2 bwd=$3
  shift 3
  local flags=()
  [ "$bwd" = backward ] && flags=(--backward)
  if "$run" "$dir/model.ktp" "${common[@]}" --moe-mode "$mode" "${flags[@]}" \
       --out "$dir/$name.safetensors" "$@" 2> "$dir/$name.err"; then
    if "$fixture" check "$dir/model.ktp" "$dir/$name.safetensors" "$mode" 2 $bwd; then
      echo "ok: $name"
    else
      fail "$name: the output differs from the C API's"
    fi
  else
    fail "$name: kt-run exited $?: $(cat "$dir/$name.err")"
  fi
}
run_check full_forward full - --params "$dir/params.safetensors"
run_check full_backward full backward --params "$dir/params.safetensors"
run_check lora_backward lora backward --params "$dir/params_lora.safetensors"
run_check frozen_backward frozen backward --params "$dir/params.safetensors"
# the intermediate size the program says, given again: fine
run_check full_inter full backward --params "$dir/params.safetensors" --moe-inter 24

# the names a transformers script compares against
names=$(python3 - "$dir/full_backward.safetensors" <<'PY' 2>/dev/null
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
print("\n".join(sorted(k for k in json.loads(b[8:8 + n]) if k != "__metadata__")))
PY
)
if [ -n "$names" ]; then
  for want in grad.model.layers.1.mlp.experts.3.up_proj.weight \
              grad.model.layers.1.mlp.experts.0.down_proj.weight \
              grad.model.layers.0.mlp.gate_proj.weight grad.model.embed_tokens.weight \
              grad.model.layers.1.mlp.gate.weight logits loss; do
    grep -qx "$want" <<< "$names" || fail "full_backward.safetensors has no '$want'"
  done
  echo "ok: $(grep -c . <<< "$names") tensor names, e.g. grad.model.layers.1.mlp.experts.3.up_proj.weight"
fi

# expect_error NAME STATUS PATTERN kt-run-arguments...: exits STATUS, stderr matches PATTERN
expect_error() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "$run" "$@" > "$dir/$name.out" 2> "$dir/$name.err"
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    fail "$name: exit status $rc, expected $want: $(cat "$dir/$name.err")"
  elif ! grep -q -E -e "$pattern" "$dir/$name.err"; then
    fail "$name: stderr does not match '$pattern': $(cat "$dir/$name.err")"
  else
    echo "ok: $name: $(head -n 1 "$dir/$name.err")"
  fi
}
args=("$dir/model.ktp" "${common[@]}" --backward --out "$dir/bad.safetensors")
expect_error missing_expert 1 \
  "params_missing\.safetensors.*model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight" \
  "${args[@]}" --params "$dir/params_missing.safetensors"
expect_error misshapen_expert 1 \
  "params_misshapen\.safetensors.*model\.layers\.1\.mlp\.experts\.1\.gate_proj\.weight.*f32\[24,17\]" \
  "${args[@]}" --params "$dir/params_misshapen.safetensors"
expect_error extra_expert 1 \
  "params_extra\.safetensors: tensor 'model\.layers\.1\.mlp\.experts\.4\.gate_proj\.weight' is not a parameter" \
  "${args[@]}" --params "$dir/params_extra.safetensors"
expect_error no_experts 1 \
  "params_dense\.safetensors: no tensor 'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight'.*--allow-missing" \
  "${args[@]}" --params "$dir/params_dense.safetensors"
expect_error no_adapters 1 \
  "params\.safetensors: no tensor 'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.lora_A\.weight'" \
  "${args[@]}" --params "$dir/params.safetensors" --moe-mode lora
expect_error adapters_not_lora 1 "lora_A\.weight' is not a parameter" \
  "${args[@]}" --params "$dir/params_lora.safetensors" --moe-mode full
expect_error inter_differs 1 "--moe-inter 32: moe node .* intermediate size 24" \
  "${args[@]}" --params "$dir/params.safetensors" --moe-inter 32
expect_error usage_bf16_full 2 "--moe-mode full trains f32 expert weights" \
  "${args[@]}" --params "$dir/params.safetensors" --moe-dtype bf16
expect_error usage_mode 2 "--moe-mode needs full, lora or frozen, not 'half'" \
  "${args[@]}" --moe-mode half
[ -e "$dir/bad.safetensors" ] && fail "a failed run wrote its output file"

# --allow-missing: experts from the seed, adapters as a new layer starts them
"$run" "${args[@]}" --params "$dir/params_dense.safetensors" --allow-missing \
  2> "$dir/allow.err" || fail "--allow-missing without experts: exit $?: $(cat "$dir/allow.err")"
"$run" "${args[@]}" --params "$dir/params.safetensors" --moe-mode lora --allow-missing \
  2> "$dir/allow_lora.err" || fail "--allow-missing without adapters: exit $?"
# bf16 experts from the f32 checkpoint (converted when loaded), LoRA on them
"$run" "${args[@]}" --params "$dir/params_lora.safetensors" --moe-mode lora --moe-dtype bf16 \
  2> "$dir/bf16.err" || fail "bf16 experts: exit $?: $(cat "$dir/bf16.err")"
"$run" --help | grep -q -- "--moe-mode" || fail "--help does not mention --moe-mode"

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "kt-run on moe programs: all checks passed"
