#!/bin/bash
cd /work/main
export PATH=$PWD/.venv/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
date -u +%FT%TZ; git rev-parse HEAD
/usr/bin/time -v snakemake --cores all $PWD/results/default/train/dflash_aw/metrics.json --config experiment=default 'overrides=["train.max_steps=3000"]'
echo rc=$?
date -u +%FT%TZ
