#!/usr/bin/env bash
# Installs the build dependencies that are missing (Debian packages) and builds fp8moe into build/.
# The CUDA backend is built when nvcc is on the PATH or in /usr/local/cuda (CUDA 12.8+ for sm_90a).
# Usage: scripts/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake g++ make libgtest-dev libcli11-dev nlohmann-json3-dev openmpi-bin libopenmpi-dev libcpp-httplib-dev fortunes)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# cuobjdump and nvdisasm for the SASS check of the GEMM kernels (tests/cuda): the toolkit's, or
# NVIDIA's wheels in build/tools; without them that one test is skipped.
if command -v nvcc >/dev/null 2>&1 && ! command -v nvdisasm >/dev/null 2>&1 &&
   [ ! -x "$(dirname "$(command -v nvcc)")/nvdisasm" ] && ! compgen -G "build/tools/nvidia/*/bin/nvdisasm" >/dev/null; then
  python3 -m pip install -q --disable-pip-version-check --target build/tools \
    "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14" ||
    echo "setup: could not install cuobjdump/nvdisasm; the SASS check of the GEMM kernels will be skipped"
fi

# Hugging Face's safetensors (with numpy) and tokenizers, in build/python, for the test that reads
# an export back as loaders do (tests/cli/test_export_layout.py); without them it is skipped.
if ! PYTHONPATH=build/python python3 -c "import safetensors, numpy, tokenizers" >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check --target build/python safetensors numpy tokenizers ||
    echo "setup: could not install safetensors, numpy and tokenizers; the export layout test will be skipped"
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "$(nproc)"
