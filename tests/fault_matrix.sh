#!/usr/bin/env bash
# The malformed-input and fault matrix of issue 27, rebuilt deterministically (seeded) and run
# against the built tools. Every case is classified:
#   crash    killed by a signal that is not the harness's timeout, an AddressSanitizer/UBSan
#            report ("ERROR: AddressSanitizer", "runtime error:") in stderr, or a core file
#   hang     still running at its deadline (timeout: 20 s a case, 60 s a multi-rank run;
#            kt-train on a plan larger than memory: 1 s)
#   silent   exit 0 for a case marked must-refuse. Rule: a case is must-refuse when its input
#            is certainly invalid: every raw .ktp mutation that changes a byte (the file's
#            CRC-32 covers all of it), a .ktp field mutated and re-checksummed only where the
#            field itself is invalid (version, sizes), a .ktg cut inside brackets or inside a
#            name, or with a defect written in on purpose; every malformed safetensors and
#            token file, bad option or environment value, and output naming an input. Other
#            mutations (byte flips of a .ktg, re-checksummed .ktp body bytes, a cut between
#            statements) may still be valid: exit 0 is fine there, the other classes apply.
#            A multi-rank run may exit 0 only when its fault was not injected (the rank had
#            already exited) or is not a fault (a deadline that was met).
#   unclear  a refusal (nonzero exit) whose stderr is empty, does not name the tool, does not
#            name the offending thing (the file, FILE:LINE:COL for .ktg syntax cases, the
#            option or variable, "rank N" for multi-rank runs), or holds non-UTF-8 bytes or
#            control characters
#   spoiled  a file the case must not change (an input named as an output, a symlink or a
#            device it points to, a --save file under a kill) changed, or a temporary left
#   harness  a control case (a valid input) refused: the matrix itself is wrong
# Categories: ktg, ktp, safetensors, tokens, args (arguments, environment, outputs), ranks
# (multi-rank faults; only with build/tools/kt-launch), savekill.
#
# usage: bash tests/fault_matrix.sh [--quick] [BUILD_DIR]      (default BUILD_DIR: build)
#   --quick: fewer cases (about 1-2 minutes); the full run takes about 10 minutes on 2 cores.
#   The work directory is BUILD_DIR/fault_matrix (cases/CATEGORY/NAME: the command, its
#   stdout, stderr and files); each finding prints the case's directory. The last line is
#   "N passed, M failed" (N: cases without a finding); exit 1 on any finding.
#   FM_SEED (default 27) reseeds the mutations and the fault schedule.
set -uo pipefail
quick=0
[ "${1:-}" = --quick ] && { quick=1; shift; }
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$src/build}" && pwd) || exit 2
seed=${FM_SEED:-27}
T=$build/tools
graphc=$T/kt-graphc run=$T/kt-run train=$T/kt-train launch=$T/kt-launch bench=$T/kt-bench
fixture=$build/tests/run_make_fixture check=$build/tests/train_check
for b in "$graphc" "$run" "$train" "$fixture" "$check"; do
  [ -x "$b" ] || { echo "missing $b (cmake --build $build --target $(basename "$b"))"; exit 2; }
done
[ -x "$launch" ] || launch=
# the embedded build has kt-launch but no communicator: no multi-rank cases there
grep -q '^KT_WITH_UCX:BOOL=OFF' "$build/CMakeCache.txt" 2> /dev/null && launch=
W=$build/fault_matrix
rm -rf "$W" && mkdir -p "$W/gen" "$W/cases" "$W/base" || exit 2
gen() { python3 "$src/tests/fault_matrix_gen.py" "$@"; }
t_start=$(date +%s)
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

declare -A count
cats=()
passed=0 failed=0
classes=(crash hang silent unclear spoiled harness)
bump() { count[$1]=$(( ${count[$1]:-0} + 1 )); }

# fsig FILE: what the file is, for before/after comparisons
fsig() {
  if [ -L "$1" ]; then echo "L:$(readlink "$1")"
  elif [ -f "$1" ]; then echo "F:$(cksum < "$1")"
  elif [ -p "$1" ]; then echo P
  elif [ -c "$1" ]; then echo "C:$(stat -c %t:%T "$1")"
  elif [ -d "$1" ]; then echo D
  elif [ -e "$1" ]; then echo X
  else echo -; fi
}

