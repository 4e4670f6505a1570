"""Parquet shard writer (the curate → extract contract) and token statistics.

Shards: `<split>-NNNNN.parquet`, `shard_rows` rows each, columns id (string), source (string),
input_ids (list<int32>), loss_mask (list<uint8>), n_tokens (int32); each written atomically. Only one
shard's rows are in memory. The content depends only on the rows and their order (byte-equal reruns).
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftforge.io import atomic_path

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("n_tokens", pa.int32()),
    ]
)


class ShardWriter:
    def __init__(self, out_dir: Path, split: str, shard_rows: int) -> None:
        self.out_dir, self.split, self.shard_rows = out_dir, split, shard_rows
        self._rows: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
        self.files: list[str] = []
        self.n_rows = 0

    def add(self, row_id: str, source: str, input_ids: list[int], loss_mask: list[int]) -> None:
        if len(input_ids) != len(loss_mask):
            raise ValueError(f"{row_id}: input_ids and loss_mask lengths differ")
        r = self._rows
        r["id"].append(row_id)
        r["source"].append(source)
        r["input_ids"].append(input_ids)
        r["loss_mask"].append(loss_mask)
        r["n_tokens"].append(len(input_ids))
        self.n_rows += 1
        if len(r["id"]) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if not self._rows["id"]:
            return
        name = f"{self.split}-{len(self.files):05d}.parquet"
        table = pa.Table.from_pydict(self._rows, schema=SCHEMA)
        with atomic_path(self.out_dir / name) as tmp:
            pq.write_table(table, tmp, compression="zstd")
        self.files.append(name)
        self._rows = {name: [] for name in SCHEMA.names}


class TokenStats:
    """Per-row token counts (4 bytes per row) for exact percentiles and the histogram."""

    def __init__(self) -> None:
        self.n_tokens = array("i")
        self.n_masked = 0

    def add(self, n_tokens: int, n_masked: int) -> None:
        self.n_tokens.append(n_tokens)
        self.n_masked += n_masked

    def summary(self) -> dict[str, float]:
        if not self.n_tokens:
            return {"rows": 0, "tokens": 0, "masked_tokens": 0}
        a = np.frombuffer(self.n_tokens, dtype=np.int32)
        return {
            "rows": int(a.size),
            "tokens": int(a.sum()),
            "masked_tokens": int(self.n_masked),
            "mean": float(a.mean()),
            "min": int(a.min()),
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
            "max": int(a.max()),
        }

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(np.frombuffer(self.n_tokens, dtype=np.int32), bins=50, color="#4C72B0")
        ax.set_xlabel("tokens per conversation")
        ax.set_ylabel("rows")
        ax.set_title(title)
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
