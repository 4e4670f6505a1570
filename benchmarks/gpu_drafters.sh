#!/usr/bin/env bash
# The default world's drafters trained and evaluated on one GPU by the stages themselves (no Snakemake):
# target → extract → train {dflash, dflash_aw, dspark} → evaluate each on frozen eval prompts.
# Same data and training schedule as the CPU default run; the evaluation uses more prompts and longer
# answers than the CPU default (EVAL_OVERRIDES) so the τ comparison between drafters is less noisy.
#
#   bash benchmarks/gpu_drafters.sh prepare  # target + extract + train (needs results/default/curate, the GGUF package)
#   bash benchmarks/gpu_drafters.sh evaluate PROMPTS.json  # evaluate every trained drafter
# Env: R (results root, default /tmp/gd), OUT (records are copied there), DRAFTERS, DATASETS, NUM_PROMPTS,
# MAX_NEW, ENGINE, EXTRA (more overrides for every stage, space-separated), TAG (suffix of the copied records). On an H200 (captured engine) one set of 16 prompts x 128 tokens takes ~2 min per branch.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/gd}
DRAFTERS=${DRAFTERS:-"dflash dflash_aw dspark"}
LIST="[$(echo "$DRAFTERS" | tr ' ' ',')]"
COMMON=(experiment=default "results_root=$R" tracking.enabled=false "drafters=$LIST" ${EXTRA:-})
EVAL_OVERRIDES=(evaluate.gpus=1 evaluate.num_prompts=${NUM_PROMPTS:-16} evaluate.max_new_tokens=${MAX_NEW:-128}
                evaluate.repeats=1 evaluate.calibration_prompts=0 "evaluate.budgets=[16,64]"
                evaluate.engine=${ENGINE:-captured} "evaluate.datasets=[${DATASETS:-humaneval,gsm_symbolic,chitchat,mt_bench}]")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
say() { echo "[$(date +%T)] $*"; }

case "${1:-}" in
  prepare)
    mkdir -p "$R/default"
    [ -d "$R/default/curate" ] || cp -r results/default/curate "$R/default/"
    say target; python -m draftforge.target "${COMMON[@]}" 2>&1 | tail -3
    say extract; python -m draftforge.extract "${COMMON[@]}" extract.gpus=1 2>&1 | tr '\r' '\n' | tail -3
    for d in $DRAFTERS; do
      say "train $d"; python -m draftforge.train "${COMMON[@]}" drafter="$d" train.gpus=1 2>&1 | tr '\r' '\n' | grep -vE '^\s*$' | tail -4
      [ -n "${OUT:-}" ] && cp "$R/default/train/$d/metrics.json" "$OUT/train-$d${TAG:-}.json"
    done
    ;;
  evaluate)
    for d in $DRAFTERS; do
      say "evaluate $d"
      python benchmarks/frozen_prompts.py run "$2" -- "${COMMON[@]}" drafter="$d" "${EVAL_OVERRIDES[@]}" 2>&1 \
        | tr '\r' '\n' | grep -E 'error|Error|evaluate.stage' | tail -12 || true
      [ -n "${OUT:-}" ] && [ -f "$R/default/evaluate/$d/evaluate.json" ] && cp "$R/default/evaluate/$d/evaluate.json" "$OUT/evaluate-$d${TAG:-}.json"
    done
    say done
    ;;
  *) echo "usage: $0 prepare | evaluate PROMPTS.json" >&2; exit 2 ;;
esac
