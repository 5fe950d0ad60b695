#!/usr/bin/env bash
# Installs the build into a scratch prefix and builds a tiny C program against it both ways:
# with pkg-config (kt.pc) and with CMake's find_package(kt).
# usage: check_install.sh BUILD_DIR SOURCE_DIR C_COMPILER
set -euo pipefail
build=$1 src=$2 cc=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
for f in lib/libkt.a include/kt/kt.h lib/pkgconfig/kt.pc lib/cmake/kt/ktConfig.cmake \
         share/kt/moe_torch_peer.py share/kt/comm_gloo_peer.py; do
  [ -f "$work/prefix/$f" ] || { echo "FAIL: $f was not installed"; exit 1; }
done

# kt.pc names no path of the build machine (each backend's own .pc brings its paths) and
# nothing of CUDA (the driver is loaded at run time): a consumer without the toolkit links
pc="$work/prefix/lib/pkgconfig/kt.pc"
if grep -Eq -- '-[LI]/|cuda' "$pc"; then
  echo "FAIL: kt.pc holds a build-machine path or CUDA:"; cat "$pc"; exit 1
fi

# every installed header on its own, in C and (where there is a C++ compiler) in C++: the
# headers carry extern "C" guards, so they must also be valid C++ (-pedantic: no compound
# literals, for one)
cxx=$(command -v c++ || command -v g++ || true)
for h in "$work/prefix/include/kt/"*.h; do
  printf '#include <kt/%s>\n' "$(basename "$h")" > "$work/one.c"
  "$cc" -std=c11 -Wall -Wextra -pedantic -Werror -fsyntax-only -I"$work/prefix/include" \
    "$work/one.c" || { echo "FAIL: $h does not compile on its own in C"; exit 1; }
  if [ -n "$cxx" ]; then
    cp "$work/one.c" "$work/one.cpp"
    "$cxx" -std=c++17 -Wall -Wextra -pedantic -Werror -fsyntax-only -I"$work/prefix/include" \
      "$work/one.cpp" || { echo "FAIL: $h does not compile on its own in C++"; exit 1; }
  fi
done
echo "headers on their own (C${cxx:+ and C++}): ok"

# pkg-config, with and without --static (the library is static only: both must link)
export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
for flags in "" "--static"; do
  # shellcheck disable=SC2046
  "$cc" -std=c11 -Wall -Werror "$src/tests/install/consumer/main.c" -o "$work/consumer_pc" \
    $(pkg-config $flags --cflags --libs kt)
  "$work/consumer_pc"
done
echo "pkg-config build: ok"

# find_package(kt)
cmake -S "$src/tests/install/consumer" -B "$work/cbuild" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/cbuild.log" 2>&1 || { cat "$work/cbuild.log"; exit 1; }
cmake --build "$work/cbuild" > "$work/cbuild2.log" 2>&1 || { cat "$work/cbuild2.log"; exit 1; }
"$work/cbuild/consumer"
echo "find_package build: ok"
