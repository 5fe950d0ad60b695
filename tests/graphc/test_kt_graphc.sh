#!/usr/bin/env bash
# kt-graphc's refusals: a budget with a sign is a usage error (strtoull would take "-5" as
# 2^64 - 5, an unlimited budget), and a program over --check-peak is not written (a build
# must not be left with what it was told to refuse).
#
# usage: test_kt_graphc.sh KT_GRAPHC EXAMPLES_DIR WORKDIR
set -uo pipefail
graphc=$1 examples=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir" || exit 1
failures=0
check() { # NAME WANT_RC COMMAND...
  local name=$1 want=$2
  shift 2
  "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    echo "FAIL: $name: exit $rc, want $want"
    sed 's/^/    /' "$dir/$name.log"
    failures=$((failures + 1))
  else
    echo "ok: $name: exit $rc: $(tail -n 1 "$dir/$name.log")"
  fi
}
check budget_negative 2 "$graphc" "$examples/mlp.ktg" -o "$dir/neg.ktp" --checkpoint budget:-5
[ -e "$dir/neg.ktp" ] && { echo "FAIL: budget_negative wrote a program"; failures=$((failures + 1)); }
# every:2 on lm.ktg plans a peak a little above its lower bound (ratio 1.000x, not 1)
check check_peak 1 "$graphc" "$examples/lm.ktg" -o "$dir/peak.ktp" --checkpoint every:2 \
  --check-peak 1.0
if [ -e "$dir/peak.ktp" ]; then
  echo "FAIL: check_peak: the refused program was written"
  failures=$((failures + 1))
fi
check check_peak_ok 0 "$graphc" "$examples/lm.ktg" -o "$dir/ok.ktp" --check-peak 1.10
[ -e "$dir/ok.ktp" ] || { echo "FAIL: check_peak_ok: no program"; failures=$((failures + 1)); }
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
