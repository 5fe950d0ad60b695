#!/usr/bin/env bash
# Compares two builds of kt-bench on one MoE configuration, alternating them (A, B, A, B, ...)
# with a rest between runs, and prints each build's medians: the forward, forward+backward
# and every phase of the forward+backward. This VM's speed drifts by the minute, so runs of
# one build after the other compare the minutes, not the builds; alternating runs do not.
#
# usage: scripts/bench_ab.sh A_KT_BENCH B_KT_BENCH [ROUNDS] [REST_S] -- MOE_ARGS...
#   e.g. scripts/bench_ab.sh /tmp/kb_old build/tools/kt-bench 4 5 -- \
#            --shape dsv2lite --qlen 1024 --mode full --dtype bf16 --threads 2
# ROUNDS defaults to 4 (runs per build), REST_S to 5 seconds. The PyTorch peer is not run.
set -euo pipefail
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  usage
  exit 0
fi
[ $# -ge 3 ] || { usage >&2; exit 2; }
a=$1 b=$2
shift 2
rounds=4 rest=5
if [ "$1" != "--" ]; then rounds=$1; shift; fi
if [ "$1" != "--" ]; then rest=$1; shift; fi
[ "${1:-}" = "--" ] || { usage >&2; exit 2; }
shift
for bin in "$a" "$b"; do
  [ -x "$bin" ] || { echo "bench_ab.sh: $bin is not an executable" >&2; exit 2; }
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((r = 1; r <= rounds; r++)); do
  for side in A B; do
    bin=$a
    [ "$side" = B ] && bin=$b
    echo "bench_ab.sh: round $r/$rounds, build $side" >&2
    # one line per run: name=value pairs (fwd, fwdbwd, then the fwd+bwd phases)
    "$bin" moe "$@" --phases --no-peer 2>&1 | awk '
      / fwd: /     { for (i = 1; i <= NF; i++) if ($i == "fwd:") line = "fwd=" $(i + 1) }
      / fwd\+bwd: / { for (i = 1; i <= NF; i++) if ($i == "fwd+bwd:") line = line " fwdbwd=" $(i + 1) }
      /^phases fwd\+bwd/ {
        sub(/^[^:]*: /, "")
        n = split($0, ph, ", ")
        for (i = 1; i <= n; i++) { split(ph[i], kv, " "); line = line " " kv[1] "=" kv[2] }
      }
      END { print line }' >> "$out/$side"
    sleep "$rest"
  done
done

# medians per name, A and B side by side
awk '
  function median(list,   v, n, i, j, t) {
    n = split(list, v, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
    return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
  }
  {
    side = FILENAME ~ /\/A$/ ? "A" : "B"
    for (i = 1; i <= NF; i++) {
      split($i, kv, "=")
      if (!(kv[1] in seen)) { seen[kv[1]] = 1; order[++count] = kv[1] }
      vals[side, kv[1]] = vals[side, kv[1]] " " kv[2]
    }
  }
  END {
    printf "%-14s %10s %10s %8s   (ms, median of each build'"'"'s runs)\n", "", "A", "B", "B/A"
    for (k = 1; k <= count; k++) {
      name = order[k]
      ma = median(vals["A", name]); mb = median(vals["B", name])
      ratio = ma > 0 ? mb / ma : 0
      printf "%-14s %10.2f %10.2f %8.3f\n", name, ma, mb, ratio
    }
  }' "$out/A" "$out/B"
