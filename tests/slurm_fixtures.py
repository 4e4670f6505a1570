"""A one-node SLURM cluster for tests: scripts/slurm_local.sh in a temp folder (docs/cluster.md).

`local_slurm` (the session fixture `slurm_cluster` of tests/conftest.py) skips the test, with one reason line, where this machine cannot run one (no slurmd / munged /
slurmctld, or the daemons do not come up); with DRAFTFORGE_REQUIRE_SLURM=1 it fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue")
SBIN = "/usr/sbin:/sbin"


@dataclass(frozen=True)
class LocalSlurm:
    dir: Path
    env: dict[str, str]  # SLURM_CONF and PATH (the client shims first): what snakemake and squeue need
    cpus: int  # the node's CPUs (slurmd -C)

    def squeue(self) -> list[dict[str, str]]:
        """Every job the controller knows, finished ones included (MinJobAge is an hour)."""
        fmt = "%i|%T|%k|%l|%m|%C"
        out = subprocess.run(["squeue", "--states=all", "--noheader", f"--format={fmt}"], env=self.env,
                             capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
        keys = ("job", "state", "comment", "time_limit", "min_memory", "cpus")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    def jobcomp(self) -> dict[str, dict[str, str]]:
        """jobcomp.txt (slurmctld's record of each finished job) by job id: its KEY=VALUE fields."""
        path = self.dir / "jobcomp.txt"
        records = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in path.read_text().splitlines()] if path.is_file() else []
        return {r["JobId"]: r for r in records if "JobId" in r}


def _unavailable(reason: str) -> None:
    if os.environ.get("DRAFTFORGE_REQUIRE_SLURM") == "1":
        pytest.fail(f"local SLURM cluster required (DRAFTFORGE_REQUIRE_SLURM=1): {reason}")
    pytest.skip(f"no local SLURM cluster: {reason}")


def local_slurm(folder: Path, owner: int | None = None, port: int | None = None) -> Iterator[LocalSlurm]:
    """Start the cluster in `folder`, yield it, stop its daemons (whatever the tests did). Its owner (this process
    unless given) is watched: if the owner dies without stopping it (a test session killed mid-run), the cluster
    stops itself. `port`: the first port the controller may take (the script's default otherwise)."""
    path = f"{os.environ['PATH']}:{SBIN}"
    missing = [d for d in DAEMONS if shutil.which(d, path=path) is None]
    if missing:
        _unavailable(f"{', '.join(missing)} not installed (Debian slurmctld slurmd slurm-client munge: "
                     "scripts/setup.sh --test)")
    env = {**os.environ, "SLURM_LOCAL_OWNER": str(os.getpid() if owner is None else owner)}
    if port is not None:
        env["SLURM_LOCAL_PORT"] = str(port)
    started = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], capture_output=True, text=True, timeout=180,
                             env=env)  # fmt: skip
    try:
        if started.returncode != 0:
            reasons = [line for line in started.stderr.splitlines() if line.startswith("[slurm_local]")]
            _unavailable(reasons[-1] if reasons else f"scripts/slurm_local.sh start exited {started.returncode}")
        conf = folder / "slurm.conf"
        cpus = int(re.search(r"^NodeName=.*\bCPUs=(\d+)", conf.read_text(), flags=re.M).group(1))
        env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{folder / 'bin'}:{os.environ['PATH']}"}
        yield LocalSlurm(dir=folder, env=env, cpus=cpus)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], capture_output=True, timeout=120)
