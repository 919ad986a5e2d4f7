#!/usr/bin/env bash
# Creates .venv/ (once) from the python3 on PATH and installs into it, from PyPI, only what is
# missing: the Python module's build tools (scikit-build-core, nanobind), the test and plotting
# tools (pytest, numpy, matplotlib, safetensors), torch and transformers. torch is large (CUDA
# wheels, several GB): it is installed once per machine and pip's cache serves later venvs; it is
# never reinstalled when already importable.
#
#   scripts/install-python.sh                     everything above
#   scripts/install-python.sh --no-torch          all but torch and transformers
#   scripts/install-python.sh [--no-torch] --module
#                                                 then `pip install .`: shardline itself (build-pip/;
#                                                 ccache serves what build/ compiled)
#
# Prints one line when everything is there already.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ccache-env.sh
venv=.venv
torch=1
with_module=0
for arg in "$@"; do
  case $arg in
    --no-torch) torch=0 ;;
    --module) with_module=1 ;;
    *) echo "install-python: unknown argument $arg (--no-torch, --module)" >&2; exit 2 ;;
  esac
done
install_module() {
  ((with_module)) || return 0
  echo "install-python: pip install . (the shardline module, into $venv)"
  "$py" -m pip install --no-build-isolation --disable-pip-version-check -q . \
    >build-pip.log 2>&1 || { cat build-pip.log; exit 1; }
}
if [[ ! -x $venv/bin/python ]]; then
  echo "install-python: creating $venv"
  python3 -m venv "$venv"
fi
py=$venv/bin/python

# name-as-imported=requirement
wanted=(scikit_build_core=scikit-build-core nanobind=nanobind pytest=pytest numpy=numpy
        matplotlib=matplotlib safetensors=safetensors)
if ((torch)); then
  # The versions the tests are run with: torch 2.15 and Hugging Face transformers 5 (the
  # models of tests/python/test_hf.py, built from small configs; nothing is downloaded).
  # expecttest: torch's own distributed test suite imports it (tests/python/torch_suite.py).
  wanted+=("torch=torch==2.15.*" "transformers=transformers>=5,<6" expecttest=expecttest)
fi
missing=()
for entry in "${wanted[@]}"; do
  name=${entry%%=*}
  requirement=${entry#*=}
  # find_spec looks the module up without importing it (importing torch takes seconds).
  if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$name') is None)"; then
    missing+=("$requirement")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "install-python: everything is installed in $venv"
else
  echo "install-python: installing ${missing[*]} into $venv (torch takes minutes the first time)"
  # Not --no-compile: it saves a quarter of the install's CPU, but where the environment sets
  # PYTHONDONTWRITEBYTECODE every process then compiles torch from source at each import (the
  # Python tests took 1.5 times as long).
  "$py" -m pip install -q --disable-pip-version-check "${missing[@]}"
  echo "install-python: done"
fi
install_module
