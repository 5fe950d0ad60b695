#!/bin/sh
# ctest hf_export_peft: tests/hf/check_export.py with the Python that has torch, transformers
# and peft: $KT_HF_PYTHON, else /work/venv-torch/bin/python where it exists, else python3.
# Exit 77 (skipped) when none of them can import those.
KT_EXPORT=$1
WORK=$2
PY=${KT_HF_PYTHON:-}
if [ -z "$PY" ] && [ -x /work/venv-torch/bin/python ]; then PY=/work/venv-torch/bin/python; fi
if [ -z "$PY" ]; then PY=$(command -v python3 || true); fi
if [ -z "$PY" ]; then
    echo "skipped: no PyTorch/PEFT (no python; set KT_HF_PYTHON)"
    exit 77
fi
rm -rf "$WORK"
exec "$PY" "$(dirname "$0")/check_export.py" "$KT_EXPORT" "$WORK"
