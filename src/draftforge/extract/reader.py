"""FeatureReader: the validated view of extracted features that `train` consumes.

    reader = FeatureReader(index_dir, target_fingerprint=info["fingerprint"],
                           target_layer_ids=info["drafter"]["target_layer_ids"])
    for input_ids, loss_mask, hidden in reader.iter_sequences("train"):
        ...  # (T,) int64, (T,) uint8, (T, n_taps·H) float32 (or `dtype`)

Validation at open: index format, target fingerprint, tapped layer ids, every shard file present with
its recorded size. Checksums: verify="open" hashes every shard at open, "lazy" (default) hashes a
shard the first time it is read, "none" skips. Every failure is one StageError naming the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from draftforge.errors import StageError
from draftforge.extract.shard_format import FORMAT, INDEX_NAME, decode_hidden
from draftforge.io import read_json, sha256_file

VERIFY_MODES = ("open", "lazy", "none")


class FeatureReader:
    def __init__(
        self,
        index_dir: str | Path,
        *,
        target_fingerprint: str,
        target_layer_ids: list[int],
        verify: str = "lazy",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: use one of {VERIFY_MODES}")
        given = Path(index_dir)  # the extract folder or its index.json
        self.index_path = given if given.name == INDEX_NAME else given / INDEX_NAME
        self.dir = self.index_path.parent
        self.index: dict[str, Any] = read_json(self.index_path, what="extract index")
        self.verify = verify
        self.dtype = dtype
        self._verified: set[str] = set()
        self._validate(target_fingerprint, list(target_layer_ids))
        if verify == "open":
            for entry in self.index["shards"]:
                self._check_sum(entry)

    # ---- validation -------------------------------------------------------------------------
    def _validate(self, fingerprint: str, layer_ids: list[int]) -> None:
        idx, where = self.index, self.index_path
        if idx.get("format") != FORMAT:
            raise StageError(f"{where}: format {idx.get('format')!r} is not {FORMAT!r}; rerun the extract stage")
        if idx.get("target_fingerprint") != fingerprint:
            raise StageError(f"{where}: features were extracted from target {str(idx.get('target_fingerprint'))[:12]}, "
                             f"not the requested target {fingerprint[:12]}; rerun the extract stage")  # fmt: skip
        if list(idx.get("target_layer_ids", [])) != layer_ids:
            raise StageError(f"{where}: tapped layers {idx.get('target_layer_ids')} != requested target_layer_ids "
                             f"{layer_ids}; rerun the extract stage with these taps")  # fmt: skip
        for entry in idx["shards"]:
            path = self.dir / entry["file"]
            if not path.is_file():
                raise StageError(f"{path}: shard listed in {where.name} is missing")
            size = path.stat().st_size
            if size != entry["n_bytes"]:
                raise StageError(f"{path}: {size} bytes, index records {entry['n_bytes']} (truncated or replaced)")

    def check_shard(self, entry: dict[str, Any]) -> None:
        """Verify one shard's sha256 against the index (once; later calls are free). Public form of
        the lazy check, for random-access consumers that read shards themselves."""
        self._check_sum(entry)

    def _check_sum(self, entry: dict[str, Any]) -> None:
        if entry["file"] in self._verified:
            return
        path = self.dir / entry["file"]
        if sha256_file(path, chunk=8 << 20) != entry["sha256"]:
            raise StageError(f"{path}: sha256 differs from {self.index_path.name} (corrupt shard); rerun extract")
        self._verified.add(entry["file"])

    # ---- description ------------------------------------------------------------------------
    @property
    def splits(self) -> list[str]:
        return list(self.index["splits"])

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.index["target_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def n_taps(self) -> int:
        return int(self.index["n_taps"])

    @property
    def feature_dim(self) -> int:
        return int(self.index["feature_dim"])

    @property
    def storage_dtype(self) -> str:
        return str(self.index["storage_dtype"])

    def shards(self, split: str) -> list[dict[str, Any]]:
        if split not in self.index["splits"]:
            raise StageError(f"{self.index_path}: no split {split!r} (have {self.splits})")
        return [e for e in self.index["shards"] if e["split"] == split]

    def num_sequences(self, split: str) -> int:
        return sum(e["n_seqs"] for e in self.shards(split))

    def num_tokens(self, split: str) -> int:
        return sum(e["n_tokens"] for e in self.shards(split))

    def num_loss_tokens(self, split: str) -> int:
        return sum(e["n_loss_tokens"] for e in self.shards(split))

    # ---- reading ----------------------------------------------------------------------------
    def read_shard(
        self, entry: dict[str, Any], order: np.ndarray | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Sequences of one shard (index entry), in stored order (longest first) or in `order`."""
        if self.verify != "none":
            self._check_sum(entry)
        path = self.dir / entry["file"]
        try:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                ids, mask, offsets = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
                hidden = f.get_slice("hidden")
                scale = f.get_slice("hidden_scale") if "hidden_scale" in names else None
                if offsets.shape[0] != entry["n_seqs"] + 1 or int(offsets[-1]) != entry["n_tokens"]:
                    raise StageError(f"{path}: offsets disagree with {self.index_path.name} "
                                     f"({offsets.shape[0] - 1} seqs / {int(offsets[-1])} tokens)")  # fmt: skip
                for s in (range(offsets.shape[0] - 1) if order is None else order.tolist()):
                    a, b = int(offsets[s]), int(offsets[s + 1])
                    h = decode_hidden(hidden[a:b], scale[a:b] if scale is not None else None, self.n_taps, self.dtype)
                    yield ids[a:b].to(torch.int64), mask[a:b].to(torch.uint8), h
        except StageError:
            raise
        except Exception as exc:  # safetensors raises its own error types on a corrupt header
            raise StageError(f"{path}: unreadable shard ({type(exc).__name__}: {exc})") from None

    def iter_sequences(
        self, split: str, *, rank: int = 0, world_size: int = 1, shuffle: bool = False, seed: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(input_ids (T,) int64, loss_mask (T,) uint8, hidden (T, n_taps·H) dtype) per sequence.

        Data-parallel readers pass rank/world_size: rank r reads shards j ≡ r (mod world_size) of the
        shard order, so ranks see disjoint sequences. shuffle=True permutes the shard order and the
        sequences inside each shard (seeded: pass e.g. seed=epoch; same on every rank).
        """
        entries = self.shards(split)
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(entries)) if shuffle else np.arange(len(entries))
        for j in order[rank::world_size].tolist():
            inner = np.random.default_rng([seed, j]).permutation(entries[j]["n_seqs"]) if shuffle else None
            yield from self.read_shard(entries[j], inner)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for split in self.splits:
            yield from self.iter_sequences(split)
