#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (unit, distributed on gloo
# with 2-3 real processes, CLI, end to end, two network namespaces). About 11 minutes on 2 cores.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit -x   # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
