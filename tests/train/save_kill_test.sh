#!/usr/bin/env bash
# kill -9 at seeded random points of kt-train's run and save: every time, what is at the
# --save path is either the previous file or the new one, byte for byte (so it loads, whole:
# parameters, experts and optimizer state from one save), and nothing else is left in the
# directory but, after a kill mid-commit, the killed writer's temporary, which the next save
# of that path removes. One load of each kind found is checked with kt-train --params.
#
# usage: save_kill_test.sh KT_GRAPHC KT_TRAIN WORKDIR [TRIALS (default 50)] [SEED (default 27)]
set -uo pipefail
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
graphc=$(abs "$1") train=$(abs "$2") work=$3 trials=${4:-50}
RANDOM=${5:-27}
src=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work/refs" "$work/run" && cd "$work" || exit 1

# experts of 2 layers x 8 experts x 3 x 256 x 512 f32, their gradients and AdamW state:
# a save of about 80 MB, long enough to be hit in the middle
"$graphc" "$src/examples/lm.ktg" -o save.ktp -D T=64 -D H=256 -D VOCAB=256 -D E=8 -D L=2 \
  -D K=4 -D TOPK=2 > /dev/null || { echo "FAIL: kt-graphc"; exit 1; }
head -c 4096 "$src/README.md" > text.bin
run=("$train" save.ktp --data text.bin --data-format u8 --steps 1 --threads 1 --moe-inter 512)
"${run[@]}" --seed 1 --save refs/old.safetensors > old.log 2>&1 || { cat old.log; exit 1; }
t0=$(date +%s%N)
"${run[@]}" --seed 2 --save refs/new.safetensors > new.log 2>&1 || { cat new.log; exit 1; }
span=$(( ($(date +%s%N) - t0) / 1000000 + 20 )) # ms: the whole run, start to saved
echo "a whole run and save takes about $span ms; killing at random points of it"

old=0 new=0 bad=0
for t in $(seq "$trials"); do
  cp refs/old.safetensors run/out.safetensors
  d=$((RANDOM % span))
  "${run[@]}" --seed 2 --save run/out.safetensors > /dev/null 2>&1 &
  pid=$!
  sleep "$(printf '%d.%03d' $((d / 1000)) $((d % 1000)))"
  kill -9 "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  left=$(ls -A run | grep -v '^out.safetensors$')
  if cmp -s run/out.safetensors refs/old.safetensors; then
    old=$((old + 1)) kind=old
  elif cmp -s run/out.safetensors refs/new.safetensors; then
    new=$((new + 1)) kind=new
  else
    bad=$((bad + 1)) kind=neither
  fi
  if [ "$kind" = neither ]; then
    echo "FAIL: trial $t (kill at $d ms): the file is neither; left beside it: ${left:-nothing}"
  elif [ -n "$left" ]; then
    # a kill between the commit's link and rename leaves the killed writer's named temporary
    # (include/kt/io.h): it must be that, and the next save of the same path must remove it
    stale=stale
    case $left in
      ".out.safetensors.kt-tmp.$pid".[0-9]*) ;;
      *) stale="not the killed writer's temporary" ;;
    esac
    if [ "$stale" = stale ]; then
      "${run[@]}" --seed 2 --save run/out.safetensors > /dev/null 2>&1
      after=$(ls -A run | grep -v '^out.safetensors$')
      [ -z "$after" ] || stale="still there after the next save: $after"
    fi
    if [ "$stale" = stale ]; then
      echo "trial $t (kill at $d ms): killed mid-commit, the file is $kind; the next save removed $left"
    else
      echo "FAIL: trial $t (kill at $d ms): the file is $kind; left beside it: $left ($stale)"
      bad=$((bad + 1))
    fi
  fi
  rm -f run/.*kt-tmp* 2> /dev/null
done
# what is there loads, whole
for kind in old new; do
  if ! "${run[@]}" --params "refs/$kind.safetensors" > "load_$kind.log" 2>&1; then
    echo "FAIL: the $kind file does not load"; sed 's/^/    /' "load_$kind.log"; bad=$((bad + 1))
  fi
done
echo "$trials kills: $old left the previous file, $new the new one, $bad anything else"
echo "$((trials - bad > 0 ? trials - bad : 0)) passed, $bad failed"
[ "$bad" -eq 0 ]
