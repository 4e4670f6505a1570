"""Disk preflight: refuse to start when the features cannot fit (feature size: docs/architecture.md, "Layer taps").

Estimate = Σ over shards not yet done of tokens × bytes/token (hidden n_taps·H values, fp8 scales,
ids, mask) + per-sequence offsets + a header allowance per shard. Hard links into the output folder
cost no extra bytes, so only the work area's filesystem is checked.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from draftforge.extract.plan import ShardSpec
from draftforge.extract.shard_format import bytes_per_token

HEADER_ALLOWANCE = 4096  # safetensors JSON header + done record, per shard
FreeBytes = Callable[[Path], int]


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def estimate_bytes(shards: Iterable[ShardSpec], feature_dim: int, n_taps: int, storage_dtype: str) -> int:
    per_token = bytes_per_token(feature_dim, n_taps, storage_dtype)
    return sum(s.n_tokens * per_token + (2 * s.n_seqs + 1) * 8 + HEADER_ALLOWANCE for s in shards)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_disk(path: Path, needed: int, margin: float, free_bytes: FreeBytes = disk_free) -> str | None:
    """None when `path`'s filesystem has needed × margin free bytes, else the error message."""
    free = free_bytes(path)
    if needed * margin > free:
        return (f"{path}: not enough disk for the features: need ~{fmt_bytes(needed)} "
                f"(× {margin} margin) but {fmt_bytes(free)} is free; free space, point results_root "
                f"elsewhere, or use extract.storage_dtype=float8_e4m3fn")  # fmt: skip
    return None
