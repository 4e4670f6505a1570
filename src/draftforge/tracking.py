"""MLflow tracking on a SQLite store: one MLflow experiment per draftforge experiment, rank 0 only.

Runs carry the tags stage, pipeline, config_hash, git_sha, method, dataset so `mlflow ui` can filter
and compare runs of different stages and engines side by side. SQLite is shared by concurrent
Snakemake jobs: every call retries on "database is locked", and the first touch of the store in a
process (when MLflow may create or migrate the schema) holds an exclusive file lock beside the
database, so stages starting together on a fresh store do not run the schema setup twice.

Every run records the process that owns it (draftforge.owner: host, machine, pid, start time) as tags. When a
stage starts, runs of the same experiment, stage and branch (the `drafter` tag) left RUNNING by a process that
is provably gone are marked KILLED. Several branches of one stage run at once (Snakemake --cores all,
SLURM), and a rerun may start while an older job still runs, so a run whose owner is alive is never touched;
neither is a run owned on another machine (its pid cannot be looked up from here: the next start of that
branch on its own machine, or `mlflow ui`, settles it) nor one without owner tags (recorded before them).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from draftforge.owner import as_fields as owner_fields
from draftforge.owner import from_fields as owner_from_fields
from draftforge.owner import is_alive, this_process
from draftforge.paths import mlflow_uri

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_PARAM_LEN = 6000


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def with_retries(fn: Callable[[], T], attempts: int = 12, base_delay: float = 0.2) -> T:
    """Call fn, retrying transient SQLite lock/busy errors with jittered backoff."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:  # mlflow wraps sqlalchemy errors in MlflowException
            text = str(exc).lower()
            transient = "locked" in text or "busy" in text or "unique constraint" in text
            if not transient or attempt == attempts - 1:
                raise
            time.sleep(base_delay * (2 ** min(attempt, 5)) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} → {"a.b": "1"}; lists become their repr (MLflow params are strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LEN]
    return flat


class RunLogger:
    """Thin handle on one active MLflow run; every method is a no-op when tracking is off."""

    def __init__(self, run_id: str | None) -> None:
        self.run_id = run_id

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.active:
            return
        import mlflow

        clean = {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if v is not None}
        with_retries(lambda: mlflow.log_metrics(clean, step=step, run_id=self.run_id))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self.active:
            return
        import mlflow

        items = list(flatten(params).items())
        for i in range(0, len(items), 90):  # MLflow caps a params batch at 100
            chunk = dict(items[i : i + 90])
            with_retries(lambda: mlflow.log_params(chunk, run_id=self.run_id))  # noqa: B023 (called at once)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.active:
            return
        import mlflow

        with_retries(lambda: mlflow.log_artifact(str(path), artifact_path=artifact_path, run_id=self.run_id))


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextlib.contextmanager
def store_setup_lock(uri: str) -> Iterator[None]:
    """Exclusive lock on `<db>.lock` for a SQLite store (no-op for other stores)."""
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_CLEANED: set[tuple[str, str, str, str]] = set()


def mark_stale_runs_killed(exp_id: str, stage: str, branch: str = "") -> int:
    """Runs of this experiment, stage and branch still RUNNING whose owner process is gone → KILLED.

    Only a run whose recorded owner (draftforge.owner) ran on this machine and is no longer alive is stale;
    another branch's run, a live process's run (this one's included) and another machine's run are left
    alone. Done once per process, stage and branch.
    """
    import mlflow

    key = (mlflow.get_tracking_uri(), exp_id, stage, branch)
    if key in _CLEANED:
        return 0
    _CLEANED.add(key)
    client = mlflow.MlflowClient()
    running = with_retries(lambda: client.search_runs([exp_id], filter_string=f"tags.stage = '{stage}' AND attributes.status = 'RUNNING'"))
    killed = 0
    for run in running:
        tags = run.data.tags
        if tags.get("drafter", "") != branch:
            continue
        holder = owner_from_fields(tags)
        alive = None if holder is None else is_alive(holder)
        if alive is False:
            with_retries(lambda rid=run.info.run_id: client.set_terminated(rid, status="KILLED"))
            log.warning("MLflow run %s (%s) was left RUNNING by %s, which is gone: marked KILLED", run.info.run_id,
                        run.info.run_name, holder.describe())
            killed += 1
        elif alive is None:
            whose = "no owner recorded" if holder is None else f"owned by {holder.describe()}, another machine"
            log.info("MLflow run %s (%s) is RUNNING (%s): left as it is", run.info.run_id, run.info.run_name, whose)
    return killed


def experiment_name(draftforge_experiment: str) -> str:
    return f"draftforge/{draftforge_experiment}"


@contextlib.contextmanager
def mlflow_run(
    *,
    results_root: str | Path,
    experiment: str,
    stage: str,
    run_name: str | None = None,
    tags: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    uri: str = "",
    enabled: bool = True,
) -> Iterator[RunLogger]:
    """Open an MLflow run (rank 0 and enabled), tagged; yields a RunLogger (no-op otherwise).

    Required tags: stage and the owner_* tags of this process; others (pipeline, config_hash, git_sha, method,
    dataset, drafter) come from `tags`.
    A run that raises ends with status FAILED, never silently FINISHED.
    """
    if not (enabled and is_rank0()):
        yield RunLogger(None)
        return
    import mlflow

    tracking_uri = uri or mlflow_uri(results_root)
    Path(results_root).mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(tracking_uri)
    exp_name = experiment_name(experiment)
    artifact_root = (Path(results_root).resolve() / "mlartifacts").as_uri()

    def _experiment_id() -> str:
        found = mlflow.get_experiment_by_name(exp_name)
        if found is not None:
            return found.experiment_id
        # "custom_model_development": mlflow ui opens on the runs table, not the GenAI traces overview.
        return mlflow.create_experiment(exp_name, artifact_location=f"{artifact_root}/{experiment}",
                                        tags={"mlflow.experimentKind": "custom_model_development"})

    all_tags = {"stage": stage, "pipeline": experiment, **{k: str(v) for k, v in (tags or {}).items()},
                **owner_fields(this_process())}
    with store_setup_lock(tracking_uri):
        exp_id = with_retries(_experiment_id)
        mark_stale_runs_killed(exp_id, stage, all_tags.get("drafter", ""))
    run = with_retries(lambda: mlflow.start_run(experiment_id=exp_id, run_name=run_name or stage, tags=all_tags))
    logger = RunLogger(run.info.run_id)
    status = "FAILED"
    try:
        if params:
            logger.log_params(params)
        yield logger
        status = "FINISHED"
    finally:
        with_retries(lambda: mlflow.end_run(status=status))
