"""The DAG builds for every experiment, and reruns follow the configs (Snakemake's own dry-run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
STAGES = ["target", "curate", "extract", "train", "evaluate", "baselines", "report"]


def dry_run(results_root: Path, *config: str, extra: tuple[str, ...] = ()) -> str:
    cmd = [SNAKEMAKE, "-n", "--cores", "2", "--config", f"results_root={results_root}", *config, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def planned_jobs(output: str) -> dict[str, int]:
    table = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, flags=re.M) if m.group(1) != "total"}


@pytest.mark.parametrize("experiment", ["default", "smoke"])
def test_dag_builds(tmp_path: Path, experiment: str) -> None:
    jobs = planned_jobs(dry_run(tmp_path, f"experiment={experiment}"))
    assert jobs == {**{stage: 1 for stage in STAGES}, "all": 1}


def test_stage_commands_carry_only_their_overrides(tmp_path: Path) -> None:
    output = dry_run(tmp_path, "experiment=smoke", 'overrides=["evaluate.num_prompts=3"]', extra=("-p",))
    commands = [line for line in output.splitlines() if "-m draftforge." in line]
    by_stage = {re.search(r"-m draftforge\.(\w+)", c).group(1): c for c in commands}
    assert set(by_stage) == set(STAGES)
    readers = {"evaluate", "baselines"}  # baselines runs on as many prompts of the same sets
    for stage in STAGES:
        assert ("evaluate.num_prompts=3" in by_stage[stage]) == (stage in readers), by_stage[stage]
        assert by_stage[stage].count("results_root=") == 1
