#!/usr/bin/env bash
# kt-train end to end: context-parallel training of examples/lm.ktg (embedding, causal conv
# with halo, router + CPU MoE, sharded along time) equals training on one rank.
#
# The model is compiled once for the whole window (T=48 tokens, one rank) and once per rank
# for W = 2 and 3 (T = 24, 16). Then:
#   - one rank, and W ranks under kt-launch over shm and over tcp (loopback): with SGD every
#     step's loss equals the one-rank loss within 1e-4 relative, and the saved parameters and
#     experts equal the one-rank ones within 1e-5 of each tensor's largest magnitude (the sums
#     are reordered across ranks, so not bitwise; seen: <= 1e-6). With AdamW the losses are
#     compared (1e-4): Adam divides each gradient by its own running magnitude, so on
#     near-zero gradient elements it turns rounding-level differences into visible parameter
#     differences (seen: 4e-5 on 3 ranks) that say nothing about correctness.
#     And once with LoRA experts on 3 ranks over shm; and with expert parallelism
#     (--moe-parallel ep: 2 ranks shm SGD, 3 ranks tcp LoRA and AdamW), the losses and the
#     ranks' saved shards (train_check shards) against one rank.
#   - 30 steps on a repeating token pattern: the last loss is below half the first
#   - a token id outside the vocabulary: exit 1 and a message naming its offset, also when
#     it lies past every window the run would read (the whole file is checked first)
#   - resuming from saved parameters and experts; another model's parameters, experts, or
#     LoRA adapters without --moe-mode lora: exit 1 naming the first tensor it lacks
#   - a 100-token file read across its end (one rank, and 2 ranks against it)
#   - a header larger than the file, a world size that is not a number (or rank 1 of a world
#     of 1), rank 0 unable to create its losses file under 2 ranks (rank 1 told why), ranks
#     started with different options: exit 1 with the reason, no rank left waiting
# Without UCX (KT_LAUNCH "none") the multi-rank runs are skipped.
#
# usage: run_train_tests.sh KT_GRAPHC KT_TRAIN TRAIN_CHECK KT_LAUNCH|none WORKDIR
set -uo pipefail
abs() { case $1 in /* | none) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
graphc=$(abs "$1") train=$(abs "$2") check=$(abs "$3") launch=$(abs "$4") work=$5
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$work" && cd "$work" || exit 1
rm -f ./*.txt ./*.safetensors ./*.safetensors.rank* ./*.ktp ./*.bin ./*.log

failures=0 checks=0
ok() { checks=$((checks + 1)); echo "ok: $*"; }
fail() { checks=$((checks + 1)); failures=$((failures + 1)); echo "FAIL: $*"; }
# expect WHAT COMMAND...: the command (a checker) exits 0
expect() {
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then ok "$what: ${out#ok: }"; else fail "$what: $out"; fi
}

# ---- the programs and the data ---------------------------------------------------------------
sizes=(-D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
for w in 1 2 3; do
  if ! "$graphc" "$src/examples/lm.ktg" -o "lm$w.ktp" -D T=$((48 / w)) "${sizes[@]}" > /dev/null
  then
    echo "FAIL: kt-graphc examples/lm.ktg (T=$((48 / w)))"
    exit 1
  fi
done
if ! { "$check" tokens markov.bin 4096 64 markov && "$check" tokens repeat.bin 4096 64 repeat &&
       "$check" tokens bad.bin 4096 64 markov 77 &&
       "$check" tokens bad_late.bin 4096 64 markov 4000; }; then
  echo "FAIL: writing the token files"
  exit 1
fi

common=(--data markov.bin --steps 5 --threads 1 --log-every 5)
sgd=(--optimizer sgd --lr 0.5)
adamw=(--optimizer adamw --lr 0.01)

# train NAME RANKS TRANSPORT ARGS...: one run; its output goes to NAME.log
train() {
  local name=$1 n=$2 tr=$3
  shift 3
  if [ "$n" -eq 1 ]; then
    "$train" "$@" > "$name.log" 2>&1
  else
    timeout 120 "$launch" -n "$n" --transport "$tr" --timeout-ms 20000 -- "$train" "$@" \
      > "$name.log" 2>&1
  fi
  local rc=$?
  [ "$rc" -eq 0 ] || { fail "$name: kt-train exited with $rc"; sed 's/^/    /' "$name.log"; }
  return "$rc"
}

# ---- one rank: the reference runs -----------------------------------------------------------
train ref_sgd 1 - lm1.ktp "${common[@]}" "${sgd[@]}" --losses ref_sgd.txt \
  --save ref_sgd.safetensors || exit 1
train ref_adamw 1 - lm1.ktp "${common[@]}" "${adamw[@]}" --losses ref_adamw.txt || exit 1
train ref_lora 1 - lm1.ktp "${common[@]}" "${sgd[@]}" --moe-mode lora --losses ref_lora.txt \
  --save ref_lora.safetensors || exit 1
ok "one rank: $(grep -h "^step 5/5" ref_sgd.log) (sgd)"

# ---- W ranks against one ----------------------------------------------------------------------
if [ "$launch" = none ]; then
  echo "skipped: the multi-rank runs (this libkt is built without UCX)"
else
  for tr in shm tcp; do
    if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
    for n in 2 3; do
      run="${tr}_$n"
      if train "${run}_sgd" "$n" "$tr" "lm$n.ktp" "${common[@]}" "${sgd[@]}" \
           --losses "${run}_sgd.txt" --save "${run}_sgd.safetensors"; then
        expect "$run sgd losses" "$check" losses "${run}_sgd.txt" ref_sgd.txt 1e-4
        expect "$run sgd parameters and experts" "$check" params "${run}_sgd.safetensors" \
          ref_sgd.safetensors 1e-5
      fi
      if train "${run}_adamw" "$n" "$tr" "lm$n.ktp" "${common[@]}" "${adamw[@]}" \
           --losses "${run}_adamw.txt"; then
        expect "$run adamw losses" "$check" losses "${run}_adamw.txt" ref_adamw.txt 1e-4
      fi
    done
  done
  unset UCX_NET_DEVICES
  # LoRA experts: rank 0 trains the adapters with the session's optimizer
  if train shm_3_lora 3 shm lm3.ktp "${common[@]}" "${sgd[@]}" --moe-mode lora \
       --losses shm_3_lora.txt --save shm_3_lora.safetensors; then
    expect "shm_3 lora losses" "$check" losses shm_3_lora.txt ref_lora.txt 1e-4
    expect "shm_3 lora parameters and adapters" "$check" params shm_3_lora.safetensors \
      ref_lora.safetensors 1e-5
  fi
  # expert parallelism: each rank trains its share of the E=4 experts (2 ranks: 2 each; 3
  # ranks: 2, 1, 1) and saves it beside the replicated parameters (FILE, FILE.rank<r>)
  if train shm_2_ep 2 shm lm2.ktp "${common[@]}" "${sgd[@]}" --moe-parallel ep \
       --losses shm_2_ep.txt --save shm_2_ep.safetensors; then
    expect "shm_2 ep losses" "$check" losses shm_2_ep.txt ref_sgd.txt 1e-4
    expect "shm_2 ep parameters and expert shards" "$check" shards ref_sgd.safetensors 1e-5 \
      shm_2_ep.safetensors shm_2_ep.safetensors.rank1
    # resuming: rank 1 reads its FILE.rank1; or every rank the one-rank file (experts by name)
    if train ref_sgd_more 1 - lm1.ktp "${common[@]}" "${sgd[@]}" --params ref_sgd.safetensors \
         --losses ref_sgd_more.txt --save ref_sgd_more.safetensors &&
       train shm_2_ep_more 2 shm lm2.ktp "${common[@]}" "${sgd[@]}" --moe-parallel ep \
         --params shm_2_ep.safetensors --losses shm_2_ep_more.txt \
         --save shm_2_ep_more.safetensors; then
      expect "shm_2 ep resumed from its shards: losses" "$check" losses shm_2_ep_more.txt \
        ref_sgd_more.txt 1e-4
      expect "shm_2 ep resumed from its shards: shards" "$check" shards \
        ref_sgd_more.safetensors 1e-5 shm_2_ep_more.safetensors shm_2_ep_more.safetensors.rank1
    fi
    if train shm_2_ep_from_one 2 shm lm2.ktp "${common[@]}" "${sgd[@]}" --moe-parallel ep \
         --params ref_sgd.safetensors --losses shm_2_ep_from_one.txt; then
      expect "shm_2 ep resumed from the one-rank file: losses" "$check" losses \
        shm_2_ep_from_one.txt ref_sgd_more.txt 1e-4
    fi
  fi
  export UCX_NET_DEVICES=lo
  if train tcp_3_ep_lora 3 tcp lm3.ktp "${common[@]}" "${sgd[@]}" --moe-parallel ep \
       --moe-mode lora --losses tcp_3_ep_lora.txt --save tcp_3_ep_lora.safetensors; then
    expect "tcp_3 ep lora losses" "$check" losses tcp_3_ep_lora.txt ref_lora.txt 1e-4
    expect "tcp_3 ep lora parameters and adapter shards" "$check" shards \
      ref_lora.safetensors 1e-5 tcp_3_ep_lora.safetensors tcp_3_ep_lora.safetensors.rank1 \
      tcp_3_ep_lora.safetensors.rank2
  fi
  if train tcp_3_ep_adamw 3 tcp lm3.ktp "${common[@]}" "${adamw[@]}" --moe-parallel ep \
       --losses tcp_3_ep_adamw.txt; then
    expect "tcp_3 ep adamw losses" "$check" losses tcp_3_ep_adamw.txt ref_adamw.txt 1e-4
  fi
  unset UCX_NET_DEVICES
fi

# ---- the loss goes down ---------------------------------------------------------------------
if train decrease 1 - lm1.ktp --data repeat.bin --steps 30 --threads 1 --log-every 10 \
     "${adamw[@]}" --losses decrease.txt; then
  expect "30 steps on a repeating pattern" "$check" decrease decrease.txt 0.5
fi

# ---- a token id outside the vocabulary -------------------------------------------------------
"$train" lm1.ktp --data bad.bin --steps 5 --threads 1 > bad.log 2>&1
rc=$?
if [ "$rc" -eq 1 ] && grep -q "bad.bin: token 77 (byte offset 154) is 64, outside" bad.log; then
  ok "bad token id: exit 1, $(grep -h "token 77" bad.log)"
else
  fail "bad token id: exit $rc (want 1 and a message naming token 77, byte offset 154)"
  sed 's/^/    /' bad.log
fi

# a bad id far past the steps asked for is found before the first step, not when reached
"$train" lm1.ktp --data bad_late.bin --steps 1 --threads 1 > bad_late.log 2>&1
rc=$?
if [ "$rc" -eq 1 ] && grep -q "bad_late.bin: token 4000 (byte offset 8000) is 64" bad_late.log &&
   ! grep -q "^step" bad_late.log; then
  ok "bad token id past the run's windows: exit 1 before any step"
else
  fail "bad token id at 4000, 1 step: exit $rc (want 1, the id named, no step run)"
  sed 's/^/    /' bad_late.log
fi

# ---- the window wraps around the end of a short file -------------------------------------------
# 100 tokens, 5 steps of 48 (+1): steps 3-5 read across the end; W ranks must slice the
# wrapped window exactly as one rank does
if "$check" tokens short.bin 100 64 markov &&
   train wrap_1 1 - lm1.ktp --data short.bin --steps 5 --threads 1 "${sgd[@]}" \
     --losses wrap_1.txt; then
  ok "a 100-token file read over 5 steps of 48 tokens (wrapping)"
  if [ "$launch" != none ] &&
     train wrap_2 2 shm lm2.ktp --data short.bin --steps 5 --threads 1 "${sgd[@]}" \
       --losses wrap_2.txt; then
    expect "wrapping, 2 ranks" "$check" losses wrap_2.txt wrap_1.txt 1e-4
  fi
fi

# ---- errors: each a clear message and exit 1, on every rank, without waiting --------------------
# expect_exit RC NAME PATTERN COMMAND...; expect_error: RC 1 (2 is a usage error)
expect_exit() {
  local want=$1 name=$2 pattern=$3
  shift 3
  timeout 60 "$@" > "$name.log" 2>&1
  local rc=$?
  if [ "$rc" -eq "$want" ] && grep -q -- "$pattern" "$name.log"; then
    ok "$name: exit $rc, $(grep -h -m1 -- "$pattern" "$name.log")"
  else
    fail "$name: exit $rc (want $want and '$pattern')"
    sed 's/^/    /' "$name.log"
  fi
}
expect_error() { expect_exit 1 "$@"; }
expect_error header "is larger than markov.bin" \
  "$train" lm1.ktp --data markov.bin --data-header 99999 --steps 1 --threads 1
expect_error world_size "KT_WORLD_SIZE=abc is not a world size" \
  env KT_RANK=0 KT_WORLD_SIZE=abc "$train" lm1.ktp --data markov.bin --steps 1 --threads 1
expect_error rank_of_one "KT_RANK=1 with KT_WORLD_SIZE=1" \
  env KT_RANK=1 KT_WORLD_SIZE=1 "$train" lm1.ktp --data markov.bin --steps 1 --threads 1
# run-directory checkpoints are rank 0's alone: refused with expert parallelism
[ "$launch" = none ] || expect_error ep_run_dir "would miss the other ranks' experts" \
  "$launch" -n 2 --transport shm --timeout-ms 20000 -- "$train" lm2.ktp --data markov.bin \
  --steps 1 --threads 1 --moe-parallel ep --run-dir ep_run_dir
# a run larger than the machine's memory is refused at once, before anything is allocated
"$graphc" "$src/examples/lm.ktg" -o lm_huge.ktp -D T=4096 -D H=8192 -D VOCAB=65536 -D E=8 \
  -D L=2 -D K=4 -D TOPK=2 > /dev/null
t0=$(date +%s%N)
expect_error memory_plan "nothing was allocated" \
  "$train" lm_huge.ktp --data markov.bin --data-format u8 --steps 1 --threads 1
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
if [ "$ms" -lt 1000 ]; then ok "memory_plan: refused in $ms ms"; else fail "memory_plan: $ms ms"; fi
expect_error memory_limit "but 102 KB is available" \
  env KT_MEMORY_LIMIT=100K "$train" lm1.ktp --data markov.bin --steps 1 --threads 1
expect_exit 2 memory_limit_bad "KT_MEMORY_LIMIT='lots' is not a byte count" \
  env KT_MEMORY_LIMIT=lots "$train" lm1.ktp --data markov.bin --steps 1 --threads 1
# every argument and input file is checked before memory is committed: an empty --params
# file is refused as fast as a missing one
: > empty.safetensors
expect_error empty_params "empty.safetensors" \
  "$train" lm_huge.ktp --data markov.bin --data-format u8 --steps 1 --params empty.safetensors
expect_exit 2 bad_env "KT_NUM_THREADS='2x' is not a thread count" \
  env KT_NUM_THREADS=2x "$train" lm1.ktp --data markov.bin --steps 1

# outputs never spoil inputs, nor what is not a regular file; a FIFO input never blocks
cp markov.bin data_copy.bin
expect_exit 2 losses_is_data "--losses names the same file as --data" \
  "$train" lm1.ktp --data data_copy.bin --steps 1 --threads 1 --losses data_copy.bin
ln -sf data_copy.bin data_link.bin
expect_exit 2 save_is_data_link "--save names the same file as --data" \
  "$train" lm1.ktp --data data_copy.bin --steps 1 --threads 1 --save data_link.bin
if cmp -s data_copy.bin markov.bin; then ok "the data file is unchanged"; else fail "data spoiled"; fi
ln -sf /dev/null save_link.safetensors
expect_error save_symlink "is a symbolic link" \
  "$train" lm1.ktp --data markov.bin --steps 1 --threads 1 --save save_link.safetensors
if [ -L save_link.safetensors ] && ! grep -q "^step" save_symlink.log; then
  ok "the symlink is left as it was, refused before the first step"
else
  fail "symlink replaced, or refused only after training"
fi
rm -f fifo.bin && mkfifo fifo.bin
expect_error data_fifo "fifo.bin" "$train" lm1.ktp --data fifo.bin --steps 1 --threads 1
if "$train" --help > /dev/full 2> help_full.log; then
  fail "kt-train --help > /dev/full exited 0"
else
  ok "kt-train --help > /dev/full: $(head -1 help_full.log)"
fi
# the losses of a run that is killed never replace the previous file
cp ref_sgd.txt losses_keep.txt
timeout -s KILL 0.3 "$train" lm_huge.ktp --data markov.bin --steps 1000000 --threads 1 \
  --losses losses_keep.txt > /dev/null 2>&1
"$train" lm1.ktp --data markov.bin --steps 1000000 --threads 1 --log-every 1000000 \
  --losses losses_keep.txt > /dev/null 2>&1 &
sleep 1; kill -9 $! 2> /dev/null; wait $! 2> /dev/null
if cmp -s losses_keep.txt ref_sgd.txt && [ -z "$(ls -A | grep kt-tmp)" ]; then
  ok "a killed run leaves the previous losses file whole, and no temporary"
else
  fail "a killed run changed losses_keep.txt or left a temporary: $(ls -A | grep kt-tmp)"
fi

# a checkpoint is loaded whole or not at all: resuming works, another model's files do not
"$check" select ref_sgd.safetensors ref_sgd.experts.safetensors moe. > /dev/null
"$check" select ref_lora.safetensors ref_lora.experts.safetensors moe. > /dev/null
if train resume 1 - lm1.ktp --data markov.bin --steps 1 --threads 1 \
     --params ref_sgd.safetensors; then
  ok "resume from ref_sgd's parameters and experts (one file)"
fi
if train resume_experts 1 - lm1.ktp --data markov.bin --steps 1 --threads 1 \
     --experts ref_sgd.experts.safetensors; then
  ok "start from ref_sgd's experts alone (--experts)"
fi
expect_error experts_twice "holds the experts already" \
  "$train" lm1.ktp --data markov.bin --steps 1 --threads 1 --params ref_sgd.safetensors \
  --experts ref_sgd.experts.safetensors
"$graphc" "$src/examples/lm.ktg" -o lm1_l1.ktp -D T=48 -D H=32 -D VOCAB=64 -D E=4 -D L=1 \
  -D K=4 -D TOPK=2 > /dev/null
expect_error params_other_model "'block1.conv_norm' is not a parameter of the program" \
  "$train" lm1_l1.ktp --data markov.bin --steps 1 --threads 1 --params ref_sgd.safetensors
expect_error experts_other_model "'moe.1.experts.0.gate_proj.weight' is not one this run loads" \
  "$train" lm1_l1.ktp --data markov.bin --steps 1 --threads 1 \
  --experts ref_sgd.experts.safetensors
expect_error lora_adapters_not_lora "lora_A.weight' is not one this run loads" \
  "$train" lm1.ktp --data markov.bin --steps 1 --threads 1 \
  --experts ref_lora.experts.safetensors
if [ "$launch" != none ]; then
  # rank 0 cannot create its losses file: rank 1 must not sit in the first step's collectives
  expect_error losses_2_ranks "cannot write --losses: /nonexistent-dir/losses.txt" \
    "$launch" -n 2 --timeout-ms 20000 -- "$train" lm2.ktp --data markov.bin --steps 3 \
    --threads 1 --losses /nonexistent-dir/losses.txt
  # ...and rank 1 learns that reason, not a bare status
  expect_error losses_reason_rank_1 "\[rank 1\] .*stopping: rank 0: cannot write --losses" \
    "$launch" -n 2 --timeout-ms 20000 -- "$train" lm2.ktp --data markov.bin --steps 3 \
    --threads 1 --losses /nonexistent-dir/losses.txt
  # a model (with halo ops) that shards no token input: every rank would get the same window
  grep -v '^shard' "$src/examples/lm.ktg" > lm_noshard.ktg
  "$graphc" lm_noshard.ktg -o lm2_noshard.ktp -D T=24 "${sizes[@]}" > /dev/null
  expect_error halo_unsharded "shards none of its token inputs" \
    "$launch" -n 2 --timeout-ms 20000 -- "$train" lm2_noshard.ktp --data markov.bin --steps 1 \
    --threads 1
  # ranks started with different options (another launcher, by hand): refused before step 1
  # ...also in the contents of a data file of the same size
  expect_error ranks_differ_data "rank 1's the data file's contents differs" \
    "$launch" -n 2 --timeout-ms 20000 -- sh -c \
    'if [ "$KT_RANK" = 1 ]; then exec "$@" --data repeat.bin; else exec "$@"; fi' sh \
    "$train" lm2.ktp --data markov.bin --steps 3 --threads 1
  expect_error ranks_differ "rank 1's --lr differs from rank 0's" \
    "$launch" -n 2 --timeout-ms 20000 -- sh -c \
    'if [ "$KT_RANK" = 1 ]; then exec "$@" --lr 0.5; else exec "$@"; fi' sh \
    "$train" lm2.ktp --data markov.bin --steps 3 --threads 1
fi

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
