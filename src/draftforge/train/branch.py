"""What the train stage runs for one drafter branch, and the steps every branch shares before its loop.

A branch builder (`train.stage.task_for` picks it by drafter type) turns (ctx, cfg, target info) into a
`Branch`: the `trainer.TrainTask` and `trainer.LoopSpec` the one loop runs on every rank, and `finish`, which
rank 0 calls after a finished run to export the selected weights and build metrics.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftforge.errors import StageError
from draftforge.extract.preflight import FreeBytes, fmt_bytes
from draftforge.runtime import init_distributed, pick_device
from draftforge.train.config import TrainConfig
from draftforge.train.trainer import LoopResult, LoopSpec, TrainTask


@dataclass
class Branch:
    """`task` through `trainer.run` with `spec` on every rank, then `finish(result, run)` on rank 0: the export
    and metrics.json's content. `task` None: nothing to train; `finish(None, None)` is the marker's content."""

    task: TrainTask | None
    spec: LoopSpec | None
    finish: Callable[[LoopResult | None, Any], dict[str, Any]]
    label: str = "train"  # prefix of the stop message
    run_name: str = ""  # the MLflow run
    run_params: dict[str, Any] = field(default_factory=dict)


# A branch builder: (ctx, cfg, target info, free-space probe) -> Branch.
BranchBuilder = Callable[[Any, TrainConfig, dict[str, Any], FreeBytes], Branch]


def open_device(ctx, cfg: TrainConfig) -> torch.device:
    """This rank's device; joins the torchrun group (NCCL on CUDA, gloo on CPU) when there are several ranks."""
    device = pick_device("train.device", cfg.device, cfg.gpus, ctx.local_rank)
    init_distributed(ctx.world_size, device, cfg.dist_timeout_min)
    return device


DISK_MARGIN = 1.2


def disk_needed(n_params: int, cfg: TrainConfig) -> int:
    """Bytes train writes at most for a model of n_params trainable parameters: `keep_checkpoints` + 1 in
    flight (fp32 weights + AdamW moments + the best weights so far), best.pt (fp32 weights) and the export."""
    export_bytes = torch.empty((), dtype=getattr(torch, cfg.export_dtype)).element_size()
    return n_params * (16 * (max(cfg.keep_checkpoints, 1) + 1) + 4 + export_bytes) + (1 << 20)


def check_disk(ckpt_dir: Path, out_dir: Path, n_params: int, cfg: TrainConfig, free_bytes: FreeBytes) -> None:
    """Refuse to start (one line) when checkpoints and the export cannot fit; nothing is touched."""
    have = sum(p.stat().st_size for p in ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else 0
    need = max(0, disk_needed(n_params, cfg) - have)
    free = min(free_bytes(ckpt_dir), free_bytes(out_dir))
    if need * DISK_MARGIN > free:
        raise StageError(f"{ckpt_dir}: not enough disk for training checkpoints and the export: need ~{fmt_bytes(need)} "
                         f"(x {DISK_MARGIN} margin) but {fmt_bytes(free)} is free; free space, point results_root "
                         f"elsewhere, or lower train.keep_checkpoints (now {cfg.keep_checkpoints})")  # fmt: skip
