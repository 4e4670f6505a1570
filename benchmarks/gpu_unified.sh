#!/usr/bin/env bash
# GPU run of the unified engine (two device calls, back to back on one warm machine):
#   call1: engine_tree (compiled_split) on qwen3-8b-random and qwen3.6-27b-random (repeat 1), then
#          pytest tests/gpu (what does not finish is resumed in call 2); GGUF part 1 → /tmp/gguf.
#   call2: GGUF part 2 joined + sha256-checked; benchmarks/bf16_mismatch.py (AR tok/s timing first, then the
#          fp32/bf16 mismatch count) with the unfinished GPU tests beside its correctness phase; then
#          engine_tree repeat 2 of both targets.
# Env: COMMIT (the commit that ran), OUT (device tool). Each call ends by ~565 s.
#   bash benchmarks/gpu_unified.sh call1|call2
set -u
T0=$(date +%s)
END=$((T0 + ${BUDGET_S:-565}))
left() { echo $((END - $(date +%s))); }
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gguf /tmp/c1 /tmp/c2
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PYTEST=(python3 -m pytest tests/gpu -v -rA -p no:cacheprovider --timeout 300)

engine_tree() {  # $1 target tag (8b|27b), $2 repeat, $3 timeout
  local tgt extra=()
  if [ "$1" = 8b ]; then tgt=qwen3-8b-random; else tgt=qwen3.6-27b-random; extra=(--verify-budgets 1,16,64 --round-budgets 16,64); fi
  local t=$3; [ "$(left)" -lt "$t" ] && t=$(left)
  if [ "$t" -lt 60 ]; then say "engine_tree $1 r$2: skipped ($t s left)"; return; fi
  say "engine_tree $1 r$2 (timeout $t): python3 engine_tree.py --target $tgt --engines compiled_split ${extra[*]}"
  (cd benchmarks && timeout "$t" python3 engine_tree.py --target "$tgt" --engines compiled_split "${extra[@]}") \
    > "$OUT/engine_tree_$1_r$2.log" 2>&1
  say "engine_tree $1 r$2 rc=$?"; tail -12 "$OUT/engine_tree_$1_r$2.log"
  [ -f "$OUT/engine_tree_$tgt.json" ] && mv "$OUT/engine_tree_$tgt.json" "$OUT/engine_tree_$1_r$2.json"
}

case "${1:-}" in
  call1)
    cp .carry/g1/part_aa /tmp/gguf/part_aa &
    { echo "# GPU tests of the unified engine"; echo "command: ${PYTEST[*]}  (PYTHONPATH=/tmp/site:\$PWD/src:\$PWD/tests)";
      echo "commit: ${COMMIT:-unknown}"; echo "date: $(date -u +%FT%TZ)"; nvidia-smi -L;
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo; } \
      > "$OUT/gpu_tests_unified.log"
    engine_tree 8b 1 150
    engine_tree 27b 1 130
    t=$(( $(left) - 5 )); say "pytest (timeout $t)"
    timeout "$t" "${PYTEST[@]}" 2>&1 | tee /tmp/c1/pytest.log >> "$OUT/gpu_tests_unified.log"
    say "pytest rc=${PIPESTATUS[0]}"; tail -5 /tmp/c1/pytest.log
    wait; ls -la /tmp/gguf
    ;;
  call2)
    LOG=$OUT/bf16_mismatch.log
    { say "call2 start; commit ${COMMIT:-unknown}"; nvidia-smi -L; } > "$LOG"
    if [ -f /tmp/gguf/part_aa ]; then
      cat /tmp/gguf/part_aa .carry/g2/part_ab > "$GGUF"; got=$(sha256sum "$GGUF" | cut -d' ' -f1)
      say "joined GGUF sha256 $got (want $SHA)" >> "$LOG"; [ "$got" = "$SHA" ] || rm -f "$GGUF"
    else say "GGUF part 1 missing (fresh machine): no bf16_mismatch run" >> "$LOG"; fi
    # GPU tests call 1 did not finish: everything not reported PASSED/FAILED/ERROR/SKIPPED there
    python3 - > /tmp/c2/deselect.txt <<'EOF'
import re, pathlib
p = pathlib.Path("/tmp/c1/pytest.log")
done = re.findall(r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", p.read_text(), re.M) if p.exists() else []
print("\n".join(f"--deselect={i}" for i, _ in dict.fromkeys(done)))
EOF
    resume() {
      if [ -f /tmp/c1/pytest.log ] && grep -qE "^=+ .*(passed|failed|error).* in [0-9.]+s" /tmp/c1/pytest.log; then
        say "GPU tests: call 1 finished them all"; return; fi
      local t=$(( $(left) - ${1:-5} )); say "GPU tests not finished in call 1: resuming ($(wc -l < /tmp/c2/deselect.txt) done; timeout $t)"
      { echo; echo "# part 2 (call 2, same machine): tests call 1 did not reach; deselected the $(wc -l < /tmp/c2/deselect.txt) it reported"; } > "$OUT/gpu_tests_unified_part2.log"
      timeout "$t" "${PYTEST[@]}" $(cat /tmp/c2/deselect.txt) >> "$OUT/gpu_tests_unified_part2.log" 2>&1
      say "GPU tests part 2 rc=$?"; tail -4 "$OUT/gpu_tests_unified_part2.log"
    }
    if [ -f "$GGUF" ]; then
      say "bf16_mismatch (deadline in $(( $(left) - 175 )) s)" | tee -a "$LOG"
      python3 benchmarks/bf16_mismatch.py run --gguf "$GGUF" --prompts docs/gpu-runs/unified-engine/mtbench_first_turns_ids.json \
        --ar-gap --deadline $((END - 175)) --flag /tmp/c2/timing_done >> "$LOG" 2>&1 &
      BP=$!
      while kill -0 $BP 2>/dev/null && [ ! -f /tmp/c2/timing_done ]; do sleep 2; done
      say "timing phase done; GPU tests may share the GPU now"
      resume 180 &
      RP=$!
      wait $BP; say "bf16_mismatch rc=$?" | tee -a "$LOG"; tail -40 "$LOG"
      wait $RP
    else
      resume 175
    fi
    engine_tree 8b 2 150
    engine_tree 27b 2 130
    ;;
  *) echo "usage: $0 call1|call2" >&2; exit 2 ;;
esac
say done
