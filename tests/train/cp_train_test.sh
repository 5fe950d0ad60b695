#!/usr/bin/env bash
# kt-train with context-parallel attention: examples/cp_lm.ktg (RoPE at global positions,
# grouped-query cp_attention in the balanced layout, a rank-0 CPU MoE layer per block) trained
# on 2 and 3 ranks over shm and tcp equals the one-rank run on the whole sequence: every
# step's loss within 1e-5 relative, the saved parameters and experts within 1e-5 of each
# tensor's largest magnitude (SGD). The model is compiled per world size with the sequence
# (48 tokens, 2 sequences a step) split over the ranks: T = 48, 24, 16 tokens a rank.
#
# usage: cp_train_test.sh KT_GRAPHC KT_TRAIN TRAIN_CHECK KT_LAUNCH WORKDIR
set -uo pipefail
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
graphc=$(abs "$1") train=$(abs "$2") check=$(abs "$3") launch=$(abs "$4") work=$5
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$work" && cd "$work" || exit 1
rm -f ./*.txt ./*.safetensors ./*.ktp ./*.bin ./*.log

failures=0 checks=0
ok() { checks=$((checks + 1)); echo "ok: $*"; }
fail() { checks=$((checks + 1)); failures=$((failures + 1)); echo "FAIL: $*"; }
expect() {
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then ok "$what: ${out#ok: }"; else fail "$what: $out"; fi
}

for w in 1 2 3; do
  if ! "$graphc" "$src/examples/cp_lm.ktg" -o "cp$w.ktp" -D T=$((48 / w)) -D VOCAB=64 > /dev/null
  then
    echo "FAIL: kt-graphc examples/cp_lm.ktg (T=$((48 / w)))"
    exit 1
  fi
done
"$check" tokens markov.bin 4096 64 markov || { echo "FAIL: writing the token file"; exit 1; }
common=(--data markov.bin --steps 5 --threads 1 --log-every 5 --optimizer sgd --lr 0.5)

if ! "$train" cp1.ktp "${common[@]}" --losses ref.txt --save ref.safetensors > ref.log 2>&1; then
  echo "FAIL: the one-rank run"
  sed 's/^/    /' ref.log
  exit 1
fi
ok "one rank: $(grep -h "^step 5/5" ref.log)"
for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  for n in 2 3; do
    run="${tr}_$n"
    if timeout 120 "$launch" -n "$n" --transport "$tr" --timeout-ms 20000 -- "$train" \
         "cp$n.ktp" "${common[@]}" --losses "$run.txt" --save "$run.safetensors" \
         > "$run.log" 2>&1; then
      expect "$run losses" "$check" losses "$run.txt" ref.txt 1e-5
      expect "$run parameters and experts" "$check" params "$run.safetensors" ref.safetensors 1e-5
    else
      fail "$run: kt-train failed"
      sed 's/^/    /' "$run.log"
    fi
  done
done
echo "$((checks - failures)) of $checks checks passed"
[ "$failures" -eq 0 ]
