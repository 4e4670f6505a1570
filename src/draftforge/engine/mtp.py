"""MTP chain: k drafts by applying one MTP layer recursively, verified as a chain (a `Method`).

The head (`draftforge.drafter.mtp.MTPHead`, native or trained) keeps its own KV cache over context
pairs: pair i = (the target's final-normed hidden state at i, committed token i+1) at position i.
With `start` committed tokens and the bonus token x_start, a round appends the pending pairs up to
start−1 (the last one uses the bonus), reads draft 1 from its output, then feeds each output back as the
next depth's hidden state with the previous draft as its token, one position later; draft entries are
cropped off after the round, so the cache holds exact context only.
"""

from __future__ import annotations

from typing import Any

import torch

from draftforge.engine.cpu_linear import route_linears
from draftforge.engine.target import TargetModel, embed_tokens
from draftforge.engine.tree import Tree, chain_tree

DEFAULT_DRAFTS = 3


class MTPChain:
    name, budget, needs_taps = "mtp", None, False

    def __init__(self, tm: TargetModel, head: Any, budget: int | None = None) -> None:
        if head.hidden_size != tm.hidden_size:
            raise ValueError(f"mtp head width {head.hidden_size} != target hidden size {tm.hidden_size}")
        self.tm, self.head = tm, head
        route_linears(head)  # CPU: each product on its measured route (engine/cpu_linear.py)
        self.k = int(getattr(head, "num_drafts", DEFAULT_DRAFTS))
        if self.k < 1:
            raise ValueError(f"mtp: num_drafts {self.k} < 1")
        self.verify_size = 1 + self.k
        self._reset()

    def _reset(self) -> None:
        self.cache = self.head.new_cache()
        self.ids: list[int] = []  # committed tokens 0..start-1
        self.pending: torch.Tensor | None = None  # hidden rows cache.length..start-1

    def _add(self, feats: Any) -> None:
        if feats.ids is None:
            raise ValueError("mtp: Features.ids (the committed tokens) are required")
        self.ids += feats.ids[0].tolist()
        h = feats.hidden
        self.pending = h if self.pending is None else torch.cat([self.pending, h], dim=1)

    def begin(self, feats: Any) -> None:
        self._reset()
        self._add(feats)

    def observe(self, feats: Any) -> None:
        self._add(feats)

    def draft(self, bonus: int, start: int) -> list[int]:
        tm, head, c = self.tm, self.head, self.cache.length
        if len(self.ids) != start or self.pending is None or c + self.pending.shape[1] != start:
            raise RuntimeError(f"mtp: context out of step (ids {len(self.ids)}, cache {c}, start {start})")
        dt = head.proj.weight.dtype
        pos = torch.arange(c, start, device=tm.device)[None]
        emb = embed_tokens(tm, self.ids[c + 1 : start] + [bonus]).to(dt)
        out, _, _ = head(self.pending.to(dt), emb, pos, cache=self.cache)
        self.pending = None
        o = out[:, -1:]
        drafts: list[int] = []
        for j in range(self.k):
            drafts.append(int(tm.lm_head(o[0, -1].to(tm.dtype)).argmax()))  # argmax at any temperature
            if j + 1 < self.k:
                pos = torch.tensor([[start + j]], device=tm.device)
                o, _, _ = head(o, embed_tokens(tm, drafts[-1:]).to(dt), pos, cache=self.cache)
        self.cache.crop(start)
        return drafts

    def build(self, drafted: list[int], bonus: int) -> Tree:
        return chain_tree(bonus, drafted)
