#!/usr/bin/env bash
# Reliability of multi-rank jobs (issue 27), through kt-launch and comm_rank_test:
#  - two 2-rank jobs on one fixed rendezvous port, TRIALS seeded trials (each job's ranks
#    start after seeded delays): every job either trains correctly (all its ranks see only
#    its own token) or fails with an error naming the jobs; never a world of mixed jobs
#  - a stopped kt-launch (SIGSTOP) does not stall its ranks, and a full output pipe nobody
#    reads does not either (lines are dropped, and said so)
#  - a rank that dies or stops before the rendezvous ends the job in seconds, not the 60 s
#    default deadline
#  - a garbage answer at the rendezvous is shown with its address; a point-to-point timeout
#    names the message's number, tag and peer
#
# usage: run_reliability_tests.sh KT_LAUNCH COMM_RANK_TEST [TRIALS]   (ctest: 12; issue: 50)
set -uo pipefail
launch=$1 rank_test=$2 trials=${3:-12}
failures=0
dir=$(mktemp -d)
t_suite=$(date +%s.%N)

bad() { echo "FAIL: $*"; failures=$((failures + 1)); }

# ---- messages -------------------------------------------------------------------------------
for sc in garbage p2pseq; do
  out=$(timeout 30 "$launch" -n 2 --timeout-ms 1500 --keep-going -- "$rank_test" "$sc" 2>&1)
  if [ "$(grep -c 'PASS rank' <<< "$out")" -ne 2 ]; then
    bad "$sc"; sed 's/^/    /' <<< "$out"
  else
    echo "ok: $sc: $(grep 'PASS rank 1' <<< "$out" | sed 's/.*PASS rank 1 [a-z0-9]*: //')"
  fi
done

# ---- two jobs on one port -------------------------------------------------------------------
port=$("$launch" -n 1 -- sh -c 'echo $KT_MASTER_PORT' | sed 's/^\[rank 0\] //')
RANDOM=27
both_ok=0 one_refused=0 both_refused=0
t0=$(date +%s)
for t in $(seq "$trials"); do
  for j in a b; do
    d0=$((RANDOM % 300000)) d1=$((RANDOM % 300000))
    tok=$((t * 2)); [ "$j" = b ] && tok=$((tok + 1))
    TEST_TOKEN=$tok timeout 30 "$launch" -n 2 --port "$port" \
      --timeout-ms 3000 -- sh -c "TEST_DELAY_US=\$((KT_RANK == 0 ? $d0 : $d1)) exec $rank_test jobs" \
      > "$dir/job.$j" 2>&1 &
    eval "pid_$j=\$!"
  done
  # shellcheck disable=SC2154
  wait "$pid_a"; rc_a=$?
  wait "$pid_b"; rc_b=$?
  refused=0
  for j in a b; do
    eval "rc=\$rc_$j"
    if grep -q WRONG "$dir/job.$j"; then
      bad "trial $t: job $j trained with another job's ranks"; sed 's/^/    /' "$dir/job.$j"
    elif [ "$rc" -eq 0 ] && [ "$(grep -c 'PASS rank' "$dir/job.$j")" -eq 2 ]; then
      :
    elif [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q "REFUSED rank.* job '" "$dir/job.$j"; then
      refused=$((refused + 1))
    else
      bad "trial $t: job $j exit $rc without the result or an error naming the jobs"
      sed 's/^/    /' "$dir/job.$j"
    fi
  done
  case $refused in 0) both_ok=$((both_ok + 1)) ;; 1) one_refused=$((one_refused + 1)) ;;
                   *) both_refused=$((both_refused + 1)) ;; esac
  [ "$t" -eq 1 ] || [ "$refused" -eq 0 ] || example=$(grep -h REFUSED "$dir"/job.* | head -1)
done
echo "ok?: two jobs on port $port, $trials trials in $(($(date +%s) - t0)) s: both trained" \
  "$both_ok, one refused $one_refused, both refused $both_refused (never mixed unless FAIL above)"
