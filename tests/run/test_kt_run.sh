#!/usr/bin/env bash
# kt-run end to end: the fixture writes a small MLP program with its parameters and inputs,
# kt-run runs it (forward, then forward + backward), and the fixture checks the output files
# bitwise against a session of its own; then the error cases must exit 1 naming the problem.
#
# usage: test_kt_run.sh KT_RUN MAKE_FIXTURE WORKDIR
set -uo pipefail
run=$1 fixture=$2 dir=$3
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
expect_error usage_threads 2 "^kt-run: --threads needs a positive number" \
  "$dir/model.ktp" --threads zero --out "$dir/x.safetensors"
[ -e "$dir/x.safetensors" ] && fail "a failed run wrote its output file"

# --allow-missing runs on the initial values of the missing parameter
"$run" "$dir/model.ktp" --params "$dir/params_missing.safetensors" --allow-missing \
  "${ok_args[@]}" --threads 1 2> "$dir/allow.err" || fail "--allow-missing: exit $?"

"$run" --help | grep -q "usage: kt-run" || fail "--help"

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "kt-run: all checks passed"
