#!/usr/bin/env bash
# Create .venv and install ddpkit into it: the CPU build of torch first (so pip never pulls a
# multi-GB CUDA build on a CPU machine), then the package with the digits, test, bench (Accelerate, Lightning Fabric),
# tensorboard and exporter (prometheus, mlflow, wandb) extras.
#   bash scripts/setup.sh            # idempotent; re-run after pulling
# torch comes from a local wheel when pip's find-links has one (this project's CI machines), else
# from PyTorch's CPU index. On a GPU machine, set DDPKIT_TORCH_SPEC="" and install the CUDA torch
# you need into .venv yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${DDPKIT_TORCH_SPEC-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ -n "$TORCH_SPEC" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if "${PIP[@]}" --no-index --no-deps "$TORCH_SPEC" 2>/dev/null; then
    "${PIP[@]}" "$TORCH_SPEC"   # its dependencies, from the package index
  else
    "${PIP[@]}" "$TORCH_SPEC" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi
# Skip the (network-needing) editable install when this checkout is installed and
# pyproject.toml has not changed since.
stamp=.venv/.ddpkit-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python - <<PY 2>/dev/null
import ddpkit, sys
sys.exit(0 if ddpkit.__file__.startswith("$PWD/src/") else 1)
PY
then
  "${PIP[@]}" -e ".[digits,test,bench,tensorboard,prometheus,mlflow,wandb]"
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import torch, ddpkit; print(f'ddpkit {ddpkit.__version__} with torch {torch.__version__} in .venv')"
