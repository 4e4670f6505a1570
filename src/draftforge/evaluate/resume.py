"""Finished datasets of an interrupted `evaluate` run, kept so a rerun does not time them again.

An evaluate branch times every method on every dataset (tens of minutes each on a CPU). Each finished
dataset's payload (rows + responses, the `<dataset>.json` written to the stage folder) is also kept under the
stage's work dir (`results/<exp>/.work/evaluate/<branch>/finished/`), keyed by everything its numbers depend on:

    the stage's config hash, the target and train markers' bytes (a retrained drafter has a new marker),
    the code's git sha and dirty flag, the world size, and the dataset's evaluation + calibration prompts.

A rerun reuses a dataset only when the key matches (its MLflow runs were logged before the record was
written, so nothing is logged twice); anything else recomputes it. The records are removed once the stage
finishes: they exist for interrupted runs only, so a deliberate rerun always measures again.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from draftforge.errors import StageError
from draftforge.io import read_json, sha256_file, sha256_json, write_json
from draftforge.provenance import git_state

log = logging.getLogger(__name__)


def _dir(ctx) -> Path:
    return ctx.work_dir / "finished"


def dataset_key(ctx, upstream: list[Path], dataset: str, prompts: list[Any], calibration: list[Any]) -> str:
    """The key a finished dataset is reused under (see the module docstring)."""
    return sha256_json({
        "config": ctx.config_hash, "upstream": {p.name: sha256_file(p) for p in upstream}, "code": git_state(),
        "world_size": ctx.world_size, "dataset": dataset, "prompts": prompts, "calibration": calibration,
    })[:16]  # fmt: skip


def load_finished(ctx, dataset: str, key: str) -> dict[str, Any] | None:
    """The payload of `dataset` from an interrupted run with the same key; None otherwise (a record that
    cannot be read is ignored and recomputed, never trusted)."""
    path = _dir(ctx) / f"{dataset}.json"
    if not path.is_file():
        return None
    try:
        record = read_json(path, "finished-dataset record")
    except StageError as exc:  # a torn or foreign file: measure again
        log.warning("%s; evaluating %s again", exc, dataset)
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    payload = record.get("payload")
    return payload if isinstance(payload, dict) and isinstance(payload.get("rows"), list) else None


def save_finished(ctx, dataset: str, key: str, payload: dict[str, Any]) -> None:
    write_json(_dir(ctx) / f"{dataset}.json", {"key": key, "payload": payload})


def clear_finished(ctx) -> None:
    shutil.rmtree(_dir(ctx), ignore_errors=True)
