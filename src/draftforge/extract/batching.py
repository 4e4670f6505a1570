"""Length-bucketed batches with right padding.

A shard's sequences are stored longest first, so a batch is a run of consecutive sequences and its
valid tokens (row-major) are one contiguous slice of the shard's packed token axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    first: int  # first sequence (shard order)
    stop: int  # one past the last sequence
    token_start: int  # offset of the batch's first valid token in the shard
    n_tokens: int  # valid tokens
    padded_len: int  # T = longest sequence of the batch


def make_batches(lengths: np.ndarray, tokens_per_batch: int, fill: float = 0.0) -> list[Batch]:
    """Greedy packing of consecutive sequences while rows × longest ≤ tokens_per_batch and the batch's
    valid tokens stay ≥ `fill` × its padded tokens (0: no padding limit).

    A sequence longer than tokens_per_batch forms a batch of its own. Works for any order; with
    lengths sorted descending the first row of a batch is its longest (least padding). Padding is
    computed like any token, so the padded share of a batch is its share of wasted work.
    """
    batches: list[Batch] = []
    start, longest, valid = 0, 0, 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for i, n in enumerate(lengths.tolist()):
        grown, rows = max(longest, n), i - start + 1
        if i > start and (grown * rows > tokens_per_batch or valid + n < fill * grown * rows):
            batches.append(Batch(start, i, int(offsets[start]), int(offsets[i] - offsets[start]), longest))
            start, grown, valid = i, n, 0
        longest, valid = grown, valid + n
    if start < len(lengths):
        batches.append(Batch(start, len(lengths), int(offsets[start]), int(offsets[-1] - offsets[start]), longest))
    return batches


def pad_batch(
    input_ids: np.ndarray, offsets: np.ndarray, batch: Batch, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ids → (ids (B, T) long, mask (B, T) long, valid (N,) long flat indices of the mask's
    ones in row-major order), right padded with pad_id (its value never matters: masked)."""
    rows = batch.stop - batch.first
    ids = np.full((rows, batch.padded_len), pad_id, dtype=np.int64)
    mask = np.zeros((rows, batch.padded_len), dtype=np.int64)
    for r in range(rows):
        a, b = int(offsets[batch.first + r]), int(offsets[batch.first + r + 1])
        ids[r, : b - a] = input_ids[a:b]
        mask[r, : b - a] = 1
    valid = np.flatnonzero(mask)  # row-major: batch row, then position = shard token order
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (ids, mask, valid))
