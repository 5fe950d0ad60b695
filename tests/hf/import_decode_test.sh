#!/usr/bin/env bash
# kt-import's decode twin (model_decode.ktg) through kt-generate, on one fixture: the logits of
# every decode step (the prompt in one forward, then one token a step over the key/value
# cache, the context filled to its end or with room left; and a compiled NEW = 1 program taking
# the prompt one token a step) equal those of the
# imported training program's full forward over the same tokens (kt-run, no cache) within 1e-5
# of the largest logit, and each greedy token is the full forward's argmax. The full forward is
# itself matched against transformers (hf_match_*), so the twin is too.
#
# usage: import_decode_test.sh FIXTURE WORKDIR KT_IMPORT KT_GRAPHC KT_RUN KT_GENERATE ST_COMPARE
set -uo pipefail
fixture=$1 work=$2 import=$3 graphc=$4 run=$5 gen=$6 compare=$7
check="$(cd "$(dirname "$0")/.." && pwd)/generate/check_generate.py"
command -v python3 > /dev/null || { echo "SKIP: no python3 (reads the logits files)"; exit 77; }
rm -rf "$work" && mkdir -p "$work" || exit 1
name=$(basename "$fixture")
prompt=3,1,4,1,5 P=5 NEW=8
fed=$((P + NEW - 1)) # the last generated token is never fed
"$import" "$fixture" -o "$work/model" --seq $fed --context $fed > "$work/import.log" 2>&1 ||
  { cat "$work/import.log"; echo "FAIL: $name: kt-import exited $?"; exit 1; }
"$graphc" "$work/model/model_decode.ktg" -o "$work/step.ktp" > "$work/graphc.log" 2>&1 ||
  { cat "$work/graphc.log"; echo "FAIL: $name: the decode twin does not compile"; exit 1; }
failures=0
for how in described roomy compiled; do
  prog=("$work/model/model_decode.ktg")
  [ "$how" = roomy ] && prog+=(-D C=$((fed + 4))) # empty slots left at the end
  [ "$how" = compiled ] && prog=("$work/step.ktp")
  out="$work/$how"
  if ! "$gen" "${prog[@]}" --params "$fixture" --prompt-ids $prompt --greedy --max-new $NEW --ids \
       --dump-logits "$out.dump" --threads 2 > "$out.ids" 2> "$out.err"; then
    cat "$out.err"; echo "FAIL: $name ($how): kt-generate exited $?"; failures=$((failures + 1))
    continue
  fi
  python3 "$check" inputs "$out.dump" "$out.in" --hf &&
    "$run" "$work/model/model.ktp" --params "$fixture" --inputs "$out.in" --out "$out.full" \
      --threads 2 2> "$out.run.err" ||
    { cat "$out.run.err"; echo "FAIL: $name ($how): the full forward"; failures=$((failures + 1))
      continue; }
  if "$compare" "$out.full" "$out.dump" --select logits --logits 1e-5 &&
     python3 "$check" greedy "$out.full" $P "$(cat "$out.ids")"; then
    echo "ok: $name ($how): $fed decode logits equal the full forward's; tokens $(cat "$out.ids")"
  else
    echo "FAIL: $name ($how): the decode steps differ from the full forward"
    failures=$((failures + 1))
  fi
done
[ "$failures" -eq 0 ] || exit 1
