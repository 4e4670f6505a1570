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


def tiny_pipeline(results_root: Path, experiment: str = "smoke", drafter_std: float = 0.3, dspark_rank: int = 0) -> dict:
    """target.json (tiny-random Llama) + an exported random drafter + train marker. Returns target info.
    dspark_rank > 0: a DSpark drafter with a random (non-zero) Markov head of that rank, in the dspark branch
    (evaluate then runs with drafter=dspark); else the dflash branch."""
    branch = "dspark" if dspark_rank else "dflash"
    # the whole vocabulary: tiny-random's 512 tokens are fewer than conf/drafter/dspark.yaml's 8,192-token draft vocabulary
    cfg = compose(experiment, ["target=tiny-random", f"results_root={results_root}", f"drafter={branch}",
                               "drafter.draft_vocab_size=0"])
    info = resolve_target(cfg.target, results_root)
    write_json(stage_marker(results_root, cfg.experiment_name, "target"), info)
    dcfg = DFlashConfig.from_target(info, cfg.drafter)
    torch.manual_seed(0)
    if dspark_rank:
        from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter

        dcfg = DSparkConfig.from_dflash(dcfg, markov_rank=dspark_rank)
        drafter = DSparkDrafter(dcfg)
        drafter.reset_parameters(std=drafter_std)
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, 0.0, dspark_rank**-0.5)
    else:
        drafter = DFlashDrafter(dcfg)
        drafter.reset_parameters(std=drafter_std)
    export_drafter(drafter, dcfg, stage_dir(results_root, cfg.experiment_name, "train", branch) / "drafter", dtype=torch.float32)
    write_json(stage_marker(results_root, cfg.experiment_name, "train", branch), {"note": "test fixture"})
    return info
