"""Helpers for tests that drive the real Snakemake workflow from a copy of it in a temp folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def workflow_copy(dest: Path) -> Path:
    """Snakefile, rules, profiles and configs: a checkout's workflow, with its own .snakemake state."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "profiles", "conf"):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, dest / folder)
    return dest


def workflow_env(**extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", ""), str(REPO / "src")]))
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **extra}


def snakemake(repo: Path, *args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A bare `snakemake ARGS` from the repo root (no --profile: Snakemake finds profiles/default itself)."""
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=repo, env=env or workflow_env(), capture_output=True,
                          text=True, timeout=timeout)
