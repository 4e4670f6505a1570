"""A block drafter's state during one generation, and its block pass, for every engine mode.

`DrafterContext` holds the drafter's context K/V (`drafter.inference.DraftKV`, row = position) and the
tapped features of committed tokens not yet in it. Each round calls the one block pass (`drafter.draft`,
i.e. `drafter.inference.block_pass`, with the engine's plain or compiled blocks); what the drafter drafts is asked of its config: `first_slot` (the first
predicting slot: 1 for DFlash's fill-in block, 0 for DSpark's default block), `n_draft`, its layer types
and window. Two ways to run the same pass:

- eager (`static=None`): the exact new context rows, the cache grows as needed, kv_len = start + B;
- static (a captured engine's `StaticDraft`): fixed buffers — the ≤ B new context rows padded to B (padded
  rows land on block rows, which the block then overwrites), ids and positions staged in a device buffer,
  kv_len = the fixed capacity, the LM head inside the step; on CUDA the step is one replayed graph. A round
  with more than B new rows (the prompt) runs the eager form on the same fixed cache once.

The logits of a drafter with a draft vocabulary (docs/architecture.md, "Draft vocabulary") are its D-row head's,
placed at those tokens' ids of the target's vocabulary with −inf everywhere else: the methods downstream (chain,
tree, sampling at T > 0) read a distribution over the target's vocabulary either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftforge.drafter.inference import DraftKV
from draftforge.drafter.vocab import to_target_logits
from draftforge.engine import cpu_linear
from draftforge.engine.capture import align, capture_graph
from draftforge.engine.state import CapacityError

INITIAL_ROWS = 256  # eager context cache rows before the first doubling


@dataclass
class StaticDraft:
    """What a captured engine gives a drafter context: capacity, blocks (plain or compiled), fused weights."""

    capacity: int  # the target's fixed capacity; the drafter's cache holds capacity + 2B rows
    blocks: Any
    fused: list[Any] | None


class DrafterContext:
    """A block drafter's context cache plus the features of committed tokens not yet in it."""

    def __init__(self, drafter: Any, tm: Any, static: StaticDraft | None = None) -> None:
        cfg = drafter.cfg
        if tuple(cfg.target_layer_ids) != tm.tap_ids:
            raise ValueError(f"drafter taps {cfg.target_layer_ids} != target wrapper taps {list(tm.tap_ids)}")
        if isinstance(drafter, torch.nn.Module):
            cpu_linear.route_linears(drafter)  # CPU: each product on its measured route (engine/cpu_linear.py)
        self.drafter, self.tm, self.static = drafter, tm, static
        self.block, self.mask_id = cfg.block_size, cfg.mask_token_id
        self.first_slot, self.n_draft = cfg.first_slot, cfg.n_draft  # asked of the drafter, never derived here
        self.draft_ids = drafter.draft_ids if cfg.draft_vocab_size else None  # (D,) or None: the whole vocabulary
        if self.draft_ids is not None:
            cpu_linear.register(drafter.draft_head)  # a buffer: routed by `_logits`, not by a Linear
        self.pending: torch.Tensor | None = None  # (1, n_new, n_taps·H) positions length..start−1
        self.length = 0  # context positions in the cache
        dev, self.dt = tm.device, drafter.fc.weight.dtype
        a0 = drafter.layers[0].self_attn
        rows = align(static.capacity + 2 * self.block) if static else INITIAL_ROWS
        self.cache = DraftKV(len(drafter.layers), a0.n_kv, a0.head_dim, rows, dev, self.dt, fixed=static is not None)
        if static is None:
            from draftforge.engine.fused import plain_blocks

            self.blocks, self.fused = plain_blocks(), None
            return
        self.blocks, self.fused = static.blocks, static.fused
        B = self.block
        self.feats = torch.zeros(1, B, drafter.fc.in_features, device=dev, dtype=self.dt)
        self.meta = torch.zeros(3, B, dtype=torch.long, device=dev)  # ids, context positions, block positions
        self.hmeta = torch.zeros(3, B, dtype=torch.long, pin_memory=dev.type == "cuda")
        # the columns a draft vocabulary never writes hold −inf for good
        self.logits = torch.full((self.n_draft, tm.vocab_size), float("-inf") if self.draft_ids is not None else 0.0,
                                 device=dev, dtype=tm.dtype)  # fmt: skip
        self.graph = None

    def reset(self) -> None:
        """A new generation: an empty context (cache rows past `length` are scratch)."""
        self.pending, self.length = None, 0

    def add(self, taps: torch.Tensor | None) -> None:
        if taps is None or not taps.shape[1]:
            return
        self.pending = taps if self.pending is None else torch.cat([self.pending, taps], dim=1)

    def _ids(self, bonus: int) -> list[int]:
        return [bonus] + [self.mask_id] * (self.block - 1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tm.embed(ids).to(self.dt)

    def _eager(self, bonus: int, start: int, n_new: int) -> torch.Tensor:
        """The block pass on exact inputs → block states (1, B, H)."""
        dev, B = self.tm.device, self.block
        self.cache.ensure(start + B)
        feats = self.pending if self.pending is not None else torch.zeros(1, 0, self.drafter.fc.in_features,
                                                                           device=dev, dtype=self.dt)
        ids = torch.tensor([self._ids(bonus)], device=dev)
        return self.drafter.draft(self._embed(ids), torch.arange(start, start + B, device=dev), feats,
                                  torch.arange(start - n_new, start, device=dev), self.cache.kv, start + B,
                                  self.blocks, self.fused)

    def _logits(self, hs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hs (n, H) the predicting slots' states → (n, V) logits over the target's vocabulary (into `out` when
        given: a draft vocabulary writes only its columns, the others hold −inf)."""
        if self.draft_ids is None:
            logits = self.tm.lm_head(hs.to(self.tm.dtype))
            return logits if out is None else out.copy_(logits)
        head = self.drafter.draft_head
        rows = cpu_linear.linear(hs.to(head.dtype), head).to(self.tm.dtype)  # (n, D)
        if out is None:
            return to_target_logits(rows, self.draft_ids, self.tm.vocab_size)
        return out.index_copy_(1, self.draft_ids, rows)

    def _static_step(self) -> None:
        """The padded block pass over the staged buffers (captured on CUDA) → self.logits."""
        ids, cpos, bpos = self.meta[0:1], self.meta[1], self.meta[2]
        h = self.drafter.draft(self._embed(ids), bpos, self.feats, cpos, self.cache.kv, self.cache.capacity,
                               self.blocks, self.fused)
        self._logits(h[0, self.first_slot :], out=self.logits)

    def capture(self, pool: Any) -> None:
        self.hmeta[1] = torch.arange(self.block)
        self.hmeta[2] = torch.arange(self.block)
        self.meta.copy_(self.hmeta)
        self.graph = capture_graph(self._static_step, pool)

    @torch.no_grad()
    def block_logits(self, bonus: int, start: int, depths: int | None = None) -> torch.Tensor:
        """(d, V) logits of the predicting slots at depths 1..d of one block pass at `start`, d = min(depths,
        n_draft) (all n_draft when None). The block pass itself always runs over every slot (its slots attend to
        each other), so the rows returned do not depend on `depths`; eagerly only those rows reach the LM head."""
        n_new = 0 if self.pending is None else self.pending.shape[1]
        if self.length + n_new != start:
            raise ValueError(f"drafter context: cache holds {self.length} positions + {n_new} new != start {start}")
        B = self.block
        if self.static is not None and start + B > self.cache.capacity:
            raise CapacityError(f"captured engine: drafter block at {start} exceeds its capacity {self.cache.capacity}")
        if self.static is None or n_new > B:
            h = self._eager(bonus, start, n_new)
            out = self._logits(h[0, self.first_slot :][:depths])
        else:
            if n_new:
                self.feats[:, :n_new].copy_(self.pending)
            m = self.hmeta
            m[0, 0], m[0, 1:] = bonus, self.mask_id
            m[1] = start - n_new + torch.arange(B)
            m[2] = start + torch.arange(B)
            self.meta.copy_(m, non_blocking=self.meta.device.type == "cuda")
            if self.graph is not None:
                self.graph.replay()
            else:
                self._static_step()
            out = self.logits[:depths].clone()
        self.pending, self.length = None, start  # context only: committed positions 0..start−1
        return out
