"""Resumable checkpoints in ctx.work_dir (outside Snakemake's declared outputs).

A checkpoint holds everything a resumed run needs to continue the exact stream: drafter weights,
optimizer and scheduler state, step / epoch / position in the epoch, RNG states, best-so-far, the
metric history, and a `resume_key` (config + inputs fingerprint) so a changed config starts fresh
instead of silently mixing runs. Files are written atomically; `latest` names the newest one.

Loading never unpickles arbitrary objects: `torch.load(weights_only=True)` with an explicit
allow-list (CHECKPOINT_GLOBALS) of the few non-tensor types a checkpoint holds. A file that needs
anything else is refused with one line naming it (it was not written by this code).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch

from draftforge.errors import StageError
from draftforge.io import atomic_path, write_text

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Everything a checkpoint holds beyond tensors, dicts, lists, tuples, str, int, float, bool and None.
CHECKPOINT_GLOBALS: list = []


def _load(path: Path) -> dict[str, Any]:
    try:
        with torch.serialization.safe_globals(CHECKPOINT_GLOBALS):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError (disallowed global), truncated or corrupt file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"{path}: not a loadable draftforge checkpoint ({first[:200]}); delete it (training "
                         "restarts from the previous checkpoint or from scratch)") from None
    if not isinstance(payload, dict):
        raise StageError(f"{path}: not a draftforge checkpoint (holds {type(payload).__name__}); delete it")
    return payload


def save_checkpoint(ckpt_dir: Path, step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:08d}.pt"
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    write_text(ckpt_dir / "latest", path.name + "\n")
    old = sorted(ckpt_dir.glob("step-*.pt"))[:-keep] if keep > 0 else []
    for stale in old:
        stale.unlink(missing_ok=True)
    return path


def load_latest(ckpt_dir: Path, resume_key: str) -> dict[str, Any] | None:
    """The newest checkpoint with a matching resume_key, or None (fresh start)."""
    pointer = ckpt_dir / "latest"
    if not pointer.is_file():
        return None
    path = ckpt_dir / pointer.read_text().strip()
    if not path.is_file():
        log.warning("%s: points to missing %s; starting fresh", pointer, path.name)
        return None
    payload = _load(path)
    if payload.get("resume_key") != resume_key:
        log.warning("%s: written for another config/inputs (resume key differs); starting fresh", path)
        return None
    log.info("resuming from %s (step %d)", path, payload["step"])
    return payload


def save_best(ckpt_dir: Path, state_dict: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    path = ckpt_dir / "best.pt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"model": {k: v.detach().cpu().clone() for k, v in state_dict.items()}, **meta}, tmp)
    return path


def load_best(ckpt_dir: Path) -> dict[str, Any] | None:
    path = ckpt_dir / "best.pt"
    return _load(path) if path.is_file() else None
