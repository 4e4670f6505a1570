#!/usr/bin/env bash
# Set up (idempotent, with test tools), lint (ruff) and run the test suite:
#   bash scripts/test.sh                  # unit + integration (CPU); GPU tests skip without CUDA
#   bash scripts/test.sh tests/unit -x    # any pytest arguments pass through
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
.venv/bin/ruff check src tests benchmarks || exit 1   # lint (pyproject.toml [tool.ruff]) before the tests
.venv/bin/python -m pytest "$@"
status=$?
if [[ $status == 5 ]]; then
  echo "[test] pytest collected no tests: failing (exit 5 must not pass)" >&2
fi
exit $status
