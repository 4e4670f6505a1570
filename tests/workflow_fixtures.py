"""Helpers for tests that drive the real Snakemake workflow from a copy of it in a temp folder, and the smoke
pipeline (`experiment=smoke` end to end) that the local and the SLURM pipeline tests share (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
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


# The converted default-world target, shared with the developer's own runs (built once, ~1 min).
TARGET_CACHE = REPO / "results" / "cache"


def clean_copy(dest: Path) -> Path:
    """The tracked (and untracked, not ignored) files of the working tree: what a fresh clone holds."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def pipeline_snakemake(repo: Path, *args: str, cores: str | None = "all", timeout: int = 3000, pythonpath: str = "",
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`snakemake [--cores CORES] ARGS` in a clean copy, its stages importing the copy's draftforge; cores=None for
    a cluster executor (which has no --cores). `env` adds to (and overrides) the environment."""
    base = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, str(repo / "src")])),
            "DRAFTFORGE_CACHE": str(TARGET_CACHE), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    cores_args = ["--cores", cores] if cores else []
    return subprocess.run([str(BIN / "snakemake"), *cores_args, *args], cwd=repo, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def failure_report(result: subprocess.CompletedProcess, logs: Path, pattern: str = "*.log") -> str:
    """Snakemake's output tails and every stage log's tail (what a failed pipeline test prints)."""
    tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob(pattern)))
    return f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}\n{tails}"


def smoke_pipeline(dest: Path) -> Path:
    """`snakemake --cores all --config experiment=smoke` in a clean copy at `dest`; fails the test on error."""
    import pytest

    repo = clean_copy(dest)
    started = time.monotonic()
    result = pipeline_snakemake(repo, "--config", "experiment=smoke")
    if result.returncode != 0:
        pytest.fail(f"smoke pipeline failed:\n{failure_report(result, repo / 'results' / 'smoke' / 'logs')}")
    print(f"smoke pipeline wall time: {time.monotonic() - started:.0f} s")
    return repo
