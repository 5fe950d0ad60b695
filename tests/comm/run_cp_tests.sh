#!/usr/bin/env bash
# Multi-rank graph ops through kt-launch: the context-parallel halo exchange (point-to-point
# and all-gather modes, f32 and bf16) and the distributed MoE, with 2, 3 and 4 ranks over shared memory and
# TCP (loopback). Every rank compares its shard with the single-rank result it computes itself.
#
# usage: run_cp_tests.sh KT_LAUNCH CP_RANK_TEST
set -uo pipefail
launch=$1 rank_test=$2
failures=0
for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  for n in 2 3 4; do
    for sc in "halo p2p" "halo allgather" "halo p2p bf16" "halo allgather bf16" "moe" "moe_fail" \
              "moe_fail_bwd"; do
      # shellcheck disable=SC2086
      out=$(timeout 120 "$launch" -n "$n" --transport "$tr" --timeout-ms 20000 -- \
            "$rank_test" $sc 2>&1)
      rc=$?
      passes=$(grep -c "PASS rank" <<< "$out")
      if [ "$rc" -ne 0 ] || [ "$passes" -ne "$n" ]; then
        echo "FAIL: $tr n=$n $sc (exit $rc, $passes of $n PASS)"
        sed 's/^/    /' <<< "$out"
        failures=$((failures + 1))
      else
        echo "ok: $tr n=$n $sc"
      fi
    done
  done
done
total=42
echo "$((total - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