# verdict CAT NAME DIR RC ELAPSED_MS DEADLINE_MS EXPECT TOOL_RE WHERE_RE [SPOILED_MSG]:
# classify one finished case (globals: count, passed, failed)
verdict() {
  local cat=$1 name=$2 d=$3 rc=$4 el=$5 dl=$6 expect=$7 tool=$8 where=$9 spoil=${10:-}
  local found=() err=$d/stderr
  if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$el" -ge $((dl - 100)) ]; then
    found+=(hang)
  elif [ "$rc" -gt 128 ] || grep -q -E "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:" "$err" 2> /dev/null ||
       compgen -G "$d/core*" > /dev/null; then
    found+=(crash)
  elif [ "$rc" -eq 0 ]; then
    [ "$expect" = refuse ] && found+=(silent)
  elif [ "$expect" = accept ]; then
    found+=(harness)
  else
    local why=
    if [ ! -s "$err" ]; then why="empty stderr"
    elif ! grep -q -E -- "$tool" "$err"; then why="the tool is not named"
    elif ! grep -q -E -- "$where" "$err"; then why="'$where' is not named"
    elif ! LC_ALL=C tr -d '\000-\010\013-\037\177' < "$err" | cmp -s - "$err"; then
      why="control characters"
    elif ! iconv -f UTF-8 -t UTF-8 "$err" > /dev/null 2>&1; then why="not UTF-8"
    fi
    [ -n "$why" ] && { found+=(unclear); echo "$why" > "$d/unclear"; }
  fi
  [ -n "$spoil" ] && { found+=(spoiled); echo "$spoil" > "$d/spoiled"; }
  if [ ${#found[@]} -eq 0 ]; then
    passed=$((passed + 1)); bump "$cat:pass"
  else
    failed=$((failed + 1)); bump "$cat:fail"
    local c; for c in "${found[@]}"; do bump "$cat:$c"; done
    echo "FINDING [${found[*]}] $cat/$name: exit $rc after ${el} ms${spoil:+; $spoil}$( [ -f "$d/unclear" ] && echo "; $(cat "$d/unclear")")"
    echo "    $(cat "$d/cmd")"
    echo "    stderr: $(head -c 400 "$err" | head -n 3 | LC_ALL=C tr -c '\n -~' '?' | sed '2,$s/^/            /')"
    echo "    files: $d"
  fi
}

# case CAT NAME EXPECT DEADLINE_S TOOL_RE WHERE_RE -- COMMAND...
#   globals KEEP (files that must stay as they were), STDOUT (default: the case's stdout file)
KEEP=() STDOUT=
case_() {
  local cat=$1 name=$2 expect=$3 dl=$4 tool=$5 where=$6
  shift 7
  local d=$W/cases/$cat/$name
  mkdir -p "$d"
  printf '%q ' "$@" > "$d/cmd"
  local before=() f i=0 spoil=
  for f in "${KEEP[@]}"; do before+=("$(fsig "$f")"); done
  local t0; t0=$(now_ms)
  (cd "$d" && exec timeout -k 3 "$dl" "$@") > "${STDOUT:-$d/stdout}" 2> "$d/stderr" < /dev/null
  local rc=$? el=$(( $(now_ms) - t0 ))
  for f in "${KEEP[@]}"; do
    [ "$(fsig "$f")" = "${before[$i]}" ] || spoil+="$f changed; "
    i=$((i + 1))
  done
  local dirs=("$d"); for f in "${KEEP[@]}"; do dirs+=("$(dirname "$f")"); done
  local tmp; tmp=$(find "${dirs[@]}" -maxdepth 1 -name '*kt-tmp*' 2> /dev/null | head -1)
  [ -n "$tmp" ] && spoil+="temporary left: $tmp"
  verdict "$cat" "$name" "$d" "$rc" "$el" $((dl * 1000)) "$expect" "$tool" "$where" "$spoil"
  KEEP=() STDOUT=
}

summary_cat() {
  local cat=$1 line="" c
  for c in "${classes[@]}"; do line+=" $c ${count[$cat:$c]:-0},"; done
  echo "== $cat: $(( ${count[$cat:pass]:-0} + ${count[$cat:fail]:-0} )) cases, ${count[$cat:pass]:-0} passed;${line%,}"
  cats+=("$cat")
}

# ---- the base files ------------------------------------------------------------------------
B=$W/base
"$fixture" write "$B" > /dev/null || { echo "fixture failed"; exit 2; }
sizes=(-D H=32 -D VOCAB=64 -D E=4 -D L=2 -D K=4 -D TOPK=2)
"$graphc" "$src/examples/lm.ktg" -o "$B/lm1.ktp" -D T=48 "${sizes[@]}" > /dev/null &&
"$graphc" "$src/examples/lm.ktg" -o "$B/lm2.ktp" -D T=24 "${sizes[@]}" > /dev/null &&
"$graphc" "$src/examples/lm.ktg" -o "$B/lm_huge.ktp" -D T=4096 -D H=8192 -D VOCAB=65536 \
  -D E=8 -D L=2 -D K=4 -D TOPK=2 > /dev/null &&
"$check" tokens "$B/markov.bin" 4096 64 markov > /dev/null &&
"$train" "$B/lm1.ktp" --data "$B/markov.bin" --steps 1 --threads 1 --log-every 1 \
  --save "$B/lm1.safetensors" > /dev/null 2>&1 &&
"$check" select "$B/lm1.safetensors" "$B/lm1.experts.safetensors" moe. > /dev/null ||
  { echo "the base files could not be made"; exit 2; }
P=$B/params.safetensors IN=$B/inputs.safetensors KTP=$B/model.ktp
run_args=(--threads 1)
train_args=(--data "$B/markov.bin" --steps 1 --threads 1)

# controls: the valid inputs are accepted (else the matrix says nothing)
case_ ktp control_good accept 20 kt-run . -- "$run" "$KTP" --params "$P" --inputs "$IN" --out out.safetensors "${run_args[@]}"
case_ tokens control_good accept 20 kt-train . -- "$train" "$B/lm1.ktp" "${train_args[@]}"

# ---- 1. malformed .ktg -----------------------------------------------------------------------
G=$W/gen/ktg; mkdir -p "$G"
[ $quick = 1 ] && ntr=3 || ntr=10
gen ktg "$src/examples" "$G" "$seed" "$ntr" > "$W/gen/ktg.list"
while IFS=$'\t' read -r nm expect where; do
  b=${nm%.ktg}
  case $where in pos) where="$nm:[0-9]+:[0-9]+" ;; file) where="$nm" ;; esac
  case_ ktg "$b" "$expect" 20 kt-graphc "$where" -- "$graphc" "$G/$nm" -o out.ktp
