"""Online features (`train.features=online`): the target runs beside the drafter and computes the
tapped layer outputs of each training sequence when the batch is built; nothing goes to disk.

The sequences and their order are exactly the offline feature store's: the curate shards are planned
with the extract stage's own planner and settings (`extract.max_seq_len`, `sort_window`,
`tokens_per_shard`, `seqs_per_shard`), so index i here is sequence i of the extract index, and the
features are the extract stage's (same hooks, same early stop after the last tap, same attention
implementation). Training, metrics and resume are unchanged; only the FeatureSource differs. An
objective that needs the target's distribution (KL / TV terms, acceptance weighting) also gets the
final-normed last layer (`last_hidden`, the 4th item element, as extract stores it for such a drafter):
the forward then runs every layer (no early stop), never the LM head.

Cost: one target prefill per training sequence and epoch (and per val sequence per evaluation),
against offline's one prefill per sequence plus the feature store (n_taps x H x 2 bytes per token in
bf16: 40 KiB/token for Qwen3-8B with 5 taps).
"""

from __future__ import annotations

import bisect
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftforge.errors import StageError
from draftforge.extract.capture import TapCapture
from draftforge.extract.plan import ExtractPlan, InputReader, ShardRows, plan_extraction
from draftforge.train.data import count_labels

SeqTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class OnlineTarget:
    """The frozen target with hooks on its tapped layers; one forward at a time (the train batches
    are built on a prefetch thread while evaluation runs on the main one; hooks are per model)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], device: torch.device, feat_dtype: torch.dtype,
                 last: bool = False) -> None:  # fmt: skip
        self.capture = TapCapture(model, list(layer_ids), stop_after_last=True, capture_last=last)
        self.device, self.feat_dtype = device, feat_dtype
        self._lock = threading.Lock()

    def features(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids (T,) → ((T, n_taps*H), (T, H) final-normed last layer or None) in feat_dtype on the device."""
        x = torch.from_numpy(ids.astype(np.int64))[None].to(self.device)
        mask = torch.ones_like(x)
        valid = torch.arange(x.shape[1], device=self.device)
        with self._lock:
            out = self.capture.run(x, mask, valid)
            last = self.capture.last_out
        # normal tensors (run() is under inference_mode)
        return out.to(self.feat_dtype).clone(), (None if last is None else last.to(self.feat_dtype).clone())


class OnlineSource:
    """One split as a random-access FeatureSource whose features the target computes on access."""

    stored_features = False

    def __init__(self, plan: ExtractPlan, split: str, target: OnlineTarget, vocab_size: int, max_seq_len: int) -> None:
        self.split, self.target = split, target
        reader = InputReader(plan, vocab_size, max_seq_len)
        self._rows: list[ShardRows] = [reader.load(s) for s in plan.shards if s.split == split]
        self._starts: list[int] = []
        total = 0
        for r in self._rows:
            self._starts.append(total)
            total += int(r.offsets.shape[0]) - 1
        self._n = total

    def __len__(self) -> int:
        return self._n

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        j = bisect.bisect_right(self._starts, i) - 1
        rows, s = self._rows[j], i - self._starts[j]
        a, b = int(rows.offsets[s]), int(rows.offsets[s + 1])
        return rows.input_ids[a:b], rows.loss_mask[a:b]

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for r in self._rows:
            counts += count_labels(torch.from_numpy(r.input_ids.astype(np.int64)), torch.from_numpy(r.loss_mask), vocab_size)
        return counts

    def __getitem__(self, i: int) -> SeqTuple | tuple[torch.Tensor, ...]:
        if not 0 <= i < self._n:
            raise IndexError(i)
        ids, mask = self.tokens(i)
        hidden, last = self.target.features(ids)
        item = (torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.uint8)), hidden)
        return item if last is None else (*item, last)


def plan_online(curate_dir: str | Path, extract_cfg: Any) -> ExtractPlan:
    """The extract stage's plan of the curate shards (train and val), from its own settings."""
    return plan_extraction(curate_dir, ["train", "val"], max_seq_len=int(extract_cfg.max_seq_len),
                           tokens_per_shard=int(extract_cfg.tokens_per_shard), seqs_per_shard=int(extract_cfg.seqs_per_shard),
                           sort_window=int(extract_cfg.sort_window))  # fmt: skip


def open_online(curate_dir: str | Path, info: dict[str, Any], extract_cfg: Any, device: torch.device,
                feat_dtype: torch.dtype, last: bool = False) -> tuple[OnlineSource, OnlineSource | None, str]:  # fmt: skip
    """(train, val-or-None, plan key): the target loaded on `device` in feat_dtype, eager attention on
    CPU (exact, as extract) and SDPA on CUDA; `last`: items also carry the final-normed last layer."""
    from draftforge.target.load import load_target_model

    plan = plan_online(curate_dir, extract_cfg)
    if "train" not in plan.splits or plan.splits["train"].lengths.size == 0:
        raise StageError(f"{curate_dir}: no `train` rows to train on")
    model = load_target_model(info, dtype=feat_dtype, device=str(device))
    model.set_attn_implementation("sdpa" if device.type == "cuda" else "eager")
    for p in model.parameters():
        p.requires_grad_(False)
    target = OnlineTarget(model, list(info["drafter"]["target_layer_ids"]), device, feat_dtype, last=last)
    vocab, max_len = int(info["vocab_size"]), int(extract_cfg.max_seq_len)
    train = OnlineSource(plan, "train", target, vocab, max_len)
    val = OnlineSource(plan, "val", target, vocab, max_len) if "val" in plan.splits else None
    return train, (val if val is not None and len(val) > 0 else None), plan.key