[ -n "${example:-}" ] && echo "    e.g. ${example}"

# ---- output never stalls a rank -------------------------------------------------------------
# waits up to $1 s for the ranks' marker files done.0 and done.1
markers() {
  for _ in $(seq $(($1 * 10))); do
    [ -e "$dir/done.0" ] && [ -e "$dir/done.1" ] && return 0
    sleep 0.1
  done
  return 1
}
flood="yes 0123456789012345678901234567890123456789 | head -n 100000"
rm -f "$dir"/done.*
"$launch" -n 2 --timeout-ms 5000 -- sh -c "$flood; $rank_test collectives && touch $dir/done.\$KT_RANK" \
  > "$dir/stopped.out" 2>&1 &
lpid=$!
sleep 0.2
kill -STOP "$lpid"
if markers 20; then ranks_done=1; else ranks_done=0; fi
kill -CONT "$lpid"
wait "$lpid"; rc=$?
lines=$(grep -c '^\[rank [01]\] 0123456789' "$dir/stopped.out")
if [ "$ranks_done" -ne 1 ] || [ "$rc" -ne 0 ] || [ "$lines" -ne 200000 ]; then
  bad "ranks of a stopped kt-launch (finished: $ranks_done, exit $rc, $lines of 200000 lines)"
  grep -v 0123456789 "$dir/stopped.out" | head -20 | sed 's/^/    /'
else
  echo "ok: the ranks of a SIGSTOPped kt-launch finish, and after SIGCONT it prints all 200000 lines"
fi

rm -f "$dir"/done.*
mkfifo "$dir/fifo"
exec 3<> "$dir/fifo" # holds the fifo open without reading it: the relay's output fills up
"$launch" -n 2 --timeout-ms 5000 -- sh -c "{ $flood; $flood; $flood; } >&2; $rank_test collectives && touch $dir/done.\$KT_RANK" \
  > "$dir/fifo.out" 2> "$dir/fifo" &
lpid=$!
if markers 30; then ranks_done=1; else ranks_done=0; fi
timeout 20 cat "$dir/fifo" > "$dir/fifo.err" &
cpid=$!
exec 3<&-
wait "$lpid"; rc=$?
wait "$cpid"
if [ "$ranks_done" -ne 1 ] || [ "$rc" -ne 0 ] || [ "$(grep -c 'PASS rank' "$dir/fifo.out")" -ne 2 ] ||
   ! grep -q 'line(s) of output dropped here' "$dir/fifo.err"; then
  bad "ranks writing to an unread pipe (finished: $ranks_done, exit $rc)"
  grep -v 0123456789 "$dir/fifo.out" "$dir/fifo.err" | head -20 | sed 's/^/    /'
else
  echo "ok: ranks writing to an unread pipe finish; the relay dropped lines and said so"
fi

# ---- a rank lost before the rendezvous --------------------------------------------------------
# (no --timeout-ms: the communicator's deadline is the default 60 s)
for how in "kill -KILL \$\$" "kill -STOP \$\$"; do
  t0=$(date +%s.%N)
  out=$(timeout 70 "$launch" -n 2 --grace-ms 500 -- sh -c \
        "if [ \"\$KT_RANK\" = 1 ]; then $how; fi; exec $rank_test collectives" 2>&1)
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || awk -v s="$secs" 'BEGIN { exit !(s > 10) }' ||
     ! grep -q 'kt-launch: rank 1 was \(killed\|stopped\) by signal' <<< "$out"; then
    bad "rank 1 '$how' before the rendezvous: exit $rc after $secs s"; sed 's/^/    /' <<< "$out"
  else
    echo "ok: rank 1 '$how' before the rendezvous ends the job in $secs s (exit $rc):" \
      "$(grep -m1 'kt-launch: rank 1' <<< "$out")"
  fi
done

echo "reliability suite: $failures failure(s) in $(awk -v a="$t_suite" -v b="$(date +%s.%N)" \
  'BEGIN { printf "%.1f", b - a }') s"
rm -rf "$dir"
[ "$failures" -eq 0 ]
