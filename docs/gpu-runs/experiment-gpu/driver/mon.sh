#!/bin/bash
# Watch the detached orchestrator for up to $1 seconds (returns early when it is done); bring back its
# state, logs and small outputs through $OUT.
LIMIT=${1:-540}
DF=/tmp/df
T0=$(date +%s)
seen=0
last_print=0
while true; do
  el=$(( $(date +%s) - T0 ))
  if [ -f $DF/state.json ]; then
    n=$(python3 -c "import json;s=json.load(open('$DF/state.json'));print(len(s['events']))" 2>/dev/null || echo $seen)
    if [ "$n" -gt "$seen" ]; then
      python3 -c "import json;s=json.load(open('$DF/state.json'));print('\n'.join(s['events'][$seen:]))"
      seen=$n
    fi
    done=$(python3 -c "import json;print(json.load(open('$DF/state.json'))['done'])" 2>/dev/null)
    [ "$done" = "True" ] && break
  fi
  if [ $(( el - last_print )) -ge 60 ]; then
    last_print=$el
    for f in curate train evaluate; do
      [ -f $DF/logs/$f.log ] && { echo "[$el s] $f: $(tail -c 400 $DF/logs/$f.log | tr '\r' '\n' | grep -v '^\s*$' | tail -1 | cut -c1-220)"; }
    done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  fi
  [ $el -ge $LIMIT ] && break
  sleep 5
done
cd $DF
cp state.json $OUT/ 2>/dev/null
[ -f pack/results.tgz ] && cp pack/results.tgz $OUT/
tar czf $OUT/progress.tgz logs state.json probe.json $(cd $DF && find res/gpu tau bench_out -path '*/.work' -prune -o -path '*cache*' -prune -o -type f \( -name '*.json' -o -name '*.md' -o -name '*.csv' -o -name '*.png' -o -name '*.log' -o -name '*.tsv' \) -size -4M -print 2>/dev/null) 2>/dev/null
ls -la $OUT
echo "mon: $(( $(date +%s) - T0 ))s"
