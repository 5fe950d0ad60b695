#!/usr/bin/env bash
# The error story of issue 32 on 3 ranks of kt-train (examples/lm.ktg, 2 layers, the conv +
# rank-0 MoE example, context parallel) over kt-launch:
#   fail   KT_FAULT makes one op (forward or backward, each of the program's op kernels by
#          index) or the optimizer step of step 2 fail on rank 0 (the expert owner), 1 (a
#          middle rank) or 2 (the last), or rank 0's checkpoint save after step 2: every rank
#          exits 1 within the deadline, each with the same root cause "rank R: step 2: OP
#          'NODE' (PHASE): injected failure" (the save: "rank 0: ... injected failure")
#   kill / stop
#          KT_FAULT hold keeps one rank inside the forward, the backward, the optimizer step
#          (the peers wait in the gradient all-reduce), rank 0's checkpoint save (the peers
#          wait for its outcome; "save") or rank 0's final --save onto a good file ("final")
#          and the test kills it (SIGKILL) or stops it (SIGSTOP): every
#          survivor exits nonzero within the deadline (+ a margin), the first peer its message
#          names being that rank (not one that passed the news on; in the final save a
#          survivor may also exit 0 when rank 0 saved: the lost rank's part was in); after a
#          save case the run directory's newest checkpoint still resumes, after a final one
#          the --save file is the previous one (rank 0 killed) or loads (train_check)
# A case counts as a hang when the job is still running 40 s after it started (then killed).
#
# usage: run_fault_tests.sh KT_GRAPHC KT_TRAIN KT_LAUNCH TRAIN_CHECK WORKDIR [RUNS|all] [SEED]
#                            [FILTER]
#   RUNS: that many cases drawn (seeded), a third each of failures, kills and stops
#   (ctest: 20; the issue: 100); all: every case once (247 runs). FILTER: an extended regex
#   the cases ("fail forward 3 1", "STOP save - 2") must match. Prints "N runs, H hangs, F
#   failures".
set -uo pipefail
graphc=$1 train=$2 launch=$3 check=$4 work=$5 runs=${6:-20} seed=${7:-32} filter=${8:-}
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$work" && cd "$work" || exit 1
rm -rf cases && mkdir cases
deadline=4000 # the communicator's (ms); a survivor must be out within it plus the margin
margin=4000
W=3

if ! "$graphc" "$src/examples/lm.ktg" -o lm3.ktp -D T=16 -D H=32 -D VOCAB=64 -D E=4 -D L=2 \
       -D K=4 -D TOPK=2 > /dev/null; then
  echo "FAIL: kt-graphc examples/lm.ktg"; exit 1
fi
python3 - << 'EOF' || { echo "FAIL: writing the tokens"; exit 1; }
import random
r = random.Random(7)
open("tokens.bin", "wb").write(bytes(r.randrange(64) for _ in range(4096)))
EOF
args=(lm3.ktp --data tokens.bin --data-format u8 --threads 1 --log-every 1 --optimizer sgd
      --lr 0.5 --seed 3)

# how many op kernels each phase runs (the hook's own error says it)
count_ops() {
  KT_FAULT="phase=$1,op=999999" "$train" "${args[@]}" --steps 1 2>&1 |
    sed -n 's/.*the '"$1"' runs \([0-9]*\) op kernels.*/\1/p'
}
nf=$(count_ops forward) nb=$(count_ops backward)
# a good --save file for the final-save cases to overwrite
timeout 60 "$launch" -n $W --timeout-ms 20000 -- "$train" "${args[@]}" --steps 1 \
  --save good.safetensors > good.log 2>&1 || { echo "FAIL: the good save"; cat good.log; exit 1; }
if [ -z "$nf" ] || [ -z "$nb" ]; then echo "FAIL: cannot count the ops"; exit 1; fi
echo "the 2-layer example runs $nf forward and $nb backward op kernels"

