#!/usr/bin/env bash
# kt-run end to end: the fixture writes a small MLP program with its parameters and inputs,
# kt-run runs it (forward, then forward + backward), and the fixture checks the output files
# bitwise against a session of its own; then the error cases must exit 1 naming the problem.
#
# usage: test_kt_run.sh KT_RUN MAKE_FIXTURE WORKDIR
set -uo pipefail
run=$1 fixture=$2 dir=$3 graphc=${4:-}
rm -rf "$dir" && mkdir -p "$dir" || exit 1
failures=0

fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

"$fixture" write "$dir" || { echo "FAIL: the fixture could not be written" >&2; exit 1; }

common=(--params "$dir/params.safetensors" --threads 2)

# forward only
if "$run" "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs.safetensors" \
     --out "$dir/fwd.safetensors" --trace "$dir/fwd.json"; then
  "$fixture" check "$dir/fwd.safetensors" 2 || fail "forward outputs differ"
  grep -q '"traceEvents"' "$dir/fwd.json" && grep -q '"forward"' "$dir/fwd.json" ||
    fail "forward trace"
else
  fail "kt-run forward exited $?"
fi

# forward + backward
if "$run" "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs.safetensors" \
     --out "$dir/bwd.safetensors" --backward --trace "$dir/bwd.json"; then
  "$fixture" check "$dir/bwd.safetensors" 2 backward || fail "backward outputs differ"
  grep -q '"backward"' "$dir/bwd.json" || fail "backward trace has no backward events"
else
  fail "kt-run --backward exited $?"
fi

# the same parameters as a sharded checkpoint: --params DIR and --params INDEX.json
for params in "$dir/sharded" "$dir/sharded/model.safetensors.index.json"; do
  if "$run" "$dir/model.ktp" --params "$params" --threads 2 --inputs "$dir/inputs.safetensors" \
       --out "$dir/sharded.safetensors" --backward; then
    "$fixture" check "$dir/sharded.safetensors" 2 backward ||
      fail "outputs with --params $params differ"
  else
    fail "kt-run --params $params exited $?"
  fi
done

# expect_error NAME STATUS PATTERN kt-run-arguments...: exits STATUS, stderr matches PATTERN
expect_error() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "$run" "$@" > "$dir/$name.out" 2> "$dir/$name.err"
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    fail "$name: exit status $rc, expected $want"
  elif ! grep -q -E "$pattern" "$dir/$name.err"; then
    fail "$name: stderr does not match '$pattern':"
  else
    echo "ok: $name: $(head -n 1 "$dir/$name.err")"
    return
  fi
  cat "$dir/$name.err" >&2
}

ok_args=(--inputs "$dir/inputs.safetensors" --out "$dir/x.safetensors")
expect_error sharded_missing_shard 1 \
  "^kt-run: .*model.safetensors.index.json: shard 'model-00002-of-00002.safetensors'.*No such file" \
  "$dir/model.ktp" --params "$dir/sharded_broken" "${ok_args[@]}"
expect_error params_empty_dir 1 "model.safetensors.index.json or model.safetensors" \
  "$dir/model.ktp" --params "$dir" --inputs "$dir/inputs.safetensors" \
  --out "$dir/x.safetensors"
expect_error missing_input 1 "^kt-run: input 'x'|input 'y' .*is missing" \
  "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs_missing.safetensors" \
  --out "$dir/x.safetensors"
expect_error wrong_shape 1 "^kt-run: input 'x'.*f32\[8,7\].*f32\[8,6\]" \
  "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs_shape.safetensors" \
  --out "$dir/x.safetensors"
expect_error wrong_dtype 1 "^kt-run: input 'y'.*f32\[8\].*i32\[8\]" \
  "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs_dtype.safetensors" \
  --out "$dir/x.safetensors"
expect_error corrupt_ktp 1 "^kt-run: .*corrupt\.ktp.*checksum" \
  "$dir/corrupt.ktp" "${common[@]}" "${ok_args[@]}"
