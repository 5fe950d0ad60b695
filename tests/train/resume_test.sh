#!/usr/bin/env bash
# kt-train's run directory, resume, evaluation and stop signals, on two small MoE models given
# as .ktg descriptions (compiled in-process with -D): examples/lm.ktg (causal conv, checkpointed
# blocks, CPU MoE) and tests/models/qwen3_moe.ktg (attention with RoPE, Hugging Face names).
# With AdamW, a cosine schedule with warm-up, --accum 2 and the MoE experts trained (or LoRA
# adapters on them):
#   - resume: 2N steps in one run equal N steps, --resume, N steps: the losses and every tensor
#     of the final checkpoint (parameters, experts, optimizer state) bit for bit; resuming a
#     run directory takes its newest checkpoint; the program may be left out (the
#     checkpoint's program.ktp), and so may every option (run.json's settings: --resume DIR
#     alone goes on as the run would have); --keep leaves the newest K
#   - quantized experts (--moe-dtype int4, LoRA): resume bit for bit (codes and scales in the
#     checkpoint); full mode and a stray --moe-group refused
#   - evaluation: a run with --eval-every gives the same losses and final checkpoint bit for
#     bit as one without; the unigram baseline and the final held-out line are printed
#   - SIGINT (and SIGTERM) in the middle of a run: the step finishes, a checkpoint is written,
#     the exit status is 130 (143); resuming finishes equal to the uninterrupted run
#   - refused, with the reason and a non-zero exit: a second run into a run directory in use; a
#     checkpoint whose session file was
#     damaged or truncated, or whose run.json was (the other checkpoints left alone); a resume
#     with another setting, program or data file; contradictory flags
#   - --steps 0 --save writes the initial state; --schedule linear's learning rates (from
#     metrics.jsonl) follow the formula; a resume from an earlier checkpoint of the same run
#     directory replaces the later ones
#   - with KT_LAUNCH (UCX built): 2 ranks resume bit for bit, and a SIGINT sent to rank 1 alone
#     stops both after the same step, with rank 0's checkpoint
#
# usage: resume_test.sh KT_TRAIN TRAIN_CHECK WORKDIR [KT_LAUNCH|none]
set -uo pipefail
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
train=$(abs "$1") check=$(abs "$2") work=$3 launch=${4:-none}
[ "$launch" = none ] || launch=$(abs "$launch")
src=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

failures=0 checks=0
ok() { checks=$((checks + 1)); echo "ok: $*"; }
fail() { checks=$((checks + 1)); failures=$((failures + 1)); echo "FAIL: $*"; }
# same WHAT A B: two checkpoints' session files hold the same tensors, bit for bit
same() {
  local out
  if out=$("$check" params "$2/session.safetensors" "$3/session.safetensors" 0 2>&1); then
    ok "$1: ${out#ok: }"
  else
    fail "$1: $out"
  fi
}
# same_losses WHAT A B: the files are equal, line for line (%.9g: every bit of the f32)
same_losses() {
  if [ -s "$2" ] && cmp -s "$2" "$3"; then ok "$1: $(wc -l < "$2") losses equal"
  else fail "$1: the losses differ: $(paste -d' ' "$2" "$3" | head -5 | tr '\n' '|')"; fi
}
# refused NAME WANT_RC PATTERN COMMAND...: exit status WANT_RC and a message matching PATTERN
refused() {
  local name=$1 want=$2 pattern=$3 rc
  shift 3
  "$@" > "$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq "$want" ] && grep -q -- "$pattern" "$name.log"; then
    ok "$name: exit $rc, $(grep -h -m1 -- "$pattern" "$name.log")"
  else
    fail "$name: exit $rc (want $want and '$pattern'):"; sed 's/^/    /' "$name.log"
  fi
}
run() { # run NAME ARGS...: a run that must succeed
  local name=$1
  shift
  "$train" "$@" > "$name.log" 2>&1 || { fail "$name: kt-train exited with $?"; sed 's/^/    /' "$name.log"; return 1; }
}

"$check" tokens train.bin 4096 64 markov && "$check" tokens held.bin 1024 64 markov &&
  "$check" tokens other.bin 4096 64 repeat || { echo "FAIL: writing the token files"; exit 1; }

