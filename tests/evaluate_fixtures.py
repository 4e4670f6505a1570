"""A finished tiny `target` + `train` stage under a temp results root, for evaluate stage tests."""

from __future__ import annotations

from pathlib import Path

import torch

from draftforge.config import compose
from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.export import export_drafter
from draftforge.drafter.model import DFlashDrafter
from draftforge.io import write_json
from draftforge.paths import stage_dir, stage_marker
from draftforge.target.stage import resolve_target


def tiny_pipeline(results_root: Path, experiment: str = "smoke", drafter_std: float = 0.3) -> dict:
    """target.json (tiny-random Llama) + an exported random drafter + train marker. Returns target info."""
    cfg = compose(experiment, ["target=tiny-random", f"results_root={results_root}"])
    info = resolve_target(cfg.target, results_root)
    write_json(stage_marker(results_root, cfg.experiment_name, "target"), info)
    dcfg = DFlashConfig.from_target(info)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(std=drafter_std)
    export_drafter(drafter, dcfg, stage_dir(results_root, cfg.experiment_name, "train") / "drafter", dtype=torch.float32)
    write_json(stage_marker(results_root, cfg.experiment_name, "train"), {"note": "test fixture"})
    return info