done < "$W/gen/ktg.list"
mkdir -p "$G/a_dir.ktg"; rm -f "$G/fifo.ktg"; mkfifo "$G/fifo.ktg"
ln -sf /dev/zero "$G/zero_link.ktg"
case_ ktg directory refuse 20 kt-graphc a_dir.ktg -- "$graphc" "$G/a_dir.ktg" -o out.ktp
KEEP=("$G/fifo.ktg")
case_ ktg fifo refuse 5 kt-graphc fifo.ktg -- "$graphc" "$G/fifo.ktg" -o out.ktp
case_ ktg dev_zero refuse 20 kt-graphc /dev/zero -- "$graphc" /dev/zero -o out.ktp
case_ ktg dev_zero_link refuse 20 kt-graphc zero_link.ktg -- "$graphc" "$G/zero_link.ktg" -o out.ktp
case_ ktg missing refuse 20 kt-graphc nothere.ktg -- "$graphc" "$G/nothere.ktg" -o out.ktp
case_ ktg define_unknown refuse 20 kt-graphc "NN" -- "$graphc" "$src/examples/mlp.ktg" -D NN=3 -o out.ktp
case_ ktg define_huge refuse 20 kt-graphc "-D N" -- "$graphc" "$src/examples/mlp.ktg" -D N=99999999999999999999 -o out.ktp
case_ ktg define_junk refuse 20 kt-graphc "-D N" -- "$graphc" "$src/examples/mlp.ktg" -D N=3x -o out.ktp
summary_cat ktg

# ---- 2. mutated .ktp (kt-run; kt-graphc reads no .ktp) ---------------------------------------
K=$W/gen/ktp; mkdir -p "$K"
if [ $quick = 1 ]; then gen ktp "$KTP" "$K" "$seed" 20 20 10 8 > "$W/gen/ktp.list"
else gen ktp "$KTP" "$K" "$seed" 80 120 80 40 > "$W/gen/ktp.list"; fi
while IFS=$'\t' read -r nm expect where; do
  case_ ktp "${nm%.ktp}" "$expect" 20 kt-run "$nm" -- "$run" "$K/$nm" --params "$P" --inputs "$IN" --out out.safetensors "${run_args[@]}"
done < "$W/gen/ktp.list"
summary_cat ktp

