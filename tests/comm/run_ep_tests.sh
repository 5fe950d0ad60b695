#!/usr/bin/env bash
# The moe op over several ranks through kt-launch: ranks with different row counts (rank-0
# and expert-parallel modes), and AdamW steps with expert parallelism (full, LoRA and frozen
# experts; consecutive ranges of 7 experts or a placement map) and the rank-0 mode, with 2, 3
# and 4 ranks over shared memory and TCP (loopback). Every rank compares its part with the
# one-rank run it computes itself.
#
# usage: run_ep_tests.sh KT_LAUNCH EP_RANK_TEST
set -uo pipefail
launch=$1 rank_test=$2
failures=0 total=0
for tr in shm tcp; do
  if [ "$tr" = tcp ]; then export UCX_NET_DEVICES=lo; else unset UCX_NET_DEVICES; fi
  for n in 2 3 4; do
    for sc in "varlen rank0" "varlen ep" "train ep full" "train ep lora" "train ep frozen" \
              "train ep full map" "train ep lora map" "train rank0 full"; do
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
        echo "ok: $tr n=$n $sc"
      fi
    done
  done
done
echo "$((total - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
