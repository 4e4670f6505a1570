"""Per-rank extraction loop: own shards → batches → tapped states → shard files (resumable).

Resume design: shards are written into `<work_dir>/shards/<plan key>/` (Snakemake never deletes the
work area), each followed by `shard-NNNNN.done.json` (its checksum and size). A shard counts as done
only when both exist and agree; a rerun skips done shards, so only missing ones are recomputed. The
plan key hashes the inputs and the settings that change bytes, so stale shards are never reused.
At the end the stage hard-links the shards into the declared output folder and writes index.json.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from draftforge.errors import StageError
from draftforge.extract.batching import make_batches, pad_batch
from draftforge.extract.capture import TapCapture
from draftforge.extract.config import ExtractConfig
from draftforge.extract.plan import ExtractPlan, InputReader, ShardRows, ShardSpec
from draftforge.extract.shard_format import STORAGE_TORCH_DTYPES, encode_hidden, shard_name, write_shard
from draftforge.io import read_json, write_json

log = logging.getLogger(__name__)
# Every rank reports its own throughput (the CLI quiets INFO on ranks > 0; this logger stays at INFO).
rank_log = logging.getLogger("draftforge.extract.rank")
rank_log.setLevel(logging.INFO)


@dataclass
class TargetView:
    """What extraction needs to know about the target (from target.json)."""

    model: torch.nn.Module
    layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    pad_id: int
    fingerprint: str


@dataclass
class RankStats:
    rank: int
    shards_computed: int = 0
    shards_resumed: int = 0
    tokens: int = 0  # valid tokens computed by this rank
    padded_tokens: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "shards_computed": self.shards_computed, "shards_resumed": self.shards_resumed,
            "tokens": self.tokens, "padded_tokens": self.padded_tokens, "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens_per_s, 1),
        }  # fmt: skip


def done_path(shard_dir: Path, index: int) -> Path:
    return shard_dir / shard_name(index).replace(".safetensors", ".done.json")


def read_done(shard_dir: Path, shard: ShardSpec, plan_key: str) -> dict[str, Any] | None:
    """The done record of a shard if the shard is complete for this plan, else None."""
    marker, path = done_path(shard_dir, shard.index), shard_dir / shard_name(shard.index)
    if not marker.is_file() or not path.is_file():
        return None
    try:
        rec = read_json(marker, what="shard done record")
    except StageError:
        return None
    if rec.get("plan_key") != plan_key or rec.get("n_bytes") != path.stat().st_size:
        return None
    return rec


class ShardExtractor:
    """Computes one shard's tensors; the write happens on a background thread (overlaps compute)."""

    def __init__(self, target: TargetView, *, storage_dtype: str, tokens_per_batch: int, device: torch.device,
                 stop_after_last_tap: bool = True, max_shard_tokens: int = 0, n_buffers: int = 2,
                 store_last: bool = False, batch_fill: float = ExtractConfig.batch_fill) -> None:  # fmt: skip
        self.target = target
        self.capture = TapCapture(target.model, target.layer_ids, stop_after_last=stop_after_last_tap,
                                  capture_last=store_last)
        self.storage_dtype = storage_dtype
        self.tokens_per_batch, self.batch_fill = tokens_per_batch, batch_fill
        self.device = device
        self.n_taps = len(target.layer_ids)
        self.dim = self.n_taps * target.hidden_size
        # n_buffers host buffers: one is filled while writer threads save the others.
        pin = device.type == "cuda"
        dtype = STORAGE_TORCH_DTYPES[storage_dtype]
        fp8 = storage_dtype == "float8_e4m3fn"
        self._host = [torch.empty((max_shard_tokens, self.dim), dtype=dtype, pin_memory=pin) for _ in range(n_buffers)]
        self._scale = [torch.empty((max_shard_tokens, self.n_taps), dtype=torch.float32, pin_memory=pin) if fp8
                       else None for _ in range(n_buffers)]  # fmt: skip
        # The target's final-normed last layer (`last_hidden`, (N, H)): bf16 when the taps are fp8.
        self.last_dtype = torch.bfloat16 if fp8 else dtype
        self._last = [torch.empty((max_shard_tokens, target.hidden_size), dtype=self.last_dtype, pin_memory=pin)
                      if store_last else None for _ in range(n_buffers)]  # fmt: skip

    def compute(self, rows, shard: ShardSpec, slot: int) -> tuple[dict[str, torch.Tensor], int]:
        """rows: ShardRows → (tensors of the shard, padded tokens). Uses host buffer `slot`."""
        n = shard.n_tokens
        hidden, scale = self._host[slot][:n], (self._scale[slot][:n] if self._scale[slot] is not None else None)
        last = self._last[slot][:n] if self._last[slot] is not None else None
        padded = 0
        for batch in make_batches(shard.lengths, self.tokens_per_batch, self.batch_fill):
            ids, mask, valid = pad_batch(rows.input_ids, rows.offsets, batch, self.target.pad_id, self.device)
            feats = self.capture.run(ids, mask, valid)  # (n_b, n_taps·H), valid tokens in shard order
            if feats.shape[0] != batch.n_tokens:
                raise RuntimeError(f"batch produced {feats.shape[0]} rows, expected {batch.n_tokens}")
            enc, sc = encode_hidden(feats, self.n_taps, self.storage_dtype)
            sl = slice(batch.token_start, batch.token_start + batch.n_tokens)
            hidden[sl].copy_(enc, non_blocking=True)
            if scale is not None:
                scale[sl].copy_(sc, non_blocking=True)
            if last is not None:
                last[sl].copy_(self.capture.last_out.to(self.last_dtype), non_blocking=True)
            padded += ids.numel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tensors = {
            "hidden": hidden,
            "input_ids": torch.from_numpy(rows.input_ids),
            "loss_mask": torch.from_numpy(rows.loss_mask),
            "offsets": torch.from_numpy(rows.offsets),
            "seq_index": torch.from_numpy(shard.rows.astype(np.int64)),
        }
        if scale is not None:
            tensors["hidden_scale"] = scale
        if last is not None:
            tensors["last_hidden"] = last
        return tensors, padded


