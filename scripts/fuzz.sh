#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, in build-fuzz) and runs each one for a
# while on its seed corpus. Fails when libFuzzer reports a crash, a hang (-timeout), a leak
# or running out of memory; the reproducer is left in build-fuzz/fuzz/artifacts/.
#
# usage: scripts/fuzz.sh [SECONDS]      seconds per fuzzer (default 60)
#   KT_JOBS      build parallelism (default 2)
#   KT_FUZZ_DIR  build directory (default build-fuzz)
#
# Reproduce a finding: build-fuzz/fuzz/<fuzzer> build-fuzz/fuzz/artifacts/<file>
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
case "$secs" in
  ''|*[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac
jobs=${KT_JOBS:-2}
dir=${KT_FUZZ_DIR:-build-fuzz}

bash scripts/setup.sh
echo "== libkt: fuzz build in $dir"
# Only the portable code paths: the optional backends add nothing the fuzzers reach and
# their allocations (libnuma) would hide memory errors from ASan.
cmake -S . -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DKT_FUZZ=ON -DKT_SANITIZE=ON -DKT_BUILD_TESTS=OFF -DKT_BUILD_TOOLS=OFF \
      -DKT_WITH_OPENBLAS=OFF -DKT_WITH_NUMA=OFF -DKT_WITH_UCX=OFF -DKT_WITH_CUDA=OFF \
      > "$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j "$jobs"

list="$dir/fuzz/fuzzers.txt"
[ -s "$list" ] || { echo "fuzz: no fuzzers listed in $list" >&2; exit 1; }
artifacts="$dir/fuzz/artifacts"
mkdir -p "$artifacts"

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

failed=()
summary=()
while IFS=$'\t' read -r name exe seeds; do
  [ -n "$name" ] || continue
  work="$dir/fuzz/work/$name" # what the fuzzer finds; the seed directory is only read
  mkdir -p "$work"
  log="$dir/fuzz/$name.log"
  echo "== fuzz: $name for ${secs} s (seeds: $seeds)"
  rc=0
  "$exe" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -detect_leaks=1 -close_fd_mask=2 \
         -print_final_stats=1 -artifact_prefix="$artifacts/$name-" \
         "$work" "$seeds" > "$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  cov=$(grep -E '^#[0-9]+' "$log" | tail -n 1 | grep -oE 'cov: [0-9]+' || true)
  if [ "$rc" -ne 0 ] || grep -qE '^==[0-9]+==ERROR|ERROR: libFuzzer|SUMMARY: (Address|Undefined|Leak)Sanitizer|runtime error:' "$log"; then
    echo "fuzz: $name FAILED (exit $rc); the end of $log:" >&2
    tail -n 60 "$log" >&2
    failed+=("$name")
  fi
  summary+=("$name: ${runs:-?} runs, ${rate:-?} exec/s, ${cov:-cov: ?} (exit $rc)")
done < "$list"

echo "== fuzz summary (${secs} s each)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (reproducers in $artifacts)" >&2
  exit 1
fi
echo "fuzz: no crash, hang or leak"
