"""One source of truth for where each stage reads and writes (Snakemake rules and stages both use it).

Layout: <results_root>/<experiment>/<stage>/... for the stages that run once and
<results_root>/<experiment>/<stage>/<drafter>/... for the per-drafter ones (stages.PER_DRAFTER); the MLflow store is <results_root>/mlflow.db and
caches shared across experiments live in <results_root>/cache (or $DRAFTFORGE_CACHE).
"""

from __future__ import annotations

import os
from pathlib import Path

from draftforge.stages import PER_DRAFTER, STAGE_MARKERS, STAGES

REPO_ROOT: Path = Path(__file__).resolve().parents[2]
CONF_DIR: Path = REPO_ROOT / "conf"


def default_results_root() -> Path:
    return Path(os.environ.get("DRAFTFORGE_RESULTS", REPO_ROOT / "results")).resolve()


def _branch(stage: str, drafter: str | None) -> tuple[str, ...]:
    """The path parts below <experiment>: (stage,) or (stage, drafter) for a per-drafter stage."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    if stage in PER_DRAFTER:
        if not drafter:
            raise ValueError(f"stage {stage!r} runs per drafter: name the drafter")
        return (stage, drafter)
    return (stage,)


def stage_dir(results_root: str | Path, experiment: str, stage: str, drafter: str | None = None) -> Path:
    return Path(results_root).resolve().joinpath(experiment, *_branch(stage, drafter))


def stage_marker(results_root: str | Path, experiment: str, stage: str, drafter: str | None = None) -> Path:
    return stage_dir(results_root, experiment, stage, drafter) / STAGE_MARKERS[stage]


def part_marker(results_root: str | Path, experiment: str, part: int | str) -> Path:
    """results/<exp>/extract/parts/part-<k>.json: the extract_part rule's declared output (`part` may be the
    Snakemake wildcard pattern "{part}")."""
    return stage_dir(results_root, experiment, "extract") / "parts" / f"part-{part}.json"


def cache_dir(results_root: str | Path) -> Path:
    env = os.environ.get("DRAFTFORGE_CACHE")
    return Path(env).resolve() if env else Path(results_root).resolve() / "cache"


def mlflow_uri(results_root: str | Path) -> str:
    return f"sqlite:///{Path(results_root).resolve() / 'mlflow.db'}"


def work_dir(results_root: str | Path, experiment: str, stage: str, drafter: str | None = None) -> Path:
    """State that must survive Snakemake deleting a failed job's outputs (checkpoints, partial shards)."""
    return Path(results_root).resolve().joinpath(experiment, ".work", *_branch(stage, drafter))