cases=()
for r in 0 1 2; do
  for i in $(seq 0 $((nf - 1))); do cases+=("fail forward $i $r"); done
  for i in $(seq 0 $((nb - 1))); do cases+=("fail backward $i $r"); done
  cases+=("fail step - $r")
  [ $r = 0 ] && cases+=("fail save - 0") # only rank 0 saves
  for sig in KILL STOP; do
    for ph in forward backward step save final; do cases+=("$sig $ph - $r"); done
  done
done
if [ -n "$filter" ]; then # only the cases that match (to rerun one kind)
  mapfile -t cases < <(printf '%s\n' "${cases[@]}" | grep -E -- "$filter")
fi
if [ "$runs" = all ]; then
  list=("${cases[@]}")
else
  # a third each of failures, kills and stops (the failures outnumber the others 9 to 1)
  RANDOM=$seed
  list=()
  for k in $(seq "$runs"); do
    kinds=(fail KILL STOP)
    mapfile -t pool < <(printf '%s\n' "${cases[@]}" | grep "^${kinds[$((k % 3))]} ")
    [ ${#pool[@]} -eq 0 ] && pool=("${cases[@]}")
    list+=("${pool[$((RANDOM % ${#pool[@]}))]}")
  done
fi

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
n=0 hangs=0 failures=0
bad() { failures=$((failures + 1)); echo "FAIL: $*"; }

# run_job DIR ENV...: the 3-rank job in the background (pid in $job); each rank's kt-train pid
# goes to DIR/pid.R and its exit status to DIR/rc.R
run_job() {
  local d=$1; shift
  env "$@" timeout -k 2 40 "$launch" -n $W --keep-going --timeout-ms $deadline --grace-ms 500 -- \
    sh -c '"$@" < /dev/null & echo $! > "$0/pid.$KT_RANK"; wait $!; echo $? > "$0/rc.$KT_RANK"' \
    "$d" "$train" "${args[@]}" "${extra[@]}" > "$d/out" 2>&1 &
  job=$!
}

for c in "${list[@]}"; do
  read -r kind phase op rank <<< "$c"
  n=$((n + 1))
  d=cases/$n; mkdir -p "$d"
  echo "$c" > "$d/case"
  extra=(--steps 3)
  [ "$phase" = save ] && extra=(--steps 3 --run-dir "$d/run" --save-every 1)
  t0=$(now_ms)
  if [ "$kind" = fail ]; then
    spec="rank=$rank,step=2,phase=$phase"; [ "$op" != - ] && spec+=",op=$op"
    run_job "$d" KT_FAULT="$spec"
    wait "$job"; rc=$?
    el=$(( $(now_ms) - t0 ))
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && { hangs=$((hangs + 1)); bad "$c: a hang"; continue; }
    roots=$(sed -n 's/^\[rank \([0-9]\)\] kt-train: rank \1 stops: //p' "$d/out" | sort -u)
    want="rank $rank: step 2: "; [ "$phase" = save ] && want="rank 0: "
    okr=1
    for r in 0 1 2; do [ "$(cat "$d/rc.$r" 2> /dev/null)" = 1 ] || okr=0; done
    if [ $okr != 1 ] || [ "$(grep -c "kt-train: rank [0-2] stops: " "$d/out")" -ne $W ] ||
       [ "$(wc -l <<< "$roots")" -ne 1 ] || [ "${roots#"$want"}" = "$roots" ] ||
       ! grep -q "injected failure" <<< "$roots" || [ $el -gt $((deadline + margin)) ]; then
      bad "$c: after $el ms, exit statuses $(cat "$d"/rc.* 2> /dev/null | tr '\n' ' ')"
      sed 's/^/    /' "$d/out" | grep -v '\] step [0-9]' | tail -12
    fi
    continue
  fi
  # kill / stop: the victim holds (30 s) where the case says, the test signals it there
  holder=$rank where="phase=$phase"
  case $phase in save | final) holder=0 ;; esac
  if [ "$phase" = save ]; then
    rm -rf "$d/run"; extra=(--steps 3 --run-dir "$d/run" --save-every 1)
  elif [ "$phase" = final ]; then # the last step is 2: the save after it is the final one
    where="phase=save" extra=(--steps 2 --save "$d/out.safetensors")
    cp good.safetensors "$d/out.safetensors"
  fi
  hold=30000; [ "$holder" != "$rank" ] && hold=2000 # rank 0 saves, then sees the loss
  run_job "$d" KT_FAULT="rank=$holder,step=2,$where,hold=$hold"
  # in the hold once step 1 is over on rank 0 (it prints it) and a moment has passed
  for _ in $(seq 200); do
    grep -q '^\[rank 0\] step 1/' "$d/out" 2> /dev/null && break
    kill -0 "$job" 2> /dev/null || break
    sleep 0.05
  done
  sleep 0.5
  pid=$(cat "$d/pid.$rank" 2> /dev/null)
  tk=$(now_ms)
  if [ -z "$pid" ] || ! kill -"$kind" "$pid" 2> /dev/null; then
    bad "$c: the rank was not there to signal"; wait "$job"; continue
  fi
  # the job ends when the survivors have; a stopped rank never does: it is killed once they
  # are out (or at the 40 s limit)
  rc=0
  if [ "$kind" = STOP ]; then
    for _ in $(seq 400); do
      out=0
      for r in 0 1 2; do [ "$r" = "$rank" ] || [ -e "$d/rc.$r" ] && out=$((out + 1)); done
      [ $out -eq $W ] && break
      sleep 0.1
    done
    [ $out -eq $W ] || rc=124
    el=$(( $(now_ms) - tk ))
    kill -KILL "$pid" 2> /dev/null
    wait "$job"
  else
    wait "$job"; rc=$?
    el=$(( $(now_ms) - tk ))
  fi
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && { hangs=$((hangs + 1)); bad "$c: a hang"; continue; }
  okr=1 named=1
  for r in 0 1 2; do
    [ "$r" = "$rank" ] && continue
    # a rank lost after its part of the final save's agreement was in: the run's work is
    # done (rank 0 saved), and a survivor that got every message it needed may end well
    [ "$phase" = final ] && [ "$(cat "$d/rc.$r" 2> /dev/null)" = 0 ] &&
      grep -q '^\[rank 0\] kt-train: saved' "$d/out" && continue
    [ "$(cat "$d/rc.$r" 2> /dev/null)" = 1 ] || okr=0
    # the first rank the survivor's message names is the victim (not a rank passing it on)
    first=$(sed -n "s/^\[rank $r\] kt-train: rank $r stops: //p" "$d/out" | grep -o -E 'peer [0-9]+' | head -1)
    [ "$first" = "peer $rank" ] || named=0
  done
  allow=$((deadline + margin)); [ "$holder" != "$rank" ] && allow=$((allow + hold))
  if [ $okr != 1 ] || [ $named != 1 ] || [ $el -gt $allow ]; then
    bad "$c: survivors out after $el ms, exit statuses $(cat "$d"/rc.* 2> /dev/null | tr '\n' ' '), named $named"
    sed 's/^/    /' "$d/out" | grep -v '\] step [0-9]' | tail -12
    continue
  fi
  if [ "$phase" = final ]; then
    left=$(ls -A "$d" | grep -v -E '^(out|out.safetensors|case|pid\..|rc\..)$' | tr '\n' ' ')
    if [ "$rank" = 0 ] && ! cmp -s "$d/out.safetensors" good.safetensors; then
      bad "$c: the --save file changed although its writer was killed"
    elif ! "$check" params "$d/out.safetensors" "$d/out.safetensors" 0 > /dev/null; then
      bad "$c: the --save file does not load"
    elif [ -n "$left" ]; then
      bad "$c: left beside the --save file: $left"
    fi
  fi
  if [ "$phase" = save ]; then # the newest checkpoint left must resume (one more step)
    if ! timeout 60 "$launch" -n $W --timeout-ms 20000 -- "$train" --resume "$d/run" \
           "${args[@]:1}" --steps 3 > "$d/resume.out" 2>&1; then
      bad "$c: the run directory does not resume"; sed 's/^/    /' "$d/resume.out" | tail -5
    fi
  fi
done
echo "$n runs, $hangs hangs, $failures failures"
[ $failures -eq 0 ]
