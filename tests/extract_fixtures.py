"""Fixtures for the extract tests: curate-format parquet shards and a ready experiment folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftforge.io import write_json

EXPERIMENT = "smoke"


def write_curate_shards(curate_dir: Path, *, lengths: dict[str, list[list[int]]], vocab: int = 512, seed: int = 0,
                        fingerprint: str | None = None, chat_template_kwargs: dict | None = None) -> dict[str, list[np.ndarray]]:  # fmt: skip
    """lengths = {split: [[len, len, ...] per file]} → curate-format parquet files + manifest.json (with the chat mode
    curate recorded when `chat_template_kwargs` is given). Returns the input_ids per split in row order."""
    rng = np.random.default_rng(seed)
    curate_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[np.ndarray]] = {}
    for split, files in lengths.items():
        out[split] = []
        for f, lens in enumerate(files):
            ids = [rng.integers(6, vocab, size=n).astype(np.int32) for n in lens]
            masks = [(rng.random(n) < 0.6).astype(np.uint8) for n in lens]
            table = pa.table({
                "id": [f"{split}-{f}-{i}" for i in range(len(lens))],
                "source": ["fixture"] * len(lens),
                "input_ids": pa.array([x.tolist() for x in ids], type=pa.list_(pa.int32())),
                "loss_mask": pa.array([m.tolist() for m in masks], type=pa.list_(pa.uint8())),
                "n_tokens": pa.array(lens, type=pa.int32()),
            })  # fmt: skip
            pq.write_table(table, curate_dir / f"{split}-{f:05d}.parquet")
            out[split].extend(ids)
    manifest = {"splits": {s: sum(len(x) for x in fl) for s, fl in lengths.items()}}
    if fingerprint is not None:
        manifest["target_fingerprint"] = fingerprint
    if chat_template_kwargs is not None:
        manifest["chat_template_kwargs"] = chat_template_kwargs
    write_json(curate_dir / "manifest.json", manifest)
    return out


def make_experiment(root: Path, target_info: dict, lengths: dict[str, list[list[int]]], **kw) -> dict[str, list[np.ndarray]]:
    """results_root/<EXPERIMENT>/{target/target.json, curate/*} ready for the extract stage."""
    write_json(root / EXPERIMENT / "target" / "target.json", target_info)
    return write_curate_shards(root / EXPERIMENT / "curate", lengths=lengths, vocab=target_info["vocab_size"],
                               fingerprint=target_info["fingerprint"], **kw)  # fmt: skip


def overrides(root: Path, *extra: str) -> list[str]:
    return [
        f"experiment={EXPERIMENT}", f"results_root={root}", "target=tiny-random",
        "tracking.enabled=false", "extract.tokens_per_shard=160", "extract.tokens_per_batch=96",
        "extract.sort_window=16", "extract.storage_dtype=float32", *extra,
    ]  # fmt: skip


def context(root: Path, *extra: str):
    from draftforge.cli import make_context

    ctx = make_context("extract", overrides(root, *extra))
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    return ctx


LENGTHS = {"train": [[37, 5, 60, 12, 12, 1, 44], [29, 3, 71, 18]], "val": [[33, 9, 21]]}
