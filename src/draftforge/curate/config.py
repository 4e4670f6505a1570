"""Typed config of the `curate` stage (torch-free). Owned by the curate stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class SourceConfig:
    name: str = "?"
    kind: str = "?"  # jsonl | parquet | hf_disk | chitchat | chatterbot | gsm_symbolic | stdlib_code
    path: Optional[str] = None
    weight: float = 1.0
    cap: Optional[int] = None  # max rows kept from this source
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class CurateConfig:
    sources: List[SourceConfig] = field(default_factory=list)
    max_rows: Optional[int] = None  # cap on the kept mixture
    val_fraction: float = 0.05
    seed: int = 0
    options: Dict[str, Any] = field(default_factory=dict)
