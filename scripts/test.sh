#!/usr/bin/env bash
# Builds libkt and runs its test suite (ctest). Installs the Debian packages first
# (idempotent), so it works on a fresh machine.
#
# usage: scripts/test.sh [default|embedded|sanitize]
#   default   every optional backend that is installed (OpenBLAS, libnuma, UCX, CUDA)
#   embedded  every backend off: portable kernels, one rank
#   sanitize  default backends, built with AddressSanitizer + UndefinedBehaviorSanitizer
set -euo pipefail
cd "$(dirname "$0")/.."

config=${1:-default}
jobs=${KT_JOBS:-2}
case "$config" in
  default)  dir=build;          flags=(-DCMAKE_BUILD_TYPE=Release) ;;
  embedded) dir=build-embedded; flags=(-DCMAKE_BUILD_TYPE=Release -DKT_WITH_OPENBLAS=OFF
                                       -DKT_WITH_NUMA=OFF -DKT_WITH_UCX=OFF -DKT_WITH_CUDA=OFF) ;;
  sanitize) dir=build-asan;     flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKT_SANITIZE=ON) ;;
  *) echo "usage: $0 [default|embedded|sanitize]" >&2; exit 2 ;;
esac

bash scripts/setup.sh
echo "== libkt: $config build in $dir"
start=$(date +%s)
cmake -S . -B "$dir" "${flags[@]}" > "$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
grep -- "-- libkt" "$dir.configure.log" || true
cmake --build "$dir" -j "$jobs"
echo "== built in $(( $(date +%s) - start )) s; libkt.a is $(stat -c %s "$dir/libkt.a") bytes"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$dir" --output-on-failure -j "$jobs"
