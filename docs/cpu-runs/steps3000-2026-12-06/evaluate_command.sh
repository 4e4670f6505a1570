#!/bin/bash
cd /work/main
export PATH=$PWD/.venv/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
date -u +%FT%TZ; git rev-parse HEAD; git status --short | head
/usr/bin/time -v snakemake --cores all $PWD/results/default/evaluate/dflash_aw/evaluate.json --config experiment=default 'overrides=["train.max_steps=3000","evaluate.repeats=1"]' --forcerun evaluate
echo rc=$?
date -u +%FT%TZ
