#!/usr/bin/env bash
# Installs what shardline needs from Debian's packages, only what is missing (idempotent,
# non-interactive). The CUDA toolkit and NCCL come from the machine image (/usr/local/cuda) and
# are optional: without nvcc the build simply leaves the CUDA parts out.
#
#   scripts/install-deps.sh            build + test dependencies
#   scripts/install-deps.sh --peers    also the benchmark peers (Open MPI, Gloo)
set -euo pipefail

packages=(cmake ninja-build g++ ccache pkg-config libabsl-dev libboost-dev libucx-dev
          libgtest-dev libgmock-dev libbenchmark-dev clang clang-format libclang-rt-14-dev lld
          python3)
if [[ "${1:-}" == "--peers" ]]; then
  packages+=(libopenmpi-dev openmpi-bin libgloo-dev)
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
# python3 may come from pyenv rather than Debian: any python3 on PATH will do.
if command -v python3 >/dev/null; then
  missing=("${missing[@]/python3}")
fi
read -r -a missing <<<"${missing[*]}"

if ((${#missing[@]} == 0)); then
  echo "install-deps: everything is installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