def _save(shard_dir: Path, shard: ShardSpec, tensors: dict[str, torch.Tensor], plan_key: str) -> int:
    path = shard_dir / shard_name(shard.index)
    digest, size = write_shard(path, tensors)
    write_json(done_path(shard_dir, shard.index), {
        "file": path.name, "index": shard.index, "split": shard.split, "n_seqs": shard.n_seqs,
        "n_tokens": shard.n_tokens, "n_loss_tokens": int(tensors["loss_mask"].sum()), "n_bytes": size,
        "sha256": digest, "plan_key": plan_key,
    })  # fmt: skip
    return size


def run_rank(
    plan: ExtractPlan,
    target: TargetView,
    shard_dir: Path,
    *,
    rank: int,
    world_size: int,
    storage_dtype: str,
    tokens_per_batch: int,
    max_seq_len: int,
    device: torch.device,
    batch_fill: float = ExtractConfig.batch_fill,
    stop_after_last_tap: bool = True,
    store_last: bool = False,
    progress: bool = True,
    writer_threads: int = 2,
    stop_after: int | None = None,
    load_rows: Callable[[ShardSpec], ShardRows] | None = None,
    part: int = 0,
    parts: int = 1,
) -> RankStats:
    """Extract every shard this rank owns (of part `part` of `parts`: extract.jobs) that is not done yet. `stop_after` (tests): end after that
    many computed shards, as a kill would. `load_rows` (benchmarks): rows of a shard; default reads
    the curate parquet files."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    stats = RankStats(rank)
    todo = []
    for shard in plan.owned(rank, world_size, part, parts):
        if read_done(shard_dir, shard, plan.key) is None:
            todo.append(shard)
        else:
            stats.shards_resumed += 1
    if not todo:
        return stats
    load_rows = load_rows or InputReader(plan, target.vocab_size, max_seq_len).load
    n_buffers = writer_threads + 1
    extractor = ShardExtractor(target, storage_dtype=storage_dtype, tokens_per_batch=tokens_per_batch, device=device,
                               stop_after_last_tap=stop_after_last_tap, store_last=store_last, batch_fill=batch_fill,
                               max_shard_tokens=max(s.n_tokens for s in todo), n_buffers=n_buffers)  # fmt: skip
    pending: list[Future] = []
    t0 = time.perf_counter()
    bar = tqdm(total=sum(s.n_tokens for s in todo), unit="tok", unit_scale=True, desc=f"extract rank{rank}",
               position=rank, disable=not progress)  # fmt: skip
    with ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="shard-writer") as writer:
        for k, shard in enumerate(todo):
            if stop_after is not None and k >= stop_after:
                break
            slot = k % n_buffers
            if k >= n_buffers:  # the write that used this host buffer must be finished
                stats.bytes_written += pending[k - n_buffers].result()
            rows = load_rows(shard)
            tensors, padded = extractor.compute(rows, shard, slot)
            pending.append(writer.submit(_save, shard_dir, shard, tensors, plan.key))
            stats.shards_computed += 1
            stats.tokens += shard.n_tokens
            stats.padded_tokens += padded
            bar.update(shard.n_tokens)
        for fut in pending[max(0, len(pending) - n_buffers) :]:
            stats.bytes_written += fut.result()
    bar.close()
    stats.seconds = time.perf_counter() - t0
    rank_log.info("rank %d: %d shards, %d tokens in %.1f s = %.0f tokens/s (padding efficiency %.3f)", rank,
             stats.shards_computed, stats.tokens, stats.seconds, stats.tokens_per_s,
             stats.tokens / max(stats.padded_tokens, 1))  # fmt: skip
    return stats
