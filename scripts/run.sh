#!/usr/bin/env bash
# Set up (idempotent) and run the whole pipeline on the default world:
#   bash scripts/run.sh                          # = snakemake --cores all
#   bash scripts/run.sh --config experiment=smoke  # any snakemake arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
# From the repo root, snakemake loads profiles/default by itself (its workflow-profile lookup).
exec snakemake --cores all "$@"
