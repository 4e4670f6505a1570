"""Curate shards in, extraction shards planned: which input rows make up shard i.

Invariant: the plan is a pure function of the input files (names, row order, lengths) and of the
shard/window settings, never of the world size. Shard i is therefore the same set of sequences in the
same order for 1 or N processes (or K jobs: part k of K is the k-th contiguous range of shards), and rank r
of N owns shards i ≡ r (mod N) of its part.

Within a sort window of consecutive rows, sequences are sorted by length (longest first, ties by row)
and cut greedily into shards, so each shard holds sequences of similar length (little padding).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from draftforge.errors import StageError

if TYPE_CHECKING:  # pyarrow is imported where files are read (benchmarks run without it)
    import pyarrow as pa

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask", "n_tokens")


@dataclass
class SplitInputs:
    split: str
    files: list[Path]
    file_rows: list[int]  # rows per file
    lengths: np.ndarray  # (rows,) int64 n_tokens before truncation, in file order

    @property
    def row_starts(self) -> np.ndarray:  # (files+1,) first row of each file
        return np.concatenate([[0], np.cumsum(self.file_rows)]).astype(np.int64)


@dataclass
class ShardSpec:
    index: int  # global shard number (file shard-<index>.safetensors)
    split: str
    rows: np.ndarray  # (S,) int64 rows of the split, in stored order (length-descending)
    lengths: np.ndarray  # (S,) int64 stored lengths (after truncation to max_seq_len)

    @property
    def n_seqs(self) -> int:
        return int(self.rows.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class ExtractPlan:
    splits: dict[str, SplitInputs]
    shards: list[ShardSpec]
    key: str  # hash of inputs + plan settings: resume state from another plan is never reused
    n_truncated: int = 0
    inputs_key: str = ""  # hash of the curate inputs and plan settings alone (no extra_key)
    meta: dict = field(default_factory=dict)

    def part(self, part: int, parts: int) -> list[ShardSpec]:
        """Part `part` of `parts` (extract.jobs): a contiguous range of shards; the parts' sizes differ by at most
        one, they are disjoint and cover the plan."""
        n = len(self.shards)
        return self.shards[part * n // parts : (part + 1) * n // parts]

    def owned(self, rank: int, world_size: int, part: int = 0, parts: int = 1) -> list[ShardSpec]:
        """Rank r of N (of one part's job) owns the part's shards i ≡ r (mod N)."""
        return [s for s in self.part(part, parts) if s.index % world_size == rank]


def list_split(curate_dir: Path, split: str) -> SplitInputs | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(curate_dir.glob(f"{split}-*.parquet"))
    if not files:
        return None
    lengths: list[np.ndarray] = []
    rows: list[int] = []
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as exc:
            raise StageError(f"{f}: not a readable parquet file ({exc})") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            raise StageError(f"{f}: missing column(s) {missing}; curate shards need {list(REQUIRED_COLUMNS)}")
        n = pq.read_table(f, columns=["n_tokens"]).column("n_tokens").to_numpy(zero_copy_only=False)
        if n.size and int(n.min()) < 1:
            raise StageError(f"{f}: column n_tokens has a value < 1 at row {int(np.argmin(n))}")
        lengths.append(n.astype(np.int64))
        rows.append(int(n.shape[0]))
    return SplitInputs(split, files, rows, np.concatenate(lengths) if lengths else np.zeros(0, np.int64))


def _cut(order: np.ndarray, lengths: np.ndarray, tokens_per_shard: int, seqs_per_shard: int) -> list[np.ndarray]:
    """Greedy cut of rows (already ordered) into groups of ≤ tokens_per_shard tokens, ≤ seqs_per_shard rows."""
    groups: list[np.ndarray] = []
    start, tokens = 0, 0
    for i, row in enumerate(order):
        n = int(lengths[row])
        if i > start and (tokens + n > tokens_per_shard or i - start >= seqs_per_shard):
            groups.append(order[start:i])
            start, tokens = i, 0
        tokens += n
    if start < len(order):
        groups.append(order[start:])
    return groups


def plan_extraction(
    curate_dir: str | Path,
    splits: list[str],
    *,
    max_seq_len: int,
    tokens_per_shard: int,
    seqs_per_shard: int,
    sort_window: int,
    extra_key: dict | None = None,
) -> ExtractPlan:
    curate_dir = Path(curate_dir)
    found = {s: si for s in splits if (si := list_split(curate_dir, s)) is not None}
    if not found:
        raise StageError(f"{curate_dir}: no curate shards ({', '.join(f'{s}-*.parquet' for s in splits)})")
    digest = hashlib.sha256(json.dumps(extra_key or {}, sort_keys=True).encode())
    inputs = hashlib.sha256()
    settings = json.dumps([max_seq_len, tokens_per_shard, seqs_per_shard, sort_window]).encode()
    digest.update(settings)
    inputs.update(settings)
    shards: list[ShardSpec] = []
    n_truncated = 0
    for split, si in found.items():
        for h in (digest, inputs):
            h.update(json.dumps([split, [(f.name, f.stat().st_size) for f in si.files]]).encode())
            h.update(si.lengths.tobytes())
        stored = np.minimum(si.lengths, max_seq_len)
        n_truncated += int((si.lengths > max_seq_len).sum())
        for w0 in range(0, stored.shape[0], sort_window):
            rows = np.arange(w0, min(w0 + sort_window, stored.shape[0]), dtype=np.int64)
            order = rows[np.lexsort((rows, -stored[rows]))]  # longest first, ties by row (stable)
            for group in _cut(order, stored, tokens_per_shard, seqs_per_shard):
                shards.append(ShardSpec(len(shards), split, group, stored[group]))
    return ExtractPlan(found, shards, digest.hexdigest()[:16], n_truncated, inputs_key=inputs.hexdigest()[:16])


@dataclass
class ShardRows:
    """The input rows of one shard, packed: sequence s is tokens offsets[s]:offsets[s+1]."""

    input_ids: np.ndarray  # (N,) int32
    loss_mask: np.ndarray  # (N,) uint8
    offsets: np.ndarray  # (S+1,) int64


class InputReader:
    """Reads a shard's rows from the curate parquet files; caches the last file read (shards of a
    sort window come from the same one or two files)."""

    def __init__(self, plan: ExtractPlan, vocab_size: int, max_seq_len: int) -> None:
        self.plan = plan
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self._cache: dict[Path, "pa.Table"] = {}

    def _table(self, path: Path) -> "pa.Table":
        import pyarrow.parquet as pq

        if path not in self._cache:
            if len(self._cache) >= 2:  # keep the two most recent files (a window spans ≤ 2 usually)
                self._cache.pop(next(iter(self._cache)))
            self._cache[path] = pq.read_table(path, columns=list(REQUIRED_COLUMNS))
        return self._cache[path]

    def load(self, shard: ShardSpec) -> ShardRows:
        si = self.plan.splits[shard.split]
        starts = si.row_starts
        file_of = np.searchsorted(starts, shard.rows, side="right") - 1  # (S,)
        ids_out: list[np.ndarray | None] = [None] * shard.n_seqs
        mask_out: list[np.ndarray | None] = [None] * shard.n_seqs
        for f in np.unique(file_of).tolist():  # each file read once per shard
            path = si.files[f]
            table = self._table(path)
            for pos in np.nonzero(file_of == f)[0].tolist():
                local = int(shard.rows[pos]) - int(starts[f])
                ids, mask = self._row(path, table, local)
                stored_len = int(shard.lengths[pos])
                ids_out[pos], mask_out[pos] = ids[:stored_len].astype(np.int32), mask[:stored_len].astype(np.uint8)
        offsets = np.concatenate([[0], np.cumsum(shard.lengths)]).astype(np.int64)
        return ShardRows(np.concatenate(ids_out), np.concatenate(mask_out), offsets)

    def _row(self, path: Path, table: "pa.Table", local: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(table.column("input_ids")[local].values.to_numpy(zero_copy_only=False))
        mask = np.asarray(table.column("loss_mask")[local].values.to_numpy(zero_copy_only=False))
        n_tok = int(table.column("n_tokens")[local].as_py())
        if ids.shape[0] != n_tok or mask.shape[0] != n_tok:
            rid = table.column("id")[local].as_py()
            raise StageError(
                f"{path}: row {local} (id {rid!r}): len(input_ids)={ids.shape[0]}, "
                f"len(loss_mask)={mask.shape[0]}, n_tokens={n_tok} must agree"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            rid = table.column("id")[local].as_py()
            raise StageError(f"{path}: row {local} (id {rid!r}): input_ids outside [0, {self.vocab_size})")
        return ids, mask
