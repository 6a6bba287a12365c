#!/usr/bin/env bash
# The GPU check of `ddpkit train` (issue 24); the logic is bench/gpu_check.py.
#
#   bash bench/gpu_check.sh                                # one CUDA GPU, at most 8 minutes
#   bash bench/gpu_check.sh --data-dir ~/mnist --json gpu_check.json
#   OMP_NUM_THREADS=1 bash bench/gpu_check.sh --cpu-dry-run --data-dir ../shared/data/mnist
#
# Python: $PYTHON, else the checkout's .venv, else python3; ddpkit from this checkout's src/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
if [ ! -x "$python" ]; then
    python="$(command -v python3)"
fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$here/gpu_check.py" "$@"
