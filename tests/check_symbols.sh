#!/usr/bin/env bash
# Only public names may be global in libkt.a: kt_ for the API and kt__ for cross-file
# internals. A static archive cannot hide symbols, so a stray global collides with the
# application's own names at link time.
# usage: check_symbols.sh path/to/libkt.a
set -euo pipefail
lib=$1
# (__odr_asan.* are AddressSanitizer's one-definition-rule markers of a sanitizer build)
syms=$(nm -g --defined-only "$lib" | awk 'NF == 3 { print $3 }' | grep -v '^__odr_asan\.' |
       sort -u)
count=$(printf '%s\n' "$syms" | grep -c . || true)
bad=$(printf '%s\n' "$syms" | grep -v -E '^kt_' || true)
if [ -n "$bad" ]; then
  echo "FAIL: global symbols without the kt_ prefix in $lib:"
  printf '  %s\n' $bad
  exit 1
fi
[ "$count" -gt 0 ] || { echo "FAIL: no global symbols found in $lib"; exit 1; }
echo "ok: all $count global symbols in $(basename "$lib") start with kt_"
