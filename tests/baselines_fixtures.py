"""Helpers for the baselines tests: fake `vllm` packages (harness failure paths without an engine),
and a random exported DFlash drafter."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def fake_vllm(root: Path, body: str) -> Path:
    """A directory holding a `vllm` package whose import runs `body`; prepend it to PYTHONPATH."""
    pkg = root / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    return root


def plain_cfg(**overrides: Any) -> SimpleNamespace:
    """A BaselinesConfig-like object (attribute access) with the packaged defaults."""
    from omegaconf import OmegaConf

    from draftforge.baselines.config import BaselinesConfig

    cfg = OmegaConf.structured(BaselinesConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def export_random_drafter(info: dict, out_dir: Path, seed: int = 0) -> Path:
    """A random DFlash drafter for `info`'s target, exported in vLLM's dflash layout (fp32)."""
    import torch

    from drafter_fixtures import drafter_of
    from draftforge.drafter import DFlashConfig, DFlashDrafter, export_drafter

    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(info, drafter_of())  # tiny-random's drafter shape: 1 layer, block 8
    model = DFlashDrafter(cfg)
    return export_drafter(model, cfg, out_dir, dtype=torch.float32)
