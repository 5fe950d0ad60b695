#!/usr/bin/env bash
# Bit-for-bit comparison of two builds of libkt (a refactor's before and after):
#   bash scripts/bitexact/compare.sh OLD_BUILD NEW_BUILD [--quick]
# Compares the MoE layer over a grid of configurations (golden.c), kt-run forward and
# backward on every example without MoE ops (same inputs), and, unless --quick, the main
# job's 200-step losses and saved tensors on the same text. Both builds must be of this
# machine (the kernels chosen depend on the CPU). Exit status 0: every result the same.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd) root=$(cd "$here/../.." && pwd)
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd) quick=${3:-}
work=$(mktemp -d /tmp/bitexact.XXXXXX)
export KT_NUM_THREADS=2
fail=0
libs() { # the link flags of a build: its kt.pc's backends, without the library itself
  PKG_CONFIG_PATH="$1" pkg-config --libs kt 2>/dev/null | sed 's/-L[^ ]* -lkt//' ||
    echo "-lopenblas -lnuma -lucp -luct -lucs -lucm -ldl -lpthread -lm"
}
for side in old new; do
  b=${!side}
  # shellcheck disable=SC2046
  gcc -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -I"$b/../include" -I"$root/include" "$here/golden.c" \
      "$b/libkt.a" $(libs "$b") -o "$work/golden.$side" ||
    { echo "bitexact: cannot build golden.c against $b"; exit 1; }
done
same() { # what, file, file
  if cmp -s "$2" "$3"; then echo "  same: $1"; else echo "  DIFFERENT: $1"; diff "$2" "$3" | head -8; fail=1; fi
}
echo "bitexact: the MoE layer grid"
for side in old new; do "$work/golden.$side" moe > "$work/moe.$side" || fail=1; done
same "MoE grid ($(wc -l < "$work/moe.old") results)" "$work/moe.old" "$work/moe.new"
echo "bitexact: kt-run on the examples"
for ktg in "$root"/examples/*.ktg; do
  name=$(basename "$ktg" .ktg)
  grep -q "moe(" "$ktg" && continue # kt-run creates no MoE layers; the main job covers them
  for side in old new; do
    b=${!side}
    "$b/tools/kt-graphc" "$ktg" -o "$work/$name.$side.ktp" > /dev/null || { fail=1; continue 2; }
  done
  "$work/golden.old" inputs "$work/$name.old.ktp" "$work/$name.inputs.safetensors" || { fail=1; continue; }
  for side in old new; do
    b=${!side}
    "$b/tools/kt-run" "$work/$name.$side.ktp" --inputs "$work/$name.inputs.safetensors" --allow-missing \
        --backward --threads 2 --out "$work/$name.$side.out" > /dev/null 2>&1 ||
      { echo "  kt-run $name ($side) failed"; fail=1; continue 2; }
    "$work/golden.$side" hash "$work/$name.$side.out" | sort > "$work/$name.$side.hash"
  done
  same "kt-run $name" "$work/$name.old.hash" "$work/$name.new.hash"
done
if [ "$quick" != --quick ]; then
  echo "bitexact: the main job (200 steps)"
  cat "$root"/README.md "$root"/docs/*.md "$root"/examples/*.ktg > "$work/text.bin"
  for side in old new; do
    b=${!side}
    "$b/tools/kt-graphc" "$root/examples/lm.ktg" -o "$work/lm.$side.ktp" -D T=256 > /dev/null &&
    "$b/tools/kt-train" "$work/lm.$side.ktp" --data "$work/text.bin" --data-format u8 --steps 200 \
        --log-every 100 --losses "$work/losses.$side" --save "$work/lm.$side.safetensors" --threads 2 \
        > "$work/train.$side.log" 2>&1 || { echo "  kt-train ($side) failed"; fail=1; }
    "$work/golden.$side" hash "$work/lm.$side.safetensors" | sort > "$work/lm.$side.hash"
  done
  same "main job losses" "$work/losses.old" "$work/losses.new"
  same "main job saved tensors" "$work/lm.old.hash" "$work/lm.new.hash"
fi
if [ $fail = 0 ]; then echo "bitexact: ALL SAME"; rm -rf "$work"; else echo "bitexact: DIFFERENT (kept $work)"; fi
exit $fail
