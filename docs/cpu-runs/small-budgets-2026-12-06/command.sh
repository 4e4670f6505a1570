#!/bin/bash
cd /work/main
export PATH=$PWD/.venv/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
date -u +%FT%TZ
/usr/bin/time -v snakemake --cores all $PWD/results/default/evaluate/dflash_aw/evaluate.json --config experiment=default 'overrides=["evaluate.repeats=1","evaluate.budgets=[2,3,4,8]","evaluate.methods=[ar,ddtree]","evaluate.temperatures=[0.0]"]' --forcerun evaluate
echo rc=$?
date -u +%FT%TZ
