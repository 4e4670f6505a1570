"""scripts/slurm_local.sh's owner watcher: a cluster started for a process stops itself, jobs included, once that
process is gone however it ended (the test session's cluster must not outlive a killed pytest)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from slurm_fixtures import local_slurm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PORT = 6917  # away from the session cluster's default 6817: two clusters may start at once under xdist


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(cmdline: str) -> bool:
    """Whether a process of this exact command line runs (read from /proc: no procps needed)."""
    want = cmdline.encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().replace(b"\0", b" ").strip() == want:
                return True
        except OSError:  # the process ended while it was read
            continue
    return False


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return cond()


def test_a_cluster_stops_with_its_jobs_once_its_owner_is_killed(tmp_path):
    owner = subprocess.Popen(["sleep", "600"])
    folder = tmp_path / "cluster"
    cluster_gen = local_slurm(folder, owner=owner.pid, port=PORT)
    try:
        cluster = next(cluster_gen)
        daemons = {n: int((folder / f"{n}.pid").read_text()) for n in ("munged", "slurmctld", "slurmd", "watcher")}
        marker = f"sleep 600.{uuid.uuid4().int % 10**9:09d}"  # this job's own process, found by its command line
        subprocess.run(["sbatch", f"--chdir={tmp_path}", "--output=/dev/null", "--wrap", marker], env=cluster.env,
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        running = _wait(lambda: _running(marker), 60)
        assert running, f"the job never started: {cluster.squeue()}"
        assert all(_alive(p) for p in daemons.values())

        owner.kill()  # SIGKILL: nothing of the owner runs after this
        owner.wait()
        gone = _wait(lambda: not any(_alive(p) for p in daemons.values()), 60)
        assert gone, {n: _alive(p) for n, p in daemons.items()}
        assert not _running(marker), "the job outlived its cluster"
        assert not any((folder / f"{n}.pid").exists() for n in daemons)
    finally:
        owner.kill()
        cluster_gen.close()  # the fixture's own stop: a no-op once the watcher has stopped everything


def test_a_plain_stop_also_ends_the_watcher(tmp_path):
    folder = tmp_path / "cluster"
    cluster_gen = local_slurm(folder, port=PORT + 10)
    try:
        next(cluster_gen)
        watcher = int((folder / "watcher.pid").read_text())
        assert _alive(watcher)
    finally:
        cluster_gen.close()
    assert _wait(lambda: not _alive(watcher), 10) and not (folder / "watcher.pid").exists()
