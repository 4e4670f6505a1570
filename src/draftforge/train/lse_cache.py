"""The target's log-normaliser at each training position, computed once per sequence and reused at later epochs.

With a draft vocabulary the distribution objective needs, for every supervised row, the target's log Σ_V exp(t)
over its whole head at the row's context position (`dspark_loss.target_lse`): a U × V × H product per step (U
distinct positions; on the default world's shapes about as many FLOPs as the drafter's own LM head forward and
backward). It depends only on the frozen head and the stored feature of that position, so with stored features
(the same bytes at every read) a sequence's values are computed at its first visit and read back at every later
epoch. docs/architecture.md, "Draft vocabulary".

Invariant: a sequence's values are one product over exactly the positions whose next token is supervised, read
from the source, never over a batch's mix of rows; so they do not depend on which batch or step first needed
them, and a resumed run (empty cache) computes the same bits as the uninterrupted one.
"""

from __future__ import annotations

import torch

from draftforge.train.data import FeatureSource, truncate
from draftforge.train.dspark_loss import target_lse


class TargetLseCache:
    """seq id → (L,) fp32 log-normalisers (NaN at positions whose next token is not supervised)."""

    def __init__(self, lm_head: torch.Tensor, source: FeatureSource, max_seq_len: int, feat_dtype: torch.dtype) -> None:
        self.lm_head, self.source = lm_head, source  # lm_head (V, H): the target's whole head
        self.max_seq_len, self.feat_dtype = max_seq_len, feat_dtype
        self.rows: dict[int, torch.Tensor] = {}
        self.computed = 0  # positions computed (each once)
        self.reads = 0  # positions served

    def compute(self, sid: int, dtype: torch.dtype) -> torch.Tensor:
        item = truncate(self.source[sid], self.max_seq_len)
        mask, last = item[1], item[3]  # (L,), (L, H)
        if last is None:
            raise ValueError(f"train sequence {sid}: no last-layer states to compute the target's normaliser from")
        need = (mask[1:] > 0).nonzero().squeeze(-1)  # (n,) positions p whose next token p + 1 is supervised
        row = torch.full((mask.shape[0],), float("nan"), device=self.lm_head.device)
        if need.numel():
            ht = last[need].to(self.feat_dtype).to(device=self.lm_head.device, dtype=dtype)  # as collate + the objective
            row[need.to(row.device)] = target_lse(ht, self.lm_head)
        self.computed += int(need.numel())
        return row

    def lookup(self, seq_ids: torch.Tensor, distinct: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """seq_ids (S,) dataset index of each batch sequence; distinct (U,) positions as s · width + p; dtype the
        objective's state dtype → (U,) fp32 log-normalisers."""
        seq_of, pos = (distinct // width).cpu(), (distinct % width).to(self.lm_head.device)
        out = torch.empty(distinct.shape[0], dtype=torch.float32, device=self.lm_head.device)
        for s in torch.unique(seq_of).tolist():
            sel = (seq_of == s).nonzero().squeeze(-1).to(out.device)  # (u,)
            sid = int(seq_ids[s])
            row = self.rows.get(sid)
            if row is None:
                row = self.rows[sid] = self.compute(sid, dtype)
            p = pos[sel]
            if int(p.max()) >= row.shape[0] or bool(torch.isnan(row[p]).any()):
                raise ValueError(f"train sequence {sid}: a row at a position whose next token is not supervised "
                                 "(the batch disagrees with the source's loss mask)")  # fmt: skip
            out[sel] = row[p]
            self.reads += int(p.shape[0])
        return out.to(distinct.device)
