#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (unit, distributed on gloo
# with 2-3 real processes, CLI, end to end, two network namespaces), three pytest workers (one
# test file per worker at a time: a file's tests share its namespaces, files and timing). Three
# on 2 cores: the suite waits on timeouts here and there, and a third worker fills those gaps
# (measured: 520 s against 571 s for two, the CPU 96% busy; docs/performance.md).
#   bash scripts/test.sh                   # everything
#   bash scripts/test.sh -m "not slow"     # the inner loop while changing code
#   bash scripts/test.sh tests/unit -x     # extra arguments go to pytest
#   DDPKIT_TEST_WORKERS=0 bash scripts/test.sh   # one process, no xdist
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# Byte-compile ddpkit and the tests once: every process the suite starts (700 torch processes,
# ranks and launchers) otherwise compiles ddpkit's source again when PYTHONDONTWRITEBYTECODE is
# set, as on the CI machine (~0.08 CPU-s each). Python reads these files either way.
.venv/bin/python -m compileall -q -j 0 src tests > /dev/null || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${DDPKIT_TEST_WORKERS:-3}"
xdist=()
if [ "$workers" != "0" ]; then
  xdist=(-n "$workers" --dist loadfile)
fi
.venv/bin/python -m pytest -q "${xdist[@]}" "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
