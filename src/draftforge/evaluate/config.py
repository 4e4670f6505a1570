"""Typed config of the `evaluate` stage (torch-free). Owned by the evaluate stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class EvaluateConfig:
    datasets: List[str] = field(default_factory=lambda: ["humaneval", "gsm_symbolic", "chitchat"])
    num_prompts: int = 10
    max_new_tokens: int = 128
    temperatures: List[float] = field(default_factory=lambda: [0.0])
    methods: List[str] = field(default_factory=lambda: ["ar", "dflash", "ddtree"])
    budgets: List[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])
    gpus: int = 0
    warmup: int = 1
    seed: int = 0
