#!/usr/bin/env bash
# Set up (idempotent, with test tools), lint (ruff) and run the test suite:
#   bash scripts/test.sh                  # unit + integration (CPU); GPU tests skip without CUDA
#   bash scripts/test.sh tests/unit -x    # any pytest arguments pass through
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
.venv/bin/ruff check src tests benchmarks || exit 1   # lint (pyproject.toml [tool.ruff]) before the tests
# One pytest-xdist worker per core (at most 4; tests/conftest.py gives each its share of torch threads): the
# pipeline tests' waits (process starts, the SLURM scheduler's polling) overlap with other tests' compute.
# Modules that share a session fixture run on one worker (--dist loadgroup, `xdist_group` marks). `-n 0` after
# these arguments runs in one process.
.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadgroup "$@"
status=$?
if [[ $status == 5 ]]; then
  echo "[test] pytest collected no tests: failing (exit 5 must not pass)" >&2
fi
exit $status