expect_error missing_ktp 1 "^kt-run: .*nonexistent\.ktp" \
  "$dir/nonexistent.ktp" "${common[@]}" "${ok_args[@]}"
expect_error missing_param 1 "^kt-run: .*w2" \
  "$dir/model.ktp" --params "$dir/params_missing.safetensors" "${ok_args[@]}"
expect_error no_training 1 "^kt-run: --backward: .*without training" \
  "$dir/model_fwd.ktp" "${common[@]}" "${ok_args[@]}" --backward
expect_error no_inputs_flag 1 "^kt-run: .*--inputs is required" \
  "$dir/model.ktp" "${common[@]}" --out "$dir/x.safetensors"
expect_error usage_no_out 2 "^kt-run: --out is required" \
  "$dir/model.ktp" "${common[@]}" --inputs "$dir/inputs.safetensors"
expect_error usage_unknown 2 "^kt-run: unknown option '--frobnicate'" \
  "$dir/model.ktp" --frobnicate
expect_error usage_threads 2 "^kt-run: --threads needs a whole number from 1 to 1024" \
  "$dir/model.ktp" --threads zero --out "$dir/x.safetensors"
[ -e "$dir/x.safetensors" ] && fail "a failed run wrote its output file"

# --allow-missing runs on the initial values of the missing parameter
"$run" "$dir/model.ktp" --params "$dir/params_missing.safetensors" --allow-missing \
  "${ok_args[@]}" --threads 1 2> "$dir/allow.err" || fail "--allow-missing: exit $?"

"$run" --help | grep -q "usage: kt-run" || fail "--help"

# ---- the files kt-run writes and reads (docs/files.md) ----
same() { # NAME FILE COPY: FILE is byte-identical to COPY
  cmp -s "$2" "$3" || fail "$1: $2 changed"
}
cp "$dir/inputs.safetensors" "$dir/in2.safetensors" && cp "$dir/inputs.safetensors" "$dir/in2.orig"
cp "$dir/fwd.safetensors" "$dir/prev.safetensors" && cp "$dir/fwd.safetensors" "$dir/prev.orig"
in_args=(--inputs "$dir/inputs.safetensors")
# an output naming an input, or the other output: a usage error, the input as it was
expect_error out_is_input 2 "^kt-run: --out names the same file as --inputs .*must not overwrite an input" \
  "$dir/model.ktp" "${common[@]}" --inputs "$dir/in2.safetensors" --out "$dir/in2.safetensors"
same out_is_input "$dir/in2.safetensors" "$dir/in2.orig"
cp "$dir/params.safetensors" "$dir/p2.safetensors" && cp "$dir/params.safetensors" "$dir/p2.orig"
ln "$dir/p2.safetensors" "$dir/p2_hard.safetensors"
expect_error trace_is_params 2 "^kt-run: --trace names the same file as --params" \
  "$dir/model.ktp" --params "$dir/p2.safetensors" "${in_args[@]}" --out "$dir/y.safetensors" \
  --trace "$dir/p2_hard.safetensors"
same trace_is_params "$dir/p2.safetensors" "$dir/p2.orig"
cp "$dir/model.ktp" "$dir/m2.ktp" && cp "$dir/model.ktp" "$dir/m2.orig"
expect_error trace_is_program 2 "^kt-run: --trace names the same file as the program file" \
  "$dir/m2.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/y.safetensors" --trace "$dir/m2.ktp"
same trace_is_program "$dir/m2.ktp" "$dir/m2.orig"
expect_error trace_is_out 2 "^kt-run: --trace names the same file as --out .*two outputs" \
  "$dir/model.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/y.safetensors" \
  --trace "$dir/y.safetensors"
[ -e "$dir/y.safetensors" ] && fail "a refused run wrote its output file"

# --out onto a symbolic link or a FIFO: refused, both left as they were
ln -s prev.safetensors "$dir/link.safetensors"
expect_error out_symlink 1 "link\.safetensors: is a symbolic link" \
  "$dir/model.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/link.safetensors"
