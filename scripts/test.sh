#!/usr/bin/env bash
# Set up a fresh virtual environment and run the test suite.
# torch is installed first, pinned, so that no dependency can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[lightning,accelerate,examples,test]"
# Two workers: most of the suite's time is spent in subprocesses (training ranks, killed jobs)
# whose parent only waits, so a second worker uses the core it leaves idle. GOCKPT_TEST_WORKERS=0
# runs the tests in one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${GOCKPT_TEST_WORKERS:-2}" "$@"
