#!/bin/sh
# run_with_torch.sh CMAKE_PYTHON SCRIPT ARGS...: runs tests/hf/SCRIPT ARGS with the first Python
# that imports torch, transformers and peft among: $KT_HF_PYTHON (environment), CMAKE_PYTHON
# (the CMake cache's KT_HF_PYTHON), /work/venv-torch/bin/python, python3. Exit 77 (skipped)
# when none does.
CMAKE_PY=$1
SCRIPT=$2
shift 2
for PY in "${KT_HF_PYTHON:-}" "$CMAKE_PY" /work/venv-torch/bin/python python3; do
    [ -n "$PY" ] || continue
    command -v "$PY" > /dev/null 2>&1 || continue
    if "$PY" -c "import torch, transformers, peft, safetensors" > /dev/null 2>&1; then
        exec "$PY" "$(dirname "$0")/$SCRIPT" "$@"
    fi
done
echo "skipped: no PyTorch/PEFT (no Python here imports torch, transformers and peft;" \
     "set KT_HF_PYTHON)"
exit 77
