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

# ---- the files kt-graphc writes and reads (docs/files.md) ----
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
want_msg() { # NAME PATTERN: the log of check NAME matches PATTERN
  grep -q -E "$2" "$dir/$1.log" || fail "$1: the message does not match '$2'"
}
same() { # NAME FILE COPY: FILE is byte-identical to COPY
  cmp -s "$2" "$3" || fail "$2: changed by $1"
}
"$graphc" "$examples/mlp.ktg" -o "$dir/good.ktp" > /dev/null || fail "good.ktp"
cp "$dir/good.ktp" "$dir/good.orig"
mlp="$examples/mlp.ktg" lm="$examples/lm.ktg"

# -o onto a symbolic link, a FIFO, a directory: refused, each left as it was
ln -s good.ktp "$dir/link.ktp"
check out_symlink 1 "$graphc" "$lm" -o "$dir/link.ktp"
want_msg out_symlink "link\.ktp: is a symbolic link"
[ "$(readlink "$dir/link.ktp")" = good.ktp ] || fail "out_symlink: the link was replaced"
same out_symlink "$dir/good.ktp" "$dir/good.orig"
mkfifo "$dir/out.fifo"
check out_fifo 1 timeout 10 "$graphc" "$mlp" -o "$dir/out.fifo"
want_msg out_fifo "out\.fifo: is a named FIFO"
[ -p "$dir/out.fifo" ] || fail "out_fifo: the FIFO was replaced"
mkdir "$dir/sub"
check out_dir 1 "$graphc" "$mlp" --dot "$dir/sub"
want_msg out_dir "sub: is a directory"
[ -d "$dir/sub" ] && [ -z "$(ls -A "$dir/sub")" ] || fail "out_dir: the directory changed"
check out_no_dir 1 "$graphc" "$mlp" -o "$dir/nodir/x.ktp"
want_msg out_no_dir "nodir.*No such file or directory"

# a full disk (a file size limit: writes past 8 KiB fail) leaves the previous program as it
# was, and no temporary file; lm's program is about 57 KiB
check out_full 1 bash -c 'trap "" XFSZ; ulimit -f 8; exec "$0" "$1" -o "$2"' "$graphc" "$lm" \
  "$dir/good.ktp"
want_msg out_full "good\.ktp.*File too large"
same out_full "$dir/good.ktp" "$dir/good.orig"
check dot_full 1 bash -c 'trap "" XFSZ; ulimit -f 8; exec "$0" "$1" --dot "$2"' "$graphc" "$lm" \
  "$dir/good.ktp"
same dot_full "$dir/good.ktp" "$dir/good.orig"

# a FIFO as the model: refused at once (it used to block in open() for a writer)
mkfifo "$dir/model.fifo"
check in_fifo 1 timeout 10 "$graphc" "$dir/model.fifo" -o "$dir/fifo.ktp"
want_msg in_fifo "model\.fifo: is a named FIFO"
check in_dir 1 "$graphc" "$dir/sub" -o "$dir/dir.ktp"
want_msg in_dir "sub.*Is a directory"
# ... while an anonymous pipe is still read
check in_pipe 0 bash -c '"$0" <(cat "$1") -o "$2"' "$graphc" "$mlp" "$dir/pipe.ktp"
same in_pipe "$dir/pipe.ktp" "$dir/good.orig"

# an output that names the input (itself, a hard link, a symbolic link) or the other output
cp "$mlp" "$dir/m.ktg" && cp "$mlp" "$dir/m.orig" && ln "$dir/m.ktg" "$dir/m_hard.ktg"
ln -s m.ktg "$dir/m_sym.ktg"
check same_input 2 "$graphc" "$dir/m.ktg" -o "$dir/m.ktg"
want_msg same_input "^kt-graphc: -o names the same file as the model file .*m\.ktg.*must not overwrite an input"
check same_hard 2 "$graphc" "$dir/m.ktg" -o "$dir/m_hard.ktg"
check same_sym 2 "$graphc" "$dir/m_sym.ktg" --dot "$dir/m.ktg"
want_msg same_sym "^kt-graphc: --dot names the same file as the model file"
same same_input "$dir/m.ktg" "$dir/m.orig"
check same_outputs 2 "$graphc" "$mlp" -o "$dir/new.ktp" --dot "$dir/./new.ktp"
want_msg same_outputs "^kt-graphc: --dot names the same file as -o .*two outputs"
[ -e "$dir/new.ktp" ] && fail "same_outputs: wrote a file"

# standard output on a full disk is an error, not exit 0
check plan_full 1 bash -c '"$0" "$1" --print-plan > /dev/full' "$graphc" "$mlp"
want_msg plan_full "^kt-graphc: cannot write to standard output: No space left on device"

# nothing left behind by any of it
leftover=$(ls -A "$dir" | grep -e '\.kt-tmp\.' -e '\.tmp' || true)
[ -z "$leftover" ] || fail "temporary files left: $leftover"

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