lm=("$src/examples/lm.ktg" -D T=32 -D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
qwen=("$src/tests/models/qwen3_moe.ktg" -D T=16 -D VOCAB=64)
opts=(--data train.bin --threads 1 --optimizer adamw --lr 0.01 --schedule cosine --warmup 3
      --min-lr 0.001 --accum 2 --weight-decay 0.01 --log-every 4)

# ---- resume exactness, on both models ---------------------------------------------------------
for model in lm qwen; do
  declare -n m=$model
  run "${model}_full" "${m[@]}" "${opts[@]}" --steps 8 --run-dir "${model}_full" --save-every 4 \
    --losses "${model}_full.txt" || continue
  # the first N steps of the same run (the schedule is --steps 8's): kt-train stops by SIGTERM
  # only at a step boundary, so "N steps" is the checkpoint a run of 2N writes at N
  run "${model}_resumed" "${m[@]}" "${opts[@]}" --steps 8 --resume "${model}_full/step-00000004" \
    --run-dir "${model}_resumed" --losses "${model}_resumed.txt" || continue
  tail -n 4 "${model}_full.txt" > "${model}_full_tail.txt"
  same_losses "$model: steps 5-8 after --resume" "${model}_resumed.txt" "${model}_full_tail.txt"
  same "$model: step 8 after --resume equals step 8 of one run" "${model}_resumed/step-00000008" \
    "${model}_full/step-00000008"
  grep -q "resumed from ${model}_full/step-00000004 at step 4" "${model}_resumed.log" &&
    ok "$model: said where it resumed from" || fail "$model: no 'resumed from' line"
done
# LoRA adapters on the experts (their AdamW state is the MoE layers' too)
lora=(--moe-mode lora --lora-rank 4)
run lora_full "${lm[@]}" "${opts[@]}" "${lora[@]}" --steps 8 --run-dir lora_full --save-every 4 \
    --losses lora_full.txt &&
  run lora_resumed "${lm[@]}" "${opts[@]}" "${lora[@]}" --steps 8 \
    --resume lora_full/step-00000004 --run-dir lora_resumed --losses lora_resumed.txt &&
  tail -n 4 lora_full.txt > lora_full_tail.txt &&
  same_losses "lora: steps 5-8 after --resume" lora_resumed.txt lora_full_tail.txt &&
  same "lora: step 8 after --resume (adapters and their optimizer state)" \
    lora_resumed/step-00000008 lora_full/step-00000008
refused lora_mode 1 "\-\-moe-mode is full here but lora" \
  "$train" "${lm[@]}" "${opts[@]}" --moe-mode full --steps 8 --resume lora_full/step-00000004 \
  --run-dir x2
# quantized frozen experts (int4, LoRA): the checkpoint holds their codes and scales, so a resume
# goes on bit for bit; a quantized run in full mode is refused
lmq=("$src/examples/lm.ktg" -D T=32 -D H=64 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
int4=(--moe-dtype int4 --moe-group 32 "${lora[@]}")
run int4_full "${lmq[@]}" "${opts[@]}" "${int4[@]}" --steps 8 --run-dir int4_full --save-every 4 \
    --losses int4_full.txt &&
  run int4_resumed "${lmq[@]}" "${opts[@]}" "${int4[@]}" --steps 8 \
    --resume int4_full/step-00000004 --run-dir int4_resumed --losses int4_resumed.txt &&
  tail -n 4 int4_full.txt > int4_full_tail.txt &&
  same_losses "int4: steps 5-8 after --resume" int4_resumed.txt int4_full_tail.txt &&
  same "int4: step 8 after --resume (codes, scales, adapters, optimizer state)" \
    int4_resumed/step-00000008 int4_full/step-00000008
grep -q "int4 g32, lora" int4_full.log && ok "int4: the run says its experts are int4 g32" ||
  fail "int4: no 'int4 g32, lora' in the run's header"
refused int4_fullmode 2 "quantized experts are frozen" \
  "$train" "${lmq[@]}" "${opts[@]}" --moe-dtype int4 --steps 2
refused int4_group 2 "\-\-moe-group is int4's" \
  "$train" "${lmq[@]}" "${opts[@]}" --moe-dtype int8 --moe-group 32 "${lora[@]}" --steps 2
# --resume alone: the program, the data, --steps and every option come from the checkpoint
(mkdir -p elsewhere && cd elsewhere &&
  "$train" --resume ../lora_full/step-00000004 --run-dir ../lora_bare --losses ../lora_bare.txt \
  > ../lora_bare.log 2>&1) &&
  same_losses "lora: --resume DIR alone (from another directory): steps 5-8" lora_bare.txt \
    lora_full_tail.txt &&
  same "lora: --resume DIR alone: step 8" lora_bare/step-00000008 lora_full/step-00000008 ||
  { fail "--resume DIR alone:"; sed 's/^/    /' lora_bare.log; }
# the MoE layers' experts and their AdamW state are in the checkpoint
names=$(head -c 65536 lm_full/step-00000008/session.safetensors | tr -c 'a-z0-9_.' '\n' |
        grep -E '^(moe\.0\.experts\.3\.down_proj\.weight|optimizer\.[mv]\.moe\.[01])$' | sort -u |
        tr '\n' ' ')
[ "$(echo "$names" | wc -w)" -eq 5 ] && ok "the checkpoint holds the experts and their optimizer state: $names" ||
  fail "the checkpoint lacks the experts or their optimizer state (found: $names)"
# --keep: a run of 8 saving every 2 keeps the newest 2
run keep "${lm[@]}" "${opts[@]}" --steps 8 --run-dir keep --save-every 2 --keep 2 &&
  [ "$(ls keep | grep step- | tr '\n' ' ')" = "step-00000006 step-00000008 " ] &&
  ok "--keep 2: $(ls keep | tr '\n' ' ')" || fail "--keep 2 left: $(ls -A keep | tr '\n' ' ')"
# a run directory resumes from its newest checkpoint, and the program may be left out
rm -rf keep_more && mkdir keep_more && cp -r keep/step-00000006 keep_more/ &&
  cp -r lm_full/step-00000004 keep_more/ &&
  run newest "${opts[@]}" --steps 8 --resume keep_more --losses newest.txt &&
  grep -q "resumed from keep_more/step-00000006 at step 6" newest.log &&
  same "--resume RUN_DIR (newest: step 6, no program given)" keep_more/step-00000008 keep/step-00000008 ||
  fail "--resume RUN_DIR did not take the newest checkpoint: $(grep resumed newest.log)"

# ---- evaluation does not change training ------------------------------------------------------
run eval "${lm[@]}" "${opts[@]}" --steps 8 --run-dir eval --eval-data held.bin --eval-every 2 \
  --eval-windows 5 --losses eval.txt &&
  same_losses "--eval-every 2: the losses of a run without" eval.txt lm_full.txt &&
  same "--eval-every 2: the final checkpoint of a run without" eval/step-00000008 lm_full/step-00000008
n_eval=$(grep -c "held-out loss" eval.log)
if grep -q "unigram baseline" eval.log && grep -q "of the unigram baseline" eval.log &&
   [ "$n_eval" -eq 5 ]; then # steps 2, 4, 6, 8 and the final line
  ok "evaluation: $(grep -h "unigram baseline" eval.log | head -1 | sed 's/^kt-train: //'); $(tail -2 eval.log | head -1)"
else
  fail "evaluation lines ($n_eval held-out lines, want 5):"; sed 's/^/    /' eval.log
fi
run eval_qwen "${qwen[@]}" "${opts[@]}" --steps 8 --eval-data held.bin --eval-every 3 \
  --losses eval_qwen.txt && same_losses "qwen: --eval-every 3 leaves the losses alone" \
  eval_qwen.txt qwen_full.txt

# ---- SIGINT and SIGTERM -----------------------------------------------------------------------
long=("${qwen[@]}" "${opts[@]}" --steps 300 --log-every 1)
run long_ref "${long[@]}" --run-dir long_ref --losses long_ref.txt
for sig in INT TERM; do
  want=$([ $sig = INT ] && echo 130 || echo 143)
  rm -rf "sig$sig"
  "$train" "${long[@]}" --run-dir "sig$sig" > "sig$sig.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do grep -q "^step 5/" "sig$sig.log" && break; sleep 0.05; done
  kill -$sig "$pid"
  wait "$pid"
  rc=$?
  saved=$(ls "sig$sig" 2> /dev/null | tail -1)
  if [ "$rc" -eq "$want" ] && [ -n "$saved" ] && [ "$saved" != step-00000300 ]; then
    ok "SIG$sig: exit $rc, $(grep -h "after step" "sig$sig.log"), $saved written"
    run "sig${sig}_resume" "${long[@]}" --resume "sig$sig" --losses "sig${sig}_resume.txt" &&
      same "SIG$sig: resumed from $saved, step 300 equals the uninterrupted run" \
        "sig$sig/step-00000300" long_ref/step-00000300
  else
    fail "SIG$sig: exit $rc (want $want), checkpoint '${saved:-none}':"; sed 's/^/    /' "sig$sig.log" | tail -5
  fi
done

# one run at a time in a run directory
rm -rf locked
"$train" "${long[@]}" --run-dir locked > locked_first.log 2>&1 &
pid=$!
for _ in $(seq 200); do grep -q "^step 2/" locked_first.log && break; sleep 0.05; done
refused locked 1 "the run directory locked is in use by another kt-train" "$train" "${long[@]}" --run-dir locked
kill -TERM "$pid"
wait "$pid"

# ---- bad checkpoints and mismatched resumes ---------------------------------------------------
rm -rf bad && cp -r lm_full bad
ls -lR bad > bad_before.txt
step=bad/step-00000008
cp "$step/session.safetensors" good.safetensors
printf '\x55\x55\x55\x55' | dd of="$step/session.safetensors" bs=1 seek=40000 conv=notrunc 2> /dev/null
refused corrupt 1 "session.safetensors is corrupt" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --resume bad
cp good.safetensors "$step/session.safetensors" && truncate -s 30000 "$step/session.safetensors"
refused truncated 1 "session.safetensors is corrupt (30000 bytes" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --resume "$step"
cp good.safetensors "$step/session.safetensors"
cp "$step/run.json" good.json && head -c 300 good.json > "$step/run.json"
refused bad_json 1 "run.json is corrupt" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --resume bad
cp good.json "$step/run.json"
ls -lR bad > bad_after.txt
cmp -s bad_before.txt bad_after.txt && ok "the refused resumes left the run directory as it was" ||
  fail "a refused resume changed the run directory: $(diff bad_before.txt bad_after.txt | head -3)"
refused other_lr 1 "\-\-lr is 0.0199999996 here but 0.00999999978 in the checkpoint" \
  "$train" "${lm[@]}" "${opts[@]}" --lr 0.02 --steps 8 --resume lm_full/step-00000004 --run-dir x1
refused other_accum 1 "\-\-accum is 1 here but 2" \
  "$train" "${lm[@]}" "${opts[@]}" --accum 1 --steps 8 --resume lm_full/step-00000004 --run-dir x1
refused other_steps 1 "\-\-steps (the schedule's length) is 9 here but 8" \
  "$train" "${lm[@]}" "${opts[@]}" --steps 9 --resume lm_full/step-00000004 --run-dir x1
refused other_program 1 "the program is [0-9a-f]* here but [0-9a-f]* in the checkpoint" \
  "$train" "${lm[@]}" -D H=16 "${opts[@]}" --steps 8 --resume lm_full/step-00000004 --run-dir x1
refused other_data 1 "the --data file's tokens is [0-9a-f]* here but" \
  "$train" "${lm[@]}" "${opts[@]}" --data other.bin --steps 8 --resume lm_full/step-00000004 --run-dir x1
mkdir -p empty_run
refused no_checkpoint 1 "no checkpoint there" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --resume empty_run
refused no_dir 1 "no such directory" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --resume nowhere

# ---- contradictory flags (usage errors, exit 2) ------------------------------------------------
refused resume_params 2 "leave out --params" "$train" "${lm[@]}" "${opts[@]}" --steps 8 \
  --resume lm_full --params good.safetensors
refused save_every 2 "\-\-save-every writes checkpoints into a run directory" \
  "$train" "${lm[@]}" "${opts[@]}" --steps 8 --save-every 2
refused eval_every 2 "need the held-out tokens" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --eval-every 2
refused momentum 2 "\-\-momentum is SGD's" "$train" "${lm[@]}" "${opts[@]}" --steps 8 --momentum 0.9
refused min_lr 2 "\-\-min-lr is where a linear or cosine" "$train" "${lm[@]}" --data train.bin --steps 8 --min-lr 0.1
refused define_ktp 2 "\-D overrides a .ktg model's consts" "$train" lm_full/step-00000004/program.ktp \
  -D T=8 --data train.bin --steps 1
refused bad_schedule 2 "\-\-schedule: unknown value 'step'" "$train" "${lm[@]}" --data train.bin --steps 1 --schedule step
refused steps0 2 "\-\-steps 0 trains nothing" "$train" "${lm[@]}" --data train.bin --steps 0

# ---- --steps 0 writes the initial state --------------------------------------------------------
run init0 "${lm[@]}" --data train.bin --steps 0 --save init0.safetensors &&
  run init1 "${lm[@]}" --data train.bin --steps 1 --params init0.safetensors --lr 1e-3 --clip 0 \
    --losses init1.txt &&
  run init2 "${lm[@]}" --data train.bin --steps 1 --lr 1e-3 --clip 0 --losses init2.txt &&
  same_losses "--steps 0 --save: the initial state (its first step equals the seed's)" init1.txt init2.txt

# ---- --schedule linear: warm-up 2, then a straight line from 0.01 to 0.001 at step 6 ----------
run linear "${lm[@]}" --data train.bin --threads 1 --steps 6 --lr 0.01 --schedule linear --warmup 2 \
  --min-lr 0.001 --run-dir linear &&
  lrs=$(sed -n 's/.*"lr":\([^,]*\),.*/\1/p' linear/metrics.jsonl | tr '\n' ' ') &&
  if echo "$lrs" | awk '{ n = split("0.005 0.01 0.01 0.00775 0.0055 0.00325", w, " ")
         if (NF != n) exit 1
         for (i = 1; i <= n; i++) if ($i - w[i] > 1e-8 || w[i] - $i > 1e-8) exit 1 }'; then
    ok "--schedule linear --warmup 2: learning rates $lrs"
  else
    fail "--schedule linear --warmup 2: learning rates $lrs (want 0.005 0.01 0.01 0.00775 0.0055 0.00325)"
  fi

# ---- a resume from an earlier checkpoint of the same directory replaces the later ones -------
rm -rf back && cp -r keep back && cp -r lm_full/step-00000004 back/ # steps 4, 6, 8
run back "${opts[@]}" --steps 8 --resume back/step-00000004 --losses back.txt &&
  grep -q "holds 2 checkpoints after step 4" back.log &&
  [ "$(ls back | grep step- | tr '\n' ' ')" = "step-00000004 step-00000008 " ] && # not 6
  same "resumed in place from step 4: the later checkpoints replaced, step 8 as one run's" \
    back/step-00000008 lm_full/step-00000008 ||
  fail "resume in place from step 4: $(grep note back.log); left $(ls back | tr '\n' ' ')"

# ---- several ranks ----------------------------------------------------------------------------
if [ "$launch" = none ]; then
  echo "skip: the 2-rank checks (no kt-launch: built without UCX)"
else
  lm2=("$src/examples/lm.ktg" -D T=16 -D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
  two() { local name=$1; shift
    timeout 120 "$launch" -n 2 --transport shm --timeout-ms 20000 -- "$train" "$@" > "$name.log" 2>&1; }
  two mr_full "${lm2[@]}" "${opts[@]}" --steps 8 --run-dir mr_full --save-every 4 --losses mr_full.txt &&
    two mr_res "${lm2[@]}" "${opts[@]}" --steps 8 --resume mr_full/step-00000004 --run-dir mr_res \
      --losses mr_res.txt &&
    tail -n 4 mr_full.txt > mr_full_tail.txt &&
    same_losses "2 ranks: steps 5-8 after --resume" mr_res.txt mr_full_tail.txt &&
    same "2 ranks: step 8 after --resume" mr_res/step-00000008 mr_full/step-00000008 ||
    { fail "2 ranks: resume"; tail -5 mr_full.log mr_res.log; }
  rm -rf mr_sig
  two mr_sig "${lm2[@]}" "${opts[@]}" --steps 100000 --log-every 1 --run-dir mr_sig &
  lpid=$!
  for _ in $(seq 400); do grep -q "step 5/" mr_sig.log 2> /dev/null && break; sleep 0.05; done
  # rank 1 alone: the kt-train child of the launcher that is not rank 0
  rank1=$(ps -eo pid=,args= | awk '/kt-train .*--run-dir mr_sig/ && !/kt-launch/ { print $1 }' |
          while read -r p; do [ "$(tr '\0' '\n' < /proc/$p/environ | grep -c '^KT_RANK=1$')" = 1 ] && echo "$p"; done)
  [ -n "$rank1" ] && kill -INT "$rank1"
  wait "$lpid"
  rc=$?
  saved=$(ls mr_sig 2> /dev/null | grep step- | tail -1)
  at=$([ -n "$saved" ] && echo $((10#${saved#step-})))
  if [ -n "$rank1" ] && [ "$rc" -eq 130 ] && [ -n "$saved" ] &&
     grep -q "interrupted (SIGINT) after step $at:" mr_sig.log; then
    ok "2 ranks, SIGINT to rank 1 only: exit $rc, $(grep -h -m1 "interrupted" mr_sig.log), $saved written"
  else
    fail "2 ranks, SIGINT to rank 1 (pid ${rank1:-not found}): exit $rc, checkpoint ${saved:-none}"
    tail -5 mr_sig.log
  fi
fi

echo "$((checks - failures)) of $checks checks passed"
[ "$failures" -eq 0 ]
