#!/usr/bin/env bash
# kt-run on a program with moe ops (tests/run/moe_hf.ktg: i64 input_ids and labels, a dense
# layer 0 and a routed MoE at layer 1 whose experts are named as Hugging Face names them):
# the experts come from --params by name, and the output file holds the logits, the loss and,
# with --backward, "grad.<name>" for every parameter and every expert weight (full mode) or
# LoRA adapter (lora mode), bitwise what a session of the fixture's own computes through the
# C API. Then the bad checkpoints: a missing, misshapen or extra expert tensor, no experts,
# no adapters, a contradicting --moe-inter: exit 1 naming the file and the tensor.
#
# With KT_TRAIN: kt-train starts from that checkpoint (hf names, no libkt metadata), trains
# LoRA adapters of rank 4, alpha 8 (--lora-rank, --lora-alpha), saves them under the same
# names, and kt-run reads its save back.
#
# usage: test_kt_run_moe.sh KT_RUN KT_GRAPHC MOE_FIXTURE SOURCE_DIR WORKDIR [KT_TRAIN]
set -uo pipefail
run=$1 graphc=$2 fixture=$3 src=$4 dir=$5 train=${6:-}
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
[ -n "$names" ] || fail "cannot list the tensor names of full_backward.safetensors"
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
# (runner=TOOL expect_error ...: another tool than kt-run)
expect_error() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "${runner:-$run}" "$@" > "$dir/$name.out" 2> "$dir/$name.err"
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

# kt-train from the checkpoint, LoRA rank 4 alpha 8, saved under the ops' names
if [ -n "$train" ]; then
  python3 -c 'import sys; sys.stdout.buffer.write(bytes((i * 7 + i // 5) % 11 for i in range(400)))' \
    > "$dir/tokens.bin"
  tr=("$dir/model.ktp" --data "$dir/tokens.bin" --data-format u8 --input-tokens input_ids
      --input-targets labels --threads 2 --moe-mode lora --lora-rank 4 --lora-alpha 8)
  if "$train" "${tr[@]}" --steps 3 --params "$dir/params.safetensors" \
       --save "$dir/trained.safetensors" > "$dir/train.log" 2>&1; then
    grep -q "r=4 alpha=8" "$dir/train.log" || fail "kt-train's summary: $(cat "$dir/train.log")"
    shape=$(python3 - "$dir/trained.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
h = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])
print(h["model.layers.1.mlp.experts.3.up_proj.lora_A.weight"]["shape"],
      h["model.layers.1.mlp.experts.3.up_proj.lora_B.weight"]["shape"],
      "model.layers.1.mlp.experts.3.up_proj.weight" in h, h["__metadata__"]["kt.moe_layers"])
PY
)
    [ "$shape" = "[4, 16] [24, 4] True 1" ] || fail "kt-train's save: adapters and experts: $shape"
    # resuming (optimizer state too) and kt-run on the save, with the same rank and alpha
    "$train" "${tr[@]}" --steps 1 --params "$dir/trained.safetensors" > "$dir/resume.log" 2>&1 ||
      fail "kt-train from its save: $(cat "$dir/resume.log")"
    "$run" "$dir/model.ktp" "${common[@]}" --params "$dir/trained.safetensors" --moe-mode lora \
      --lora-rank 4 --lora-alpha 8 --backward --out "$dir/trained_out.safetensors" \
      2> "$dir/trained_run.err" || fail "kt-run on kt-train's save: $(cat "$dir/trained_run.err")"
    expect_error train_rank 1 "lora_A\.weight' is f32\[4,16\], the layer needs f32\[8,16\]" \
      "$dir/model.ktp" "${common[@]}" --params "$dir/trained.safetensors" --moe-mode lora \
      --out "$dir/bad.safetensors"
    echo "ok: kt-train --lora-rank 4 --lora-alpha 8 from the checkpoint, saved and read back"
  else
    fail "kt-train from the checkpoint: $(cat "$dir/train.log")"
  fi
  runner=$train expect_error train_inter 1 \
    "--moe-inter 32: moe node 'm' is written for experts of intermediate size 24" \
    "${tr[@]}" --steps 1 --moe-inter 32
  runner=$train expect_error train_experts_twice 1 "params\.safetensors holds the experts already" \
    "${tr[@]}" --steps 1 --params "$dir/params.safetensors" --experts "$dir/params_lora.safetensors"
  runner=$train expect_error train_lora_rank 2 "--lora-rank needs a whole number" \
    "${tr[@]}" --steps 1 --lora-rank 0
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "kt-run on moe programs: all checks passed"
