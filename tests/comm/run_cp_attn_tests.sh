#!/usr/bin/env bash
# Context-parallel attention through kt-launch: cp_attention on 2, 3 and 4 ranks over shared
# memory and TCP (loopback), both layouts, f32 (trained: outputs and gradients) and bf16
# (frozen: outputs). Every rank compares its shard with the one-rank attention on the whole
# sequence that it computes itself.
#
# usage: run_cp_attn_tests.sh KT_LAUNCH CP_ATTN_RANK_TEST
set -uo pipefail
launch=$1 rank_test=$2
failures=0 total=0
for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  for n in 2 3 4; do
    for sc in "f32 balanced" "f32 contiguous" "bf16 balanced"; do
      total=$((total + 1))
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
        echo "ok: $tr n=$n $sc: $(grep -m1 "PASS rank 0" <<< "$out" | sed 's/.*worst/worst/')"
      fi
    done
  done
done
echo "$((total - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
