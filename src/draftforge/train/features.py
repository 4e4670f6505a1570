"""Random access to extracted features for training, on top of the extract FeatureReader.

The reader validates the index at open (format, target fingerprint, tapped layer ids, shard files
and sizes) and owns the shard format; here each sequence is read on demand as a slice of its shard
(safetensors mmap), so an epoch can visit sequences in any order without loading whole shards.
A shard's checksum is verified the first time it is touched (the reader's lazy verification).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftforge.errors import StageError
from draftforge.extract.reader import FeatureReader
from draftforge.extract.shard_format import decode_hidden
from draftforge.train.data import count_labels

SeqTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ShardedSource:
    """One split of an extract index as a random-access FeatureSource."""

    stored_features = True

    def __init__(self, reader: FeatureReader, split: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.reader, self.split, self.dtype = reader, split, dtype
        self.entries: list[dict[str, Any]] = reader.shards(split)
        self._starts: list[int] = []
        total = 0
        for e in self.entries:
            self._starts.append(total)
            total += int(e["n_seqs"])
        self._n = total
        self._open: dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, bool]] = {}
        self.has_last: bool | None = None  # shards carry `last_hidden` (known after the first shard opens)

    def __len__(self) -> int:
        return self._n

    def _shard(self, j: int):
        if j not in self._open:
            entry = self.entries[j]
            if self.reader.verify != "none":
                self.reader.check_shard(entry)  # lazy checksum, once per shard
            path = self.reader.dir / entry["file"]
            try:
                fh = safe_open(str(path), framework="pt")
                offsets = fh.get_tensor("offsets")
                ids, mask = fh.get_tensor("input_ids"), fh.get_tensor("loss_mask")
                keys = set(fh.keys())
                has_scale = "hidden_scale" in keys
                self.has_last = "last_hidden" in keys
            except Exception as exc:
                raise StageError(f"{path}: unreadable shard ({type(exc).__name__}: {exc})") from None
            if offsets.shape[0] != int(entry["n_seqs"]) + 1 or int(offsets[-1]) != int(entry["n_tokens"]):
                raise StageError(f"{path}: offsets disagree with {self.reader.index_path.name}")
            self._open[j] = (fh, offsets, ids, mask, has_scale)
        return self._open[j]

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for j in range(len(self.entries)):
            _, _, ids, mask, _ = self._shard(j)
            counts += count_labels(ids, mask, vocab_size)
        return counts

    def __getitem__(self, i: int) -> SeqTuple:
        if not 0 <= i < self._n:
            raise IndexError(i)
        j = bisect.bisect_right(self._starts, i) - 1
        fh, offsets, ids, mask, has_scale = self._shard(j)
        s = i - self._starts[j]
        a, b = int(offsets[s]), int(offsets[s + 1])
        scale = fh.get_slice("hidden_scale")[a:b] if has_scale else None
        hidden = decode_hidden(fh.get_slice("hidden")[a:b], scale, self.reader.n_taps, self.dtype)
        if self.has_last:  # the target's final-normed last layer: a 4th element
            last = fh.get_slice("last_hidden")[a:b].to(self.dtype)
            return ids[a:b].to(torch.int64), mask[a:b].to(torch.uint8), hidden, last  # type: ignore[return-value]
        return ids[a:b].to(torch.int64), mask[a:b].to(torch.uint8), hidden


def open_features(extract_dir: str | Path, info: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> tuple[ShardedSource, ShardedSource | None]:
    """(train, val-or-None) sources; StageError on a different target or different taps."""
    reader = FeatureReader(
        extract_dir, target_fingerprint=info["fingerprint"], target_layer_ids=list(info["drafter"]["target_layer_ids"]), verify="lazy"
    )
    if reader.hidden_size != int(info["hidden_size"]):
        raise StageError(f"{reader.index_path}: hidden_size {reader.hidden_size} != target hidden_size {info['hidden_size']}")
    if "train" not in reader.splits or reader.num_sequences("train") == 0:
        raise StageError(f"{reader.index_path}: no `train` sequences to train on (splits {reader.splits})")
    val = ShardedSource(reader, "val", dtype) if "val" in reader.splits and reader.num_sequences("val") > 0 else None
    return ShardedSource(reader, "train", dtype), val
