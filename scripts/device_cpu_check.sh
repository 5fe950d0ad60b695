#!/usr/bin/env bash
# The CPU checks that need another machine's processor (AMX tiles: this development machine
# and CI have none), prepared so that one call of the workplace's device tool runs them all.
#
#   bash scripts/device_cpu_check.sh pack [BUILD]   here: BUILD's (default build) test and
#        bench binaries, with every shared library they load and the loader itself, into
#        .device-bundle/ (ignored by git; about 46 MB), so that they run whatever that
#        machine's libraries are (it has no OpenBLAS, cmocka or UCX; nothing can be fetched)
#   bash scripts/device_cpu_check.sh run            there (carry .device-bundle): the CPU's
#        flags, the AMX and kernel tests, kt-bench gemm and moe with AMX and with it hidden
#        (KT_CPU=noamx); one log, device_cpu_check.log, under $OUT (or out/)
#
# The device call, for instance:
#   run(command="bash scripts/device_cpu_check.sh run", carry=[".device-bundle"], timeout_s=420)
set -u
BUNDLE=.device-bundle
BINARIES="tests/test_amx_gemm tests/test_moe_gemm tests/test_moe tools/kt-bench"

pack() {
    local build=${1:-build}
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/lib" || return 1
    for b in $BINARIES; do
        [ -x "$build/$b" ] || { echo "missing $build/$b: build it first" >&2; return 1; }
        cp "$build/$b" "$BUNDLE/"
        ldd "$build/$b" | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}' |
            while read -r lib; do cp -L "$lib" "$BUNDLE/lib/"; done
    done
    echo "packed into $BUNDLE: $(du -sh "$BUNDLE" | cut -f1)"
}

# Runs a bundled binary through the bundled loader (so that its own libc is used) within a
# time limit: its whole output goes to the one log that comes back (the device tool returns
# at most 8 files), its last lines to the terminal.
step() {
    local name=$1 limit=$2 bin=$3
    shift 3
    echo "== $name" | tee -a "$LOG"
    timeout "$limit" "$BUNDLE"/lib/ld-linux-x86-64.so.2 --library-path "$BUNDLE/lib" \
        "$BUNDLE/$bin" "$@" >"$LOG.step" 2>&1
    local rc=$?
    cat "$LOG.step" >>"$LOG"
    tail -n 10 "$LOG.step"
    rm -f "$LOG.step"
    echo "== $name: rc $rc" | tee -a "$LOG"
}

run() {
    if [ ! -x "$BUNDLE/lib/ld-linux-x86-64.so.2" ]; then
        echo "no $BUNDLE: pack it here first" >&2
        return 1
    fi
    mkdir -p "${OUT:-out}"
    LOG=${OUT:-out}/device_cpu_check.log
    : >"$LOG"
    {
        echo "== cpu"
        grep -m1 "model name" /proc/cpuinfo
        echo "cores: $(nproc); amx flags:" \
            "$(grep -m1 -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | tr '\n' ' ')"
    } | tee -a "$LOG"
    local threads kind cpu
    threads=$(nproc)
    [ "$threads" -gt 16 ] && threads=16
    step test_amx_gemm 120 test_amx_gemm
    KT_CPU=noamx step test_amx_gemm_noamx 60 test_amx_gemm
    step test_moe_gemm 120 test_moe_gemm
    step test_moe 120 test_moe
    # each kernel and the layer on the path chosen there (AMX where it has it), then with AMX
    # hidden (the AVX-512 BF16 kernels) for the comparison
    for cpu in default noamx; do
        for kind in nt nn tn; do
            KT_CPU=${cpu/default/} step "gemm_${kind}_96_$cpu" 60 kt-bench gemm --m 96 --n 1408 \
                --k 2048 --kind "$kind" --threads "$threads" --no-peer
        done
        KT_CPU=${cpu/default/} step "moe_full_1024_$cpu" 120 kt-bench moe --shape dsv2lite \
            --qlen 1024 --mode full --dtype bf16 --threads "$threads" --no-peer --phases
    done
}

case "${1:-}" in
pack) shift; pack "$@" ;;
run) run ;;
*) sed -n '2,14p' "$0"; [ "${1:-}" = --help ] ;;
esac
