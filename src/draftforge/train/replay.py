"""On-policy replay (docs/architecture.md, "On-policy replay"): part-way through training, find where the current
drafter's drafts are rejected when the engine decodes each training row's answer, then draw anchors there.

A row's answer is the target's own greedy output and its features are the target's, so the engine's T = 0 DFlash
chain decode of the row's prompt reproduces the row. Its rounds start at p_0 = the answer's first position (the
first bonus) and p_{k+1} = p_k + acc(p_k) + 1, where acc(p) is the accepted prefix of the drafter's greedy block
anchored at p against the stored tokens: the per-anchor quantity of the val metric `val_sim_tau`. So one no-grad
forward with every anchor candidate of a row (chunked) gives acc for all of them, and `walk_chain` follows the
rounds. A visited start whose block has a rejected draft is a rejection position.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftforge.train.data import (
    Batch,
    FeatureSource,
    SeqTuple,
    _hash_seed,
    anchor_candidates,
    collate,
    draw_anchors,
    truncate,
)
from draftforge.train.loss import BlockOutputs, accepted_prefix
from draftforge.train.trainer import all_reduce

# A no-grad block forward of a collated batch (the train task's, in its compute dtype and on its device).
Score = Callable[[Batch], BlockOutputs]
REPLAY_SALT = 0x5EED  # keeps the replay draw's generator apart from draw_anchors' (same seed, epoch, seq)


@dataclass
class Accepted:
    """Per anchor candidate of one row (all (n_cand,) int64, aligned)."""

    candidates: torch.Tensor  # ascending positions a: token a and a+1 supervised
    acc: torch.Tensor  # accepted drafts of the greedy block anchored at a (the prefix of right argmaxes)
    room: torch.Tensor  # drafts the row can check there (the prefix of valid slots: < n_draft near the end)


@dataclass
class Walk:
    starts: torch.Tensor  # (R,) int64 the chain's round starts (bonus positions), ascending
    accepted: torch.Tensor  # (R,) int64 drafts accepted in each round (the engine's round τ - 1)
    rejected: torch.Tensor  # (J,) int64 the starts whose block had a draft rejected (acc < room)


@torch.no_grad()
def accepted_lengths(score: Score, item: SeqTuple, block_size: int, mask_token_id: int, first_slot: int,
                     pred_offset: int, dtype: torch.dtype = torch.float32, chunk: int = 64) -> Accepted:
    """acc and room of every anchor candidate of `item`, `chunk` blocks per forward. Draft j (0-based) of the
    block at a predicts position a + 1 + j under both conventions (slot first_slot + j, offset pred_offset)."""
    cand = anchor_candidates(item[1])  # (n,)
    acc, room = [], []
    for lo in range(0, cand.numel(), chunk):
        anchors = cand[lo : lo + chunk]
        batch = collate([item], [anchors], block_size, mask_token_id, dtype, first_slot, pred_offset)
        out = score(batch)
        n = anchors.numel()
        acc.append(accepted_prefix(out.correct[0, :n].cpu(), first_slot))  # (n,) as val_sim_tau's; False at invalid slots
        room.append(accepted_prefix(batch.valid[0, :n], first_slot))  # (n,)
    empty = torch.zeros(0, dtype=torch.long)
    return Accepted(cand, torch.cat(acc) if acc else empty, torch.cat(room) if room else empty)


def walk_chain(candidates: torch.Tensor, acc: torch.Tensor, n_draft: int | torch.Tensor) -> Walk:
    """The T = 0 chain's rounds over one row: start at candidates[0], then p + acc(p) + 1, until a position that
    is no candidate (the end of the first supervised span). n_draft: drafts per block, or (n,) per candidate
    (`Accepted.room`); a round with acc < it rejected a draft."""
    cand = candidates.tolist()
    index = {p: j for j, p in enumerate(cand)}
    accs = acc.tolist()
    room = n_draft.tolist() if isinstance(n_draft, torch.Tensor) else [int(n_draft)] * len(cand)
    starts, taken, rejected = [], [], []
    p = cand[0] if cand else -1
    while p in index:
        j = index[p]
        starts.append(p)
        taken.append(accs[j])
        if accs[j] < room[j]:
            rejected.append(p)
        p += accs[j] + 1
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Walk(as_t(starts), as_t(taken), as_t(rejected))


@dataclass
class ReplayTable:
    """The rejection positions of the walked train rows, the same on every rank; part of every later checkpoint."""

    step: int  # the optimizer step before which it was built
    rows: torch.Tensor  # (R,) int64 walked train sequence indices, ascending
    offsets: torch.Tensor  # (R+1,) int64: row r's positions are positions[offsets[r]:offsets[r+1]]
    positions: torch.Tensor  # (J,) int64 rejection positions, ascending within a row
    metrics: dict[str, float]

    def __post_init__(self) -> None:
        self._row = {int(i): r for r, i in enumerate(self.rows.tolist())}

    def rejected(self, seq: int) -> torch.Tensor | None:
        """(j,) int64 the row's rejection positions; None when the row was not walked."""
        r = self._row.get(seq)
        return None if r is None else self.positions[int(self.offsets[r]) : int(self.offsets[r + 1])]

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "rows": self.rows, "offsets": self.offsets, "positions": self.positions,
                "metrics": dict(self.metrics)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ReplayTable":
        return cls(int(state["step"]), state["rows"], state["offsets"], state["positions"], dict(state["metrics"]))


