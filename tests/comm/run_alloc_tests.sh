#!/usr/bin/env bash
# Zero allocations after warm-up (alloc_rank_test): a 3-rank training step, and every
# collective at 2, 3 and 4 ranks over shared memory and TCP (loopback only).
#
# usage: run_alloc_tests.sh KT_LAUNCH ALLOC_RANK_TEST
set -uo pipefail
launch=$1 test=$2
failures=0
run() { # run TRANSPORT N SCENARIO
  local out rc
  out=$(timeout 60 "$launch" -n "$2" --transport "$1" --timeout-ms 5000 -- "$test" "$3" 2>&1)
  rc=$?
  if [ "$rc" -ne 0 ] || [ "$(grep -c "PASS rank" <<< "$out")" -ne "$2" ]; then
    echo "FAIL: $1 n=$2 $3 (exit $rc)"
    sed 's/^/    /' <<< "$out"
    failures=$((failures + 1))
  else
    local ucx
    ucx=$(grep -o 'UCX itself allocated [0-9]* times' <<< "$out" | head -1)
    echo "ok: $1 n=$2 $3 ($(grep -c '0 allocations' <<< "$out") checks at 0 allocations; $ucx)"
  fi
}
for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  run "$tr" 3 session
  for n in 2 3 4; do run "$tr" "$n" collectives; done
done
echo "alloc suite: $failures failure(s)"
[ "$failures" -eq 0 ]
