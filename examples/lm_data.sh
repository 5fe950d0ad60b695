#!/usr/bin/env bash
# The main job's data: this repository's README.md and docs/*.md, and Debian's
# /usr/share/common-licenses, as byte tokens with an end-of-document token (256), a tenth of
# the documents held out: OUT/train.safetensors and OUT/heldout.safetensors.
#   bash examples/lm_data.sh KT_DATA OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kt_data=$1 out=$2
texts=("$root"/README.md "$root"/docs/*.md)
if [ -d /usr/share/common-licenses ]; then
  while IFS= read -r f; do texts+=("$f"); done \
    < <(find /usr/share/common-licenses -maxdepth 1 -type f | LC_ALL=C sort)
fi
"$kt_data" "${texts[@]}" -o "$out" --eos 256 --heldout-fraction 0.1