def build_table(score: Score, source: FeatureSource, rows: Sequence[int], step: int, *, block_size: int,
                mask_token_id: int, first_slot: int, pred_offset: int, max_seq_len: int, dtype: torch.dtype,
                device: torch.device, rank: int = 0, world: int = 1, chunk: int = 64) -> ReplayTable:
    """Walk rows[rank::world] on this rank, then make the table identical on every rank: one all-reduce of the
    per-row counts and walk sums, one of the concatenated positions (each row is walked by exactly one rank,
    so the sums are copies). Every rank issues both collectives whatever its share."""
    t0 = time.perf_counter()
    rows = sorted(int(i) for i in rows)
    mine: dict[int, Walk] = {}
    for r in range(rank, len(rows), max(1, world)):
        item = truncate(source[rows[r]], max_seq_len)
        a = accepted_lengths(score, item, block_size, mask_token_id, first_slot, pred_offset, dtype, chunk)
        mine[r] = walk_chain(a.candidates, a.acc, a.room)
    R = len(rows)
    head = torch.zeros(R + 2, dtype=torch.float64)  # [rejections per row (R), rounds, accepted drafts]
    for r, w in mine.items():
        head[r] = w.rejected.numel()
        head[R] += w.starts.numel()
        head[R + 1] += float(w.accepted.sum())
    head = all_reduce(head.to(device), world).cpu()
    counts = head[:R].round().long()  # (R,)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])  # (R+1,)
    flat = torch.zeros(int(offsets[-1]), dtype=torch.long)  # (J,)
    for r, w in mine.items():
        flat[int(offsets[r]) : int(offsets[r + 1])] = w.rejected
    if flat.numel():  # every rank knows J from the first all-reduce, so all skip an empty one alike
        flat = all_reduce(flat.to(device), world).cpu()
    rounds, accepted = float(head[R]), float(head[R + 1])
    metrics = {"replay_rows": float(R), "replay_rounds": rounds, "replay_rejections": float(offsets[-1]),
               "replay_walk_tau": 1.0 + accepted / rounds if rounds else float("nan"),
               "replay_walk_s": time.perf_counter() - t0}
    return ReplayTable(step, torch.tensor(rows, dtype=torch.long), offsets, flat, metrics)


def draw_replay_anchors(loss_mask: torch.Tensor, rejected: torch.Tensor | None, num_anchors: int, share: float,
                        seed: int, epoch: int, seq_idx: int) -> torch.Tensor:
    """Up to num_anchors distinct candidate anchors, sorted: round(share x num_anchors) of them (at most all) from
    `rejected`, the rest uniform over the other candidates; fresh per (seed, epoch, seq_idx). A row without
    rejection positions (or not walked: None), or with no more candidates than anchors, draws as draw_anchors."""
    cand = anchor_candidates(loss_mask)  # (n,)
    if rejected is not None:
        rejected = rejected[torch.isin(rejected, cand)]  # walk starts are candidates; this guards the invariant
    if rejected is None or rejected.numel() == 0 or cand.numel() <= num_anchors:
        return draw_anchors(loss_mask, num_anchors, seed, epoch, seq_idx)
    gen = torch.Generator().manual_seed(_hash_seed(seed, epoch, seq_idx, REPLAY_SALT))
    k = min(rejected.numel(), round(share * num_anchors))
    replayed = rejected[torch.randperm(rejected.numel(), generator=gen)[:k]]  # (k,)
    rest = cand[~torch.isin(cand, replayed)]
    uniform = rest[torch.randperm(rest.numel(), generator=gen)[: num_anchors - k]]  # (num_anchors - k,)
    return torch.cat([replayed, uniform]).sort().values
