#!/bin/sh
# ctest hf_export_peft: tests/hf/check_export.py KT_EXPORT WORKDIR with the first Python that
# imports torch, transformers and peft among: $KT_HF_PYTHON (environment), the CMake cache's
# KT_HF_PYTHON (third argument), /work/venv-torch/bin/python, python3. Exit 77 (skipped) when
# none does.
KT_EXPORT=$1
WORK=$2
for PY in "${KT_HF_PYTHON:-}" "${3:-}" /work/venv-torch/bin/python python3; do
    [ -n "$PY" ] || continue
    command -v "$PY" > /dev/null 2>&1 || continue
    if "$PY" -c "import torch, transformers, peft, safetensors" > /dev/null 2>&1; then
        rm -rf "$WORK"
        exec "$PY" "$(dirname "$0")/check_export.py" "$KT_EXPORT" "$WORK"
    fi
done
echo "skipped: no PyTorch/PEFT (no Python here imports torch, transformers and peft;" \
     "set KT_HF_PYTHON)"
exit 77
