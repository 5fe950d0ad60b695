#!/usr/bin/env bash
# Installs what libkt needs from Debian's packages: idempotent and non-interactive.
# The CUDA Toolkit is used when present (nvcc on PATH or /usr/local/cuda) and never required.
set -euo pipefail

packages=(build-essential cmake pkg-config clang binutils libclang-rt-14-dev
          libopenblas-dev libnuma-dev libucx-dev ucx-utils libcmocka-dev
          python3-torch python3-pip)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

# The PyTorch cross-checks read and write safetensors files; Debian has no package for it, so
# it comes from PyPI for the system python (the one python3-torch is installed for).
if ! /usr/bin/python3 -c "import safetensors" 2>/dev/null; then
  echo "setup: installing safetensors for /usr/bin/python3 (PyPI)"
  /usr/bin/python3 -m pip install --quiet --break-system-packages safetensors ||
    echo "setup: WARNING: safetensors could not be installed; the PyTorch cross-checks will be skipped"
fi
