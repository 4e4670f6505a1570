"""Typed config of the `baselines` stage (torch-free). Owned by the baselines stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class BaselinesConfig:
    methods: List[str] = field(default_factory=lambda: ["ar", "ngram", "dflash", "mtp"])
    num_prompts: int = 10
    max_new_tokens: int = 128
    kv_cache_gib: float = 2.0