# ---- 3. safetensors: kt-run --params/--inputs, kt-train --params/--experts -------------------
S=$W/gen/st; mkdir -p "$S"
gen st "$P" "$S" rparams > "$W/gen/st.list"
gen st "$IN" "$S" rinputs >> "$W/gen/st.list"
gen st "$B/lm1.safetensors" "$S" tparams >> "$W/gen/st.list"
gen st "$B/lm1.experts.safetensors" "$S" texperts >> "$W/gen/st.list"
i=0
while IFS=$'\t' read -r nm expect where; do
  i=$((i + 1))
  [ $quick = 1 ] && [ $((i % 4)) -ne 0 ] && continue
  b=${nm%.safetensors}
  case $nm in
    rparams*) case_ safetensors "$b" "$expect" 20 kt-run "$nm" -- "$run" "$KTP" --params "$S/$nm" --inputs "$IN" --out out.safetensors "${run_args[@]}" ;;
    rinputs*) case_ safetensors "$b" "$expect" 20 kt-run "$nm" -- "$run" "$KTP" --params "$P" --inputs "$S/$nm" --out out.safetensors "${run_args[@]}" ;;
    tparams*) case_ safetensors "$b" "$expect" 20 kt-train "$nm" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --params "$S/$nm" ;;
    texperts*) case_ safetensors "$b" "$expect" 20 kt-train "$nm" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --experts "$S/$nm" ;;
  esac
done < "$W/gen/st.list"
summary_cat safetensors

# ---- 4. token files (kt-train --data, vocabulary 64) ------------------------------------------
D=$W/gen/tok; mkdir -p "$D"
gen tok "$D" > "$W/gen/tok.list"
while IFS=$'\t' read -r nm expect rest; do
  where=${rest%%|*} extra=${rest#*|}
  [ "$where" = file ] && where=$nm
  # shellcheck disable=SC2086
  case_ tokens "${nm%.bin}" "$expect" 20 kt-train "$where" -- "$train" "$B/lm1.ktp" --data "$D/$nm" --steps 1 --threads 1 $extra
done < "$W/gen/tok.list"
rm -f "$D/fifo.bin"; mkfifo "$D/fifo.bin"; mkdir -p "$D/dir.bin"; ln -sf /dev/zero "$D/zero_link.bin"
ln -sf /dev/null "$D/null_link.bin"
KEEP=("$D/fifo.bin"); case_ tokens fifo refuse 5 kt-train fifo.bin -- "$train" "$B/lm1.ktp" --data "$D/fifo.bin" --steps 1 --threads 1
case_ tokens directory refuse 20 kt-train dir.bin -- "$train" "$B/lm1.ktp" --data "$D/dir.bin" --steps 1 --threads 1
case_ tokens zero_link refuse 20 kt-train zero_link.bin -- "$train" "$B/lm1.ktp" --data "$D/zero_link.bin" --steps 1 --threads 1
case_ tokens null_link refuse 20 kt-train null_link.bin -- "$train" "$B/lm1.ktp" --data "$D/null_link.bin" --steps 1 --threads 1
case_ tokens missing refuse 20 kt-train nothere.bin -- "$train" "$B/lm1.ktp" --data "$D/nothere.bin" --steps 1 --threads 1
summary_cat tokens

# ---- 5. arguments, environment, outputs -------------------------------------------------------
bad_values=(abc 2abc -1 0 99999999999 99999999999999999999 ' 5')
[ $quick = 1 ] && bad_values=(2abc -1 ' 5')
n=0
# numopt TOOL OPTION OK SKIP -- COMMAND-BEFORE-OPTION...: OK lists the values that are valid (H: 1e20, a valid ratio)
# for this option (0 / h for 99999999999: "any"), SKIP the ones not run (h: a valid value that
# would run for hours, --steps 99999999999)
numopt() {
  local tool=$1 opt=$2 oks=$3 skip=$4 v e
  shift 5
  for v in "${bad_values[@]}"; do
    n=$((n + 1)) e=refuse
    local key=$v; [ "$v" = 99999999999 ] && key=h; [ "$v" = 99999999999999999999 ] && key=H
    case " ${skip//,/ } " in *" $key "*) continue ;; esac
    case " ${oks//,/ } " in *" $key "*) e=any ;; esac
    case_ args "${tool}_${opt%%|*}_$n" "$e" 20 "$tool" "$opt" -- "$@" "${opt%%|*}" "$v"
  done
}
numopt kt-run --threads - - -- "$run" "$KTP" --params "$P" --inputs "$IN" --out out.safetensors
numopt kt-train --steps - h -- "$train" "$B/lm1.ktp" --data "$B/markov.bin" --threads 1
numopt kt-train --threads - - -- "$train" "$B/lm1.ktp" "${train_args[@]}"
numopt kt-train --log-every h - -- "$train" "$B/lm1.ktp" "${train_args[@]}"
numopt kt-train "--moe-inter|intermediate" - - -- "$train" "$B/lm1.ktp" "${train_args[@]}"
numopt kt-train --data-header 0 - -- "$train" "$B/lm1.ktp" "${train_args[@]}"
numopt kt-graphc --check-peak h,H - -- "$graphc" "$src/examples/mlp.ktg" -o out.ktp
if [ -n "$launch" ]; then
  numopt kt-launch -n - - -- "$launch" --timeout-ms 3000
  numopt kt-launch --timeout-ms - - -- "$launch" -n 1
