"""MLflow round trip through a real SQLite store, including two processes logging at once."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

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
