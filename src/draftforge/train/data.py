"""Training data: per-sequence features → anchor blocks, epoch order, rank sharding, prefetch.

A FeatureSource is any random-access sequence of (input_ids (T,) int64, loss_mask (T,) uint8,
hidden (T, n_taps*H) float) tuples — the extract FeatureReader's per-sequence tuple.
Determinism: the epoch order and every sequence's anchors depend only on (seed, epoch, sequence
index), never on the world size or on where a run was resumed, so 1 process and W processes with
the same global batch see identical data, and resume continues the exact stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

SeqTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class FeatureSource(Protocol):
    # True when item i's features are the same bytes at every read (stored by extract): what is derived from them
    # may be cached across epochs (train/lse_cache.py). Sources that compute features on access leave it False.
    stored_features: bool

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> SeqTuple: ...

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) int64: how often each token is a supervised label in the source (reads no features)."""
        ...


def count_labels(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids (T,), mask (T,) → (V,) int64 counts of the supervised tokens."""
    return torch.bincount(ids[mask.bool()].to(torch.int64), minlength=vocab_size)[:vocab_size]


class InMemorySource:
    """A list of per-sequence tuples (tests, small val sets)."""

    stored_features = True

    def __init__(self, items: Sequence[SeqTuple]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> SeqTuple:
        return self.items[i]

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        return sum((count_labels(it[0], it[1], vocab_size) for it in self.items),
                   torch.zeros(vocab_size, dtype=torch.int64))  # fmt: skip


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a whose token and next token are both supervised: (n_cand,) int64."""
    m = loss_mask.bool()
    ok = m[:-1] & m[1:]
    return torch.nonzero(ok, as_tuple=False).flatten()


def draw_anchors(loss_mask: torch.Tensor, num_anchors: int, seed: int, epoch: int, seq_idx: int) -> torch.Tensor:
    """Up to num_anchors distinct candidate anchors, sorted; fresh per (seed, epoch, seq_idx)."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() <= num_anchors:
        return cand
    gen = torch.Generator().manual_seed(_hash_seed(seed, epoch, seq_idx))
    pick = torch.randperm(cand.numel(), generator=gen)[:num_anchors]
    return cand[pick].sort().values


def _hash_seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def epoch_order(n_seq: int, global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's steps: lists of `global_batch` sequence indices (last step wraps around)."""
    gen = torch.Generator().manual_seed(_hash_seed(seed, epoch, 7))
    perm = torch.randperm(n_seq, generator=gen).tolist()
    steps = -(-n_seq // global_batch)
    perm = perm + perm[: steps * global_batch - n_seq]
    return [perm[i * global_batch : (i + 1) * global_batch] for i in range(steps)]


def rank_share(step_seqs: list[int], rank: int, world: int) -> list[int]:
    """The sequences of one step this rank processes (strided, so shares differ by at most one)."""
    return step_seqs[rank::world]


@dataclass
class Batch:
    """Collated blocks of S sequences padded to T tokens and N anchors (B = block size)."""

    tapped: torch.Tensor  # (S, T, F) context features
    anchors: torch.Tensor  # (S, N) int64; padding anchors are 0 (they see only their own block)
    block_ids: torch.Tensor  # (S, N*B) int64: [token at anchor, mask x (B-1)] per block
    targets: torch.Tensor  # (S, N, B) int64 token at anchor+k+pred_offset (0 where invalid)
    valid: torch.Tensor  # (S, N, B) bool: slot k >= first_slot, anchor real, predicted position < len, supervised
    n_tokens: int  # real context tokens in the batch
    prev_ids: torch.Tensor | None = None  # (S, N, B) the data token right before each slot's predicted one
    last: torch.Tensor | None = None  # (S, T, H) the target's final-normed last-layer states (when stored)
    pred_offset: int = 0  # slot k predicts anchor + k + pred_offset
    seq_ids: torch.Tensor | None = None  # (S,) int64 dataset index of each sequence (training batches; CPU)

    def _map(self, fn) -> "Batch":
        opt = lambda t: None if t is None else fn(t)  # noqa: E731
        return Batch(fn(self.tapped), fn(self.anchors), fn(self.block_ids), fn(self.targets), fn(self.valid),
                     self.n_tokens, opt(self.prev_ids), opt(self.last), self.pred_offset, self.seq_ids)

    def to(self, device: torch.device, non_blocking: bool = True) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        pin = lambda t: t.pin_memory() if t.device.type == "cpu" else t  # noqa: E731  (online features: on the GPU already)
        return self._map(pin)


def collate(
    seqs: Sequence[SeqTuple], anchors: Sequence[torch.Tensor], block_size: int, mask_token_id: int,
    feat_dtype: torch.dtype = torch.float32, first_slot: int = 1, pred_offset: int = 0,
) -> Batch:
    """Build one padded batch. Slot k of the block at anchor a predicts token a+k+pred_offset
    (k = first_slot..B-1; DFlash: first_slot 1, offset 0; DSpark's default: 0 and 1). A sequence tuple
    may carry a 4th element, the target's last-layer states (T, H), collated into `last`."""
    B = block_size
    S = len(seqs)
    T = max(int(s[0].numel()) for s in seqs)
    N = max(1, max(int(a.numel()) for a in anchors))
    F = seqs[0][2].shape[-1]
    has_last = all(len(s) > 3 and s[3] is not None for s in seqs)
    tapped = torch.zeros(S, T, F, dtype=feat_dtype, device=seqs[0][2].device)  # online features stay on their device
    last = torch.zeros(S, T, seqs[0][3].shape[-1], dtype=feat_dtype, device=seqs[0][3].device) if has_last else None
    anc = torch.zeros(S, N, dtype=torch.long)
    targets = torch.zeros(S, N, B, dtype=torch.long)
    prev = torch.zeros(S, N, B, dtype=torch.long)
    valid = torch.zeros(S, N, B, dtype=torch.bool)
    block_ids = torch.full((S, N, B), mask_token_id, dtype=torch.long)
    n_tokens = 0
    k = torch.arange(B)
    for i, (item, a) in enumerate(zip(seqs, anchors)):
        ids, lmask, hidden = item[0], item[1], item[2]
        L = ids.numel()
        n_tokens += L
        tapped[i, :L] = hidden.to(feat_dtype)
        if last is not None:
            last[i, :L] = item[3].to(feat_dtype)
        n = a.numel()
        if n == 0:
            continue
        anc[i, :n] = a
        pos = a[:, None] + k + pred_offset  # (n, B) predicted positions
        inside = pos < L
        posc = pos.clamp(max=L - 1)
        targets[i, :n] = torch.where(inside, ids[posc].long(), 0)
        prev[i, :n] = torch.where(inside, ids[(pos - 1).clamp(min=0, max=L - 1)].long(), 0)
        valid[i, :n] = inside & lmask[posc].bool() & (k >= first_slot)
        block_ids[i, :n, 0] = ids[a].long()
    return Batch(tapped, anc, block_ids.view(S, N * B), targets, valid, n_tokens, prev, last, pred_offset)


def truncate(item: SeqTuple, max_len: int) -> SeqTuple:
    if max_len > 0 and item[0].numel() > max_len:
        return tuple(t[:max_len] if t is not None else None for t in item)  # type: ignore[return-value]
    return item


class Prefetcher:
    """Collate batches in a background thread, `depth` ahead (the device never waits on disk)."""

    _END = object()

    def __init__(self, it: Iterator, depth: int = 2) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._err: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(it,), daemon=True)
        self._thread.start()

    def _run(self, it: Iterator) -> None:
        try:
            for item in it:
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # re-raised in the consumer
            self._err = exc
        self._q.put(self._END)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        item = self._q.get()
        if item is self._END:
            if self._err is not None:
                raise self._err
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        while not self._q.empty():
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
