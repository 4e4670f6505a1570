"""MLflow round trip through a real SQLite store, including two processes logging at once."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from draftforge.owner import is_alive, this_process
from draftforge.paths import mlflow_uri
from draftforge.tracking import experiment_name, flatten, mlflow_run


def _log_runs(results_root: str, worker: int, n_runs: int) -> None:
    for i in range(n_runs):
        with mlflow_run(
            results_root=results_root, experiment="concurrent", stage="evaluate", run_name=f"w{worker}-{i}",
            tags={"method": "ddtree", "dataset": f"d{worker}", "config_hash": "abc", "git_sha": "x"},
            params={"evaluate": {"budget": i}},
        ) as run:  # fmt: skip
            for step in range(3):
                run.log_metrics({"tau": worker + i + step / 10}, step=step)


def _search(results_root: Path, experiment: str):
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri(results_root))
    return mlflow.search_runs(experiment_names=[experiment_name(experiment)])


def test_run_round_trip(tmp_path: Path) -> None:
    with mlflow_run(
        results_root=tmp_path, experiment="rt", stage="train",
        tags={"method": "dflash", "dataset": "val", "config_hash": "h1", "git_sha": "g1"},
        params={"train": {"lr": 6e-4, "epochs": 6}},
    ) as run:  # fmt: skip
        run.log_metrics({"loss": 2.5, "tau_sim": 1.7}, step=10)
        artifact = tmp_path / "note.txt"
        artifact.write_text("hello")
        run.log_artifact(artifact)
    runs = _search(tmp_path, "rt")
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["status"] == "FINISHED"
    assert row["tags.stage"] == "train" and row["tags.pipeline"] == "rt"
    assert row["tags.method"] == "dflash" and row["tags.config_hash"] == "h1"
    assert row["params.train.lr"] == "0.0006" and row["metrics.tau_sim"] == pytest.approx(1.7)


def test_failed_stage_marks_run_failed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with mlflow_run(results_root=tmp_path, experiment="fail", stage="extract"):
            raise RuntimeError("boom")
    assert _search(tmp_path, "fail").iloc[0]["status"] == "FAILED"


def test_non_rank0_and_disabled_log_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with mlflow_run(results_root=tmp_path, experiment="r1", stage="train") as run:
        assert not run.active
        run.log_metrics({"loss": 1.0})
    monkeypatch.setenv("RANK", "0")
    with mlflow_run(results_root=tmp_path, experiment="r1", stage="train", enabled=False) as run:
        assert not run.active
    assert not (tmp_path / "mlflow.db").exists()


def test_two_processes_log_concurrently(tmp_path: Path) -> None:
    _log_runs(str(tmp_path), 9, 1)  # create the schema first, as a real pipeline's first stage does
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_log_runs, args=(str(tmp_path), w, 3)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    runs = _search(tmp_path, "concurrent")
    assert len(runs) == 7
    assert set(runs["status"]) == {"FINISHED"}
    assert sorted(runs["tags.dataset"].value_counts().to_dict().items()) == [("d0", 3), ("d1", 3), ("d9", 1)]


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "None"}


# A stage's run held open by its own process, as a long train branch holds it (prints once the run is open).
_HOLD_RUN = """
import sys, time
from draftforge.tracking import mlflow_run
root, branch, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
with mlflow_run(results_root=root, experiment="branches", stage="train", run_name="train/tiny", tags={"drafter": branch}):
    print("open", flush=True)
    time.sleep(hold)
"""


def _hold(root: Path, branch: str, hold: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_RUN, str(root), branch, str(hold)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = []
    while hold and (line := proc.stdout.readline()) and line.strip() != "open":  # MLflow logs its schema setup first
        seen.append(line)
    assert not hold or proc.poll() is None, "".join(seen)
    return proc


def _statuses(root: Path) -> list[tuple[str, str]]:
    runs = _search(root, "branches")
    return sorted(zip(runs["tags.drafter"], runs["status"]))


def test_only_runs_of_a_dead_owner_on_the_same_branch_are_marked_killed(tmp_path: Path) -> None:
    """Two branches of one stage run at once, and a branch may restart while its older job still runs: a
    starting run leaves every run whose owner process is alive; once that owner is SIGKILLed, the next start of
    its branch marks its run KILLED and leaves the other branch's live run alone."""
    dflash = _hold(tmp_path, "dflash", 600)
    dspark = _hold(tmp_path, "dspark", 600)
    try:
        with mlflow_run(results_root=tmp_path, experiment="branches", stage="train", tags={"drafter": "dflash"}):
            pass
        assert _statuses(tmp_path) == [("dflash", "FINISHED"), ("dflash", "RUNNING"), ("dspark", "RUNNING")]
        dflash.kill()
        dflash.wait(timeout=60)
        restart = _hold(tmp_path, "dflash", 0)  # the branch's next start, in a process of its own
        assert restart.wait(timeout=300) == 0, restart.stdout.read()
        assert _statuses(tmp_path) == [("dflash", "FINISHED"), ("dflash", "FINISHED"), ("dflash", "KILLED"),
                                       ("dspark", "RUNNING")]
    finally:
        for proc in (dflash, dspark):
            proc.kill()
            proc.wait(timeout=60)


def test_owner_liveness_survives_pid_reuse_and_leaves_other_machines() -> None:
    me = this_process()
    assert is_alive(me) is True
    assert is_alive(replace(me, started=str(int(me.started) + 1))) is False  # same pid, another process
    assert is_alive(replace(me, machine="another-boot/pid:[1]")) is None