fi
for v in abc 2abc -1; do # kt-bench: only values that must stop it before any measurement
  n=$((n + 1)); case_ args "kt-bench_repeats_$n" refuse 20 kt-bench --repeats -- "$bench" graph --repeats "$v"
done
for v in abc nan inf -1; do
  n=$((n + 1)); case_ args "kt-train_lr_$n" refuse 20 kt-train --lr -- "$train" "$B/lm1.ktp" "${train_args[@]}" --lr "$v"
done
for a in "--checkpoint every:abc" "--checkpoint every:0" "--checkpoint budget:-5" "--checkpoint bogus"; do
  n=$((n + 1)); # shellcheck disable=SC2086
  case_ args "kt-graphc_checkpoint_$n" refuse 20 kt-graphc "--checkpoint|${a#* }" -- "$graphc" "$src/examples/mlp.ktg" -o out.ktp $a
done
for t in kt-graphc:"$graphc" kt-run:"$run" kt-train:"$train" kt-bench:"$bench" ${launch:+kt-launch:"$launch"}; do
  name=${t%%:*} exe=${t#*:}
  case_ args "${name}_unknown_option" refuse 20 "$name" "--frobnicate" -- "$exe" --frobnicate
  [ "$name" = kt-bench ] && continue
  last=--threads; [ "$name" = kt-graphc ] && last=-o; [ "$name" = kt-launch ] && last=-n
  case_ args "${name}_missing_value" refuse 20 "$name" "$last" -- "$exe" "$last"
  STDOUT=/dev/full case_ args "${name}_help_dev_full" refuse 20 "$name" "stdout|standard output|/dev/full|No space" -- "$exe" --help
done
STDOUT=/dev/full case_ args kt-graphc_print_plan_dev_full refuse 20 kt-graphc "stdout|standard output|No space" -- "$graphc" "$src/examples/mlp.ktg" --print-plan
case_ args kt-train_option_choice refuse 20 kt-train "--optimizer" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --optimizer adamx
case_ args kt-train_moe_mode refuse 20 kt-train "--moe-mode" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --moe-mode half
case_ args kt-train_moe_bf16_full refuse 20 kt-train "--moe-dtype|bf16" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --moe-dtype bf16
case_ args kt-train_no_steps refuse 20 kt-train "--steps" -- "$train" "$B/lm1.ktp" --data "$B/markov.bin"
case_ args kt-train_input_name refuse 20 kt-train "--input-tokens|nosuch" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --input-tokens nosuch
# environment
envcase() { # VAR VALUE EXPECT -- COMMAND...
  local var=$1 val=$2 e=$3; shift 4
  n=$((n + 1)); case_ args "env_${var}_$n" "$e" 20 "kt-" "${var_where:-$var}" -- env "$var=$val" "$@"
}
ev=("abc" "2x" "-1" "0" "99999999999" "")
[ $quick = 1 ] && ev=("2x" "-1")
for v in "${ev[@]}"; do
  e=refuse; [ -z "$v" ] && e=any
  envcase KT_NUM_THREADS "$v" $e -- "$run" "$KTP" --params "$P" --inputs "$IN" --out out.safetensors
  [ "$v" = 99999999999 ] && e=any # 100 GB: a valid limit
  envcase KT_MEMORY_LIMIT "$v" $e -- "$train" "$B/lm1.ktp" "${train_args[@]}"
done
envcase KT_MEMORY_LIMIT 1Q refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
var_where="available" envcase KT_MEMORY_LIMIT 100K refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
envcase KT_CPU bogus refuse -- "$run" "$KTP" --params "$P" --inputs "$IN" --out out.safetensors
envcase KT_CPU bogus refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
envcase KT_COMM_TIMEOUT_MS abc refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
envcase KT_COMM_TIMEOUT_MS 0 refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
envcase KT_COMM_TRANSPORT carrier-pigeon refuse -- "$train" "$B/lm1.ktp" "${train_args[@]}"
envcase KT_WORLD_SIZE abc refuse -- env KT_RANK=0 "$train" "$B/lm1.ktp" "${train_args[@]}"
var_where="KT_RANK|rank 5 of world size 2|built without UCX" envcase KT_RANK 5 refuse -- env KT_WORLD_SIZE=2 KT_MASTER_ADDR=127.0.0.1 KT_MASTER_PORT=1 KT_COMM_TIMEOUT_MS=2000 "$train" "$B/lm1.ktp" "${train_args[@]}"
# outputs naming inputs, symlinks, devices, a missing directory
O=$W/gen/out; mkdir -p "$O"
cp "$B/markov.bin" "$O/data.bin"; cp "$IN" "$O/in.safetensors"; cp "$src/examples/mlp.ktg" "$O/m.ktg"
cp "$KTP" "$O/m.ktp"; cp "$B/lm1.safetensors" "$O/good.safetensors"
ln -sf /dev/null "$O/null_link"; ln -sf /dev/full "$O/full_link"; ln -sf good.safetensors "$O/good_link"
KEEP=("$O/data.bin"); case_ args out_losses_is_data refuse 20 kt-train "--losses" -- "$train" "$B/lm1.ktp" --data "$O/data.bin" --steps 1 --threads 1 --losses "$O/data.bin"
KEEP=("$O/data.bin"); case_ args out_save_is_data refuse 20 kt-train "--save" -- "$train" "$B/lm1.ktp" --data "$O/data.bin" --steps 1 --threads 1 --save "$O/data.bin"
KEEP=("$O/good.safetensors"); case_ args out_save_is_params refuse 20 kt-train "--save" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --params "$O/good.safetensors" --save "$O/good.safetensors"
KEEP=("$O/in.safetensors"); case_ args out_out_is_inputs refuse 20 kt-run "--out" -- "$run" "$KTP" --params "$P" --inputs "$O/in.safetensors" --out "$O/in.safetensors"
KEEP=("$O/m.ktp"); case_ args out_trace_is_program refuse 20 kt-run "--trace" -- "$run" "$O/m.ktp" --params "$P" --inputs "$IN" --out out.safetensors --trace "$O/m.ktp"
KEEP=("$O/m.ktg"); case_ args out_o_is_model refuse 20 kt-graphc "m.ktg|-o" -- "$graphc" "$O/m.ktg" -o "$O/m.ktg"
KEEP=("$O/m.ktg"); case_ args out_dot_is_model refuse 20 kt-graphc "m.ktg|--dot" -- "$graphc" "$O/m.ktg" --dot "$O/m.ktg"
for l in null_link full_link good_link; do
  KEEP=("$O/$l" "$O/good.safetensors"); case_ args "out_save_$l" refuse 20 kt-train "$l" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --save "$O/$l"
  KEEP=("$O/$l" "$O/good.safetensors"); case_ args "out_run_$l" refuse 20 kt-run "$l" -- "$run" "$KTP" --params "$P" --inputs "$IN" --out "$O/$l"
  KEEP=("$O/$l"); case_ args "out_graphc_$l" refuse 20 kt-graphc "$l" -- "$graphc" "$src/examples/mlp.ktg" -o "$O/$l"
done
KEEP=("$O/null_link"); case_ args out_losses_null_link refuse 20 kt-train null_link -- "$train" "$B/lm1.ktp" "${train_args[@]}" --losses "$O/null_link"
case_ args out_missing_dir refuse 20 kt-train "nodir" -- "$train" "$B/lm1.ktp" "${train_args[@]}" --save "$O/nodir/x.safetensors"
case_ args out_run_missing_dir refuse 20 kt-run "nodir" -- "$run" "$KTP" --params "$P" --inputs "$IN" --out "$O/nodir/x.safetensors"
case_ args out_graphc_missing_dir refuse 20 kt-graphc "nodir" -- "$graphc" "$src/examples/mlp.ktg" -o "$O/nodir/x.ktp"
# a plan larger than memory: refused in under a second (deadline 1 s: past it is a hang)
case_ args memory_plan refuse 1 kt-train "memory|allocated" -- "$train" "$B/lm_huge.ktp" --data "$B/markov.bin" --data-format u8 --steps 1 --threads 1
summary_cat args

# ---- 6. multi-rank faults -------------------------------------------------------------------
if [ -z "$launch" ]; then
  echo "== ranks: skipped (no kt-launch, or libkt built without UCX)"
else
  R=$W/gen/ranks; mkdir -p "$R"
  rank_cmd=("$train" "$B/lm2.ktp" --data "$B/markov.bin" --threads 1 --log-every 1000 --optimizer sgd --lr 0.5)
  # one clean run: its length sets the range of the fault delays
  [ $quick = 1 ] && fsteps=300 || fsteps=600
  t0=$(now_ms)
  case_ ranks control_2_ranks accept 60 "kt-" . -- "$launch" -n 2 --timeout-ms 5000 --grace-ms 500 -- "${rank_cmd[@]}" --steps $fsteps
  span=$(( $(now_ms) - t0 + 200 ))
  echo "   a clean 2-rank run of $fsteps steps takes about $span ms"
  RANDOM=$seed
  [ $quick = 1 ] && nf=9 || nf=60
  sigs=(KILL TERM STOP)
  for k in $(seq "$nf"); do
    sig=${sigs[$((k % 3))]} r=$((RANDOM % 2)) delay=$((RANDOM % span))
    name=fault_${k}_${sig}_rank${r}_${delay}ms
    d=$W/cases/ranks/$name; mkdir -p "$d/pids"
    cmd=("$launch" -n 2 --timeout-ms 3000 --grace-ms 500 -- sh -c 'echo $$ > "$0/$KT_RANK"; exec "$@"' "$d/pids" "${rank_cmd[@]}" --steps $fsteps)
    printf '%q ' "${cmd[@]}" > "$d/cmd"; echo "# then kill -$sig rank $r after $delay ms" >> "$d/cmd"
    t0=$(now_ms)
    (cd "$d" && exec timeout -k 3 60 "${cmd[@]}") > "$d/stdout" 2> "$d/stderr" < /dev/null &
    job=$!
    sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
    injected=0
    # the rank's pid, once it is kt-train (the wrapper shell has exec'd)
    pid=
    for _ in $(seq 40); do
      pid=$(cat "$d/pids/$r" 2> /dev/null)
      [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = kt-train ] && break
      kill -0 "$job" 2> /dev/null || break
      sleep 0.025
    done
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = kt-train ] && kill -"$sig" "$pid" 2> /dev/null; then
      injected=1
    fi
    wait "$job"; rc=$? el=$(( $(now_ms) - t0 ))
    e=any; [ $injected = 1 ] && e=refuse
    echo "injected=$injected" >> "$d/cmd"
    # a rank stopped after it had finished: exit 0 is right, the job is over
    [ $injected = 1 ] && [ "$sig" = STOP ] && grep -q "rank $r.*exited 0\|^\[rank $r\] step $fsteps/$fsteps" "$d/stdout" "$d/stderr" 2> /dev/null && e=any
    # the launcher names the failed rank; exit 128+9 for a SIGKILLed rank is its status, not a crash of the harness
    if [ $injected = 1 ] && [ $rc -gt 128 ] && [ $rc -ne 137 -o $el -lt 59000 ] && grep -q -E "rank [01]" "$d/stderr" "$d/stdout" 2> /dev/null; then
      cat "$d/stdout" >> "$d/stderr"; verdict ranks "$name" "$d" 1 "$el" 60000 "$e" "kt-launch|kt-train" "rank [01]"
    else
      cat "$d/stdout" >> "$d/stderr"; verdict ranks "$name" "$d" "$rc" "$el" 60000 "$e" "kt-launch|kt-train" "rank [01]"
    fi
  done
  # ranks started with different options: refused before step 1, naming the option
  for o in "--lr 0.25" "--steps 31" "--seed 9" "--moe-mode lora" "--optimizer adamw" "--data-format u8"; do
    [ $quick = 1 ] && [ "$o" != "--lr 0.25" ] && continue
    case_ ranks "differ_${o#--}" refuse 60 "kt-train" "rank 1" -- "$launch" -n 2 --timeout-ms 5000 --grace-ms 500 -- sh -c \
      'if [ "$KT_RANK" = 1 ]; then exec "$@" '"$o"'; else exec "$@"; fi' sh "${rank_cmd[@]}" --steps 30
  done
  # two jobs on one port: each ends (no hang); a refused one names the problem
  port=$("$launch" -n 1 -- sh -c 'echo $KT_MASTER_PORT' | sed 's/^\[rank 0\] //')
  [ $quick = 1 ] && nj=1 || nj=3
  for k in $(seq "$nj"); do
    for j in a b; do
      d=$W/cases/ranks/port_${k}_$j; mkdir -p "$d"
      cmd=("$launch" -n 2 --port "$port" --timeout-ms 4000 --grace-ms 500 -- "${rank_cmd[@]}" --steps 10)
      printf '%q ' "${cmd[@]}" > "$d/cmd"
      (cd "$d" && exec timeout -k 3 60 "${cmd[@]}") > "$d/stdout" 2> "$d/stderr" < /dev/null &
      eval "pid_$j=\$! t_$j=\$(now_ms)"
      sleep 0.0$((RANDOM % 10))
    done
    for j in a b; do
      eval "wait \$pid_$j; rc=\$?; t=\$t_$j"
      d=$W/cases/ranks/port_${k}_$j; cat "$d/stdout" >> "$d/stderr"
      verdict ranks "port_${k}_$j" "$d" "$rc" $(( $(now_ms) - t )) 60000 any "kt-launch|kt-train" "rank [01]|port|$port"
    done
  done
  # deadlines: a tiny one may fail (a clear timeout) or be met; a bad transport is refused
  for ms in 1 50; do
    case_ ranks "timeout_${ms}ms" any 60 "kt-" "rank [01]|timeout|deadline|timed out" -- "$launch" -n 2 --timeout-ms "$ms" --grace-ms 500 -- "${rank_cmd[@]}" --steps 5
  done
  case_ ranks transport_bogus refuse 60 "kt-launch" "--transport" -- "$launch" -n 2 --transport pigeon -- "${rank_cmd[@]}" --steps 5
  case_ ranks world_mismatch refuse 60 "kt-train" "rank [01]|T=|token" -- "$launch" -n 2 --timeout-ms 5000 --grace-ms 500 -- "$train" "$B/lm1.ktp" --data "$B/markov.bin" --threads 1 --steps 2 --data-format u17
  summary_cat ranks
