"""The `drafter` section a stage composes for a target (its target file's shape + the drafter group file)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=None)
def drafter_of(target: str = "tiny-random", drafter: str = "dflash", experiment: str = "smoke") -> Any:
    """DrafterConfig of `drafter=<drafter>` on `target=<target>` (tiny-random: 1 layer, block 8)."""
    from omegaconf import OmegaConf

    from draftforge.config import compose

    return OmegaConf.to_object(compose(experiment, [f"target={target}", f"drafter={drafter}"]).drafter)


def tiny_shape(**changes: Any) -> Any:
    """tiny-random's DFlash drafter section with some fields changed."""
    from dataclasses import replace

    return replace(drafter_of(), **changes)