[ "$(readlink "$dir/link.safetensors")" = prev.safetensors ] || fail "out_symlink: link replaced"
same out_symlink "$dir/prev.safetensors" "$dir/prev.orig"
mkfifo "$dir/out.fifo"
expect_error out_fifo 1 "out\.fifo: is a named FIFO" \
  "$dir/model.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/out.fifo"
[ -p "$dir/out.fifo" ] || fail "out_fifo: the FIFO was replaced"
expect_error trace_fifo 1 "out\.fifo: is a named FIFO" \
  "$dir/model.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/z.safetensors" \
  --trace "$dir/out.fifo"
[ -p "$dir/out.fifo" ] || fail "trace_fifo: the FIFO was replaced"

# a FIFO as any input is refused at once (open() used to wait for a writer forever)
mkfifo "$dir/in.fifo"
run_timeout() { timeout 10 "$run" "$@"; }
for which in inputs params program; do
  args=("$dir/model.ktp" "${common[@]}" "${in_args[@]}" --out "$dir/w.safetensors")
  case $which in
    inputs) args=("$dir/model.ktp" "${common[@]}" --inputs "$dir/in.fifo" --out "$dir/w.safetensors") ;;
    params) args=("$dir/model.ktp" --params "$dir/in.fifo" "${in_args[@]}" --out "$dir/w.safetensors") ;;
    program) args=("$dir/in.fifo" "${common[@]}" "${in_args[@]}" --out "$dir/w.safetensors") ;;
  esac
  timeout 10 "$run" "${args[@]}" > /dev/null 2> "$dir/fifo_$which.err"
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "in\.fifo: is a named FIFO" "$dir/fifo_$which.err"; then
    fail "fifo_$which: exit $rc: $(cat "$dir/fifo_$which.err")"
  else
    echo "ok: fifo_$which: $(head -n 1 "$dir/fifo_$which.err")"
  fi
done

# a full disk (writes past 1 KiB fail; the backward outputs take 1.3 KiB) leaves the previous
# outputs (the forward ones) as they were, and no temporary file
(trap '' XFSZ; ulimit -f 1; exec "$run" "$dir/model.ktp" "${common[@]}" "${in_args[@]}" \
  --backward --out "$dir/prev.safetensors") > /dev/null 2> "$dir/full.err"
rc=$?
if [ "$rc" -ne 1 ] || ! grep -q "prev\.safetensors.*File too large" "$dir/full.err"; then
  fail "out_full: exit $rc: $(cat "$dir/full.err")"
else
  echo "ok: out_full: $(head -n 1 "$dir/full.err")"
fi
same out_full "$dir/prev.safetensors" "$dir/prev.orig"
leftover=$(ls -A "$dir" | grep -e '\.kt-tmp\.' -e '\.tmp' || true)
[ -z "$leftover" ] || fail "temporary files left: $leftover"

# a program larger than memory: a missing input file, and then the plan itself, are refused at
# once, before anything is committed (a 40 GB plan used to be zero-filled first)
if [ -n "$graphc" ]; then
  printf 'input x: f32[100000, 100000]\ny = silu(x)\noutput y\n' > "$dir/huge.ktg"
  "$graphc" "$dir/huge.ktg" -o "$dir/huge.ktp" > /dev/null
  t0=$(date +%s%N)
  expect_error huge_missing_inputs 1 "cannot read the inputs: .*nonexistent.safetensors" \
    "$dir/huge.ktp" --inputs "$dir/nonexistent.safetensors" --out "$dir/huge_out.safetensors"
  expect_error huge_plan 1 "memory plan needs 80.0 GB of memory, but .* is available" \
    "$dir/huge.ktp" --inputs "$dir/inputs.safetensors" --out "$dir/huge_out.safetensors"
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  if [ "$ms" -lt 2000 ]; then echo "ok: both refused in $ms ms"; else fail "refusals took $ms ms"; fi
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "kt-run: all checks passed"