fi

# ---- 7. kill -9 during --save onto a good file ----------------------------------------------
V=$W/gen/save; mkdir -p "$V/refs"
"$graphc" "$src/examples/lm.ktg" -o "$V/save.ktp" -D T=64 -D H=128 -D VOCAB=256 -D E=8 -D L=2 \
  -D K=4 -D TOPK=2 > /dev/null
head -c 4096 "$src/README.md" > "$V/text.bin"
srun=("$train" "$V/save.ktp" --data "$V/text.bin" --data-format u8 --steps 1 --threads 1 --moe-inter 256)
"${srun[@]}" --seed 1 --save "$V/refs/old.safetensors" > /dev/null 2>&1
t0=$(now_ms)
"${srun[@]}" --seed 2 --save "$V/refs/new.safetensors" > /dev/null 2>&1
span=$(( $(now_ms) - t0 + 20 ))
RANDOM=$((seed + 1))
[ $quick = 1 ] && ns=6 || ns=24
for k in $(seq "$ns"); do
  delay=$((RANDOM % span)) name=kill_${k}_${delay}ms
  d=$W/cases/savekill/$name; rm -rf "$d"; mkdir -p "$d/run"
  cp "$V/refs/old.safetensors" "$d/run/out.safetensors"
  printf '%q ' "${srun[@]}" --seed 2 --save "$d/run/out.safetensors" > "$d/cmd"; echo "# kill -9 after $delay ms" >> "$d/cmd"
  t0=$(now_ms)
  "${srun[@]}" --seed 2 --save "$d/run/out.safetensors" > "$d/stdout" 2> "$d/stderr" &
  pid=$!
  sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
  kill -9 "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null; rc=$?
  el=$(( $(now_ms) - t0 )) spoil=
  if cmp -s "$d/run/out.safetensors" "$V/refs/old.safetensors"; then kind=old
  elif cmp -s "$d/run/out.safetensors" "$V/refs/new.safetensors"; then kind=new
  else spoil="the file is neither the previous nor the new save"; fi
  left=$(ls -A "$d/run" | grep -v '^out.safetensors$' | tr '\n' ' ')
  [ -n "$left" ] && spoil+="${spoil:+; }left beside it: $left"
  # the kill is the harness's own: rc 137 (or 0 when the run had ended) is expected
  verdict savekill "$name" "$d" 0 "$el" 20000 any . . "$spoil"
done
summary_cat savekill

# ---- the summary ---------------------------------------------------------------------------
echo "== summary ($(( $(date +%s) - t_start )) s, seed $seed$( [ $quick = 1 ] && echo ', quick'), work dir $W)"
for c in "${classes[@]}"; do
  tot=0; for cat in "${cats[@]}"; do tot=$((tot + ${count[$cat:$c]:-0})); done
  echo "$c: $tot"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
