#!/usr/bin/env bash
# The multi-rank communicator suite: comm_rank_test scenarios through kt-launch with 2, 3
# and 4 ranks, over shared memory and over TCP (loopback only). Correctness scenarios must
# end with kt-launch exiting 0 and every rank printing PASS; fault scenarios (a rank killed,
# stopped, absent, or calling a different collective) need a PASS from every other rank:
# each checks its own error, its deadline and that the message names the faulty peer. And
# the rendezvous: a rank that believes in another world size (every rank told so), and an
# idle connection to the master's port (the others join anyway).
#
# usage: run_comm_tests.sh KT_LAUNCH COMM_RANK_TEST
set -uo pipefail
launch=$1 rank_test=$2
timeout_ms=2500
failures=0
t_suite=$(date +%s.%N)

run() { # run TRANSPORT N SCENARIO EXPECTED_PASSES MUST_EXIT_0
  local tr=$1 n=$2 sc=$3 want=$4 exit0=$5 out rc passes t0 t1
  t0=$(date +%s.%N)
  out=$(timeout 60 "$launch" -n "$n" --transport "$tr" --timeout-ms "$timeout_ms" --keep-going \
        -- "$rank_test" "$sc" 2>&1)
  rc=$?
  t1=$(date +%s.%N)
  passes=$(grep -c "PASS rank" <<< "$out")
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  if [ "$rc" -eq 124 ] || [ "$passes" -ne "$want" ] || grep -q "FAIL rank" <<< "$out" ||
     { [ "$exit0" = 1 ] && [ "$rc" -ne 0 ]; }; then
    echo "FAIL: $tr n=$n $sc (exit $rc, $passes of $want PASS, ${secs} s)"
    sed 's/^/    /' <<< "$out"
    failures=$((failures + 1))
  else
    echo "ok: $tr n=$n $sc (${secs} s)"
  fi
}

for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  for n in 2 3 4; do
    for sc in p2p ring collectives agree; do
      run "$tr" "$n" "$sc" "$n" 1
    done
    run "$tr" "$n" mismatch "$n" 0
    run "$tr" "$n" kill $((n - 1)) 0
    run "$tr" "$n" stop $((n - 1)) 0
  done
  run "$tr" 3 a2a_mismatch 3 0
  run "$tr" 3 absent 2 0
  run "$tr" 3 worldsize 3 0
  run "$tr" 3 idle 3 1
done
unset UCX_NET_DEVICES

# launch_check WANT_RC MAX_SECONDS OK_TEXT FAIL_TEXT COMMAND...: the command (kt-launch in
# some form) exits WANT_RC within MAX_SECONDS
launch_check() {
  local want=$1 max=$2 ok_text=$3 fail_text=$4 t0 rc
  shift 4
  t0=$(date +%s)
  "$@" > /dev/null 2>&1
  rc=$?
  if [ "$rc" -ne "$want" ] || [ $(($(date +%s) - t0)) -gt "$max" ]; then
    echo "FAIL: $fail_text (exit $rc)"
    failures=$((failures + 1))
  else
    echo "ok: $ok_text"
  fi
}
# SIGTERM to a kt-launch started in the background, a second after its start
term_after_1s() {
  "$@" &
  local lpid=$!
  sleep 1
  kill -TERM "$lpid"
  wait "$lpid"
}

# kt-launch itself: a failing rank stops the others and its status is kt-launch's.
launch_check 7 10 "kt-launch exits with the failing rank's status and stops the others" \
  "kt-launch did not stop the ranks and exit 7" \
  "$launch" -n 3 --grace-ms 500 -- sh -c 'if [ "$KT_RANK" = 1 ]; then exit 7; fi; sleep 30'
# a process a rank leaves behind holding its output: stopped after the grace period, not
# waited for (nor spun on); and with it, SIGTERM to kt-launch stops it at once (exit 143; a
# shell's background job ignores SIGINT, which would wait for the grace period)
launch_check 0 5 "kt-launch stops what exited ranks left behind holding their output" \
  "kt-launch waited for what an exited rank left behind" \
  "$launch" -n 2 --grace-ms 300 -- sh -c 'sleep 30 & exit 0'
launch_check 143 5 "SIGTERM reaches what an exited rank left behind (exit 143)" \
  "SIGTERM to kt-launch with a rank's leftover process" \
  term_after_1s "$launch" -n 1 --grace-ms 20000 -- sh -c 'sleep 30 & exit 0'
# kt-launch killed by SIGKILL: the ranks' own processes get PR_SET_PDEATHSIG, and its guard
# process kills what they started (here each wrapper shell's sleep) within 3 seconds
orphan_dir=$(mktemp -d)
"$launch" -n 2 -- sh -c "sleep 300 & echo \$! > $orphan_dir/pid.\$KT_RANK; wait" \
  > /dev/null 2>&1 &
orphan_launch=$!
for _ in $(seq 100); do
  [ -s "$orphan_dir/pid.0" ] && [ -s "$orphan_dir/pid.1" ] && break
  sleep 0.1
done
kill -KILL "$orphan_launch"
wait "$orphan_launch" 2> /dev/null
orphans=-1
for _ in $(seq 30); do
  orphans=0
  for f in "$orphan_dir"/pid.*; do
    if [ -s "$f" ] && kill -0 "$(cat "$f")" 2> /dev/null; then orphans=$((orphans + 1)); fi
  done
  [ "$(ls "$orphan_dir" | wc -l)" -eq 2 ] && [ "$orphans" -eq 0 ] && break
  sleep 0.1
done
if [ "$(ls "$orphan_dir" | wc -l)" -ne 2 ] || [ "$orphans" -ne 0 ]; then
  echo "FAIL: after SIGKILL to kt-launch, $orphans of the ranks' children still run" \
    "($(ls "$orphan_dir" | wc -l) of 2 started)"
  failures=$((failures + 1))
else
  echo "ok: SIGKILL to kt-launch: what the ranks started is killed too"
fi
for f in "$orphan_dir"/pid.*; do kill -KILL "$(cat "$f")" 2> /dev/null; done
rm -rf "$orphan_dir"
out=$("$launch" -n 2 -- sh -c 'echo "hello $KT_RANK of $KT_WORLD_SIZE at $KT_MASTER_ADDR"')
if ! grep -q '^\[rank 1\] hello 1 of 2 at 127.0.0.1$' <<< "$out"; then
  echo "FAIL: kt-launch output prefix: $out"
  failures=$((failures + 1))
fi
out=$("$launch" --print-env -n 2 --port 4000 --timeout-ms 9000 hostA hostB)
if ! grep -q '^hostB: KT_RANK=3 KT_WORLD_SIZE=4 KT_MASTER_ADDR=hostA KT_MASTER_PORT=4000 '\
'KT_JOB_ID=kt-[0-9a-f]\{16\} KT_COMM_TIMEOUT_MS=9000$' <<< "$out" ||
   [ "$(grep -o 'KT_JOB_ID=[^ ]*' <<< "$out" | sort -u | wc -l)" -ne 1 ]; then
  echo "FAIL: kt-launch --print-env: $out"
  failures=$((failures + 1))
fi

echo "comm suite: $failures failure(s) in $(awk -v a="$t_suite" -v b="$(date +%s.%N)" \
  'BEGIN { printf "%.1f", b - a }') s"
[ "$failures" -eq 0 ]
