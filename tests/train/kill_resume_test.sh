#!/usr/bin/env bash
# kill -9 at seeded random points of a run that writes a checkpoint every step (most of its
# time goes into the saves, so many kills land inside one): every time, each checkpoint left
# in the run directory resumes, and each resumed run (from the run directory's newest, and from
# every older one kept) finishes equal to the uninterrupted run, bit for bit: the losses of the
# steps it ran and every tensor of the final checkpoint. No step-* directory is ever partial:
# a killed save leaves only a hidden temporary, which the next run removes.
#
# usage: kill_resume_test.sh KT_GRAPHC KT_TRAIN TRAIN_CHECK WORKDIR [TRIALS (20)] [SEED (31)]
set -uo pipefail
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
graphc=$(abs "$1") train=$(abs "$2") check=$(abs "$3") work=$4 trials=${5:-20}
RANDOM=${6:-31}
src=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

"$graphc" "$src/tests/models/qwen3_moe.ktg" -o model.ktp -D T=16 -D VOCAB=64 > /dev/null ||
  { echo "FAIL: kt-graphc"; exit 1; }
"$check" tokens train.bin 4096 64 markov || { echo "FAIL: train_check tokens"; exit 1; }
steps=16
run=("$train" model.ktp --data train.bin --threads 1 --steps $steps --optimizer adamw --lr 0.01
     --schedule cosine --warmup 2 --accum 2 --log-every 1000 --keep 2)
t0=$(date +%s%N)
"${run[@]}" --run-dir ref --save-every 1 --losses ref.txt > ref.log 2>&1 || { cat ref.log; exit 1; }
span=$(( ($(date +%s%N) - t0) / 1000000 )) # ms
echo "an uninterrupted run of $steps steps, saving each, takes about $span ms"
final=$(printf 'step-%08d' $steps)

bad=0 resumes=0 before_first=0
# resume_equal TRIAL FROM: resumes FROM into its own run directory and compares the end
resume_equal() {
  local t=$1 from=$2 dir="r$1_from_$(basename "$2")" at
  rm -rf "$dir"
  if ! "${run[@]}" --resume "$from" --run-dir "$dir" --losses "$dir.txt" > "$dir.log" 2>&1; then
    echo "FAIL: trial $t: --resume $from: exit $?"; sed 's/^/    /' "$dir.log"; bad=$((bad + 1))
    return
  fi
  at=$(sed -n 's/.*resumed from .* at step \([0-9]*\)$/\1/p' "$dir.log")
  resumes=$((resumes + 1))
  if ! tail -n $((steps - at)) ref.txt | cmp -s - "$dir.txt"; then
    echo "FAIL: trial $t: the losses after resuming $from (step $at) differ"; bad=$((bad + 1))
  elif ! out=$("$check" params "$dir/$final/session.safetensors" "ref/$final/session.safetensors" 0); then
    echo "FAIL: trial $t: resumed from $from (step $at): $out"; bad=$((bad + 1))
  fi
}

for t in $(seq "$trials"); do
  d=$((span / 5 + RANDOM % span)) # past the start-up, mostly; some after the end
  rm -rf "k$t"
  "${run[@]}" --run-dir "k$t" --save-every 1 > "k$t.log" 2>&1 &
  pid=$!
  sleep "$(printf '%d.%03d' $((d / 1000)) $((d % 1000)))"
  kill -9 "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  left=$(ls -A "k$t" 2> /dev/null | grep -v -e '^\.lock$' -e '^metrics.jsonl$' | tr '\n' ' ')
  kept=$(ls "k$t" 2> /dev/null | grep '^step-' | tr '\n' ' ')
  for c in $kept; do # every checkpoint there is whole
    [ -s "k$t/$c/run.json" ] && [ -s "k$t/$c/session.safetensors" ] && [ -s "k$t/$c/program.ktp" ] ||
      { echo "FAIL: trial $t: $c is not whole: $(ls "k$t/$c" | tr '\n' ' ')"; bad=$((bad + 1)); }
  done
  if [ -z "$kept" ]; then # killed before the first save ended: nothing to resume, said so
    before_first=$((before_first + 1))
    if "${run[@]}" --resume "k$t" > "k${t}_none.log" 2>&1 ||
       ! grep -q -e "no checkpoint there" -e "no such directory" "k${t}_none.log"; then
      echo "FAIL: trial $t: --resume of a run directory without checkpoints: $(cat "k${t}_none.log")"
      bad=$((bad + 1))
    fi
    continue
  fi
  newest=$(echo $kept | tr ' ' '\n' | tail -1)
  for c in $kept; do
    [ "$c" = "$newest" ] || resume_equal "$t" "k$t/$c"
  done
  # the run directory itself (its newest checkpoint), going on in place, as a user would
  cp -r "k$t" "k${t}_copy"
  resume_equal "$t" "k${t}_copy"
  if ! "${run[@]}" --resume "k$t" > "k${t}_inplace.log" 2>&1 ||
     ! "$check" params "k$t/$final/session.safetensors" "ref/$final/session.safetensors" 0 > /dev/null ||
     [ -n "$(ls -A "k$t" | grep -v -e '^\.lock$' -e '^step-' -e '^metrics.jsonl$' -e '^loss.svg$')" ]; then
    echo "FAIL: trial $t: --resume k$t in place: $(tail -2 "k${t}_inplace.log")"; bad=$((bad + 1))
  fi
  echo "trial $t (kill at $d ms): left $left; resumed from $newest and the older ones kept"
done
echo "$trials kills ($before_first before the first checkpoint), $resumes resumes compared, $bad failures"
[ "$bad" -eq 0 ]
