#!/usr/bin/env bash
# One architecture against transformers, the way a user runs it: kt-import the fixture's
# checkpoint, kt-run forward and backward on the fixture's tokens and labels, and compare the
# logits, the loss and the gradient of every parameter (experts included, under the
# checkpoint's names) with what transformers computed (tests/hf/README.md).
#
# usage: match_transformers.sh FIXTURE_DIR WORKDIR KT_IMPORT KT_RUN ST_COMPARE
#                              [--import-flag X]... [--run-flag X]... [--compare-flag X]...
set -uo pipefail
fixture=$1 work=$2 import=$3 run=$4 compare=$5
shift 5
import_flags=() run_flags=() compare_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --import-flag) import_flags+=("$2") ;;
    --run-flag) run_flags+=("$2") ;;
    --compare-flag) compare_flags+=("$2") ;;
    *) echo "match_transformers.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
ref=$fixture/reference.safetensors
rm -rf "$work" && mkdir -p "$work" || exit 1

read -r batch seq < <("$compare" --dims "$ref" input_ids) || {
  echo "FAIL: cannot read input_ids from $ref" >&2; exit 1; }
echo "== $(basename "$fixture"): B=$batch S=$seq"

"$import" "$fixture" -o "$work/model" --batch "$batch" --seq "$seq" "${import_flags[@]}" ||
  { echo "FAIL: kt-import exited $?" >&2; exit 1; }
# (the reference's other tensors are noted as not inputs: kept in a log, shown on failure)
"$run" "$work/model/model.ktp" --params "$fixture" --inputs "$ref" --out "$work/out.safetensors" \
  --backward --threads 2 "${run_flags[@]}" 2> "$work/run.log" ||
  { cat "$work/run.log" >&2; echo "FAIL: kt-run exited $?" >&2; exit 1; }
"$compare" "$ref" "$work/out.safetensors" "${compare_flags[@]}"
