"""The target's decoding state at a fixed capacity: attention KV rows, GDN conv and recurrent states.

Invariants:
- `length` tokens are committed. Attention layers hold their K/V (rotary applied at each row's position)
  in rows 0..length−1; rows past `length` are scratch that a span writes and a commit keeps or drops.
- GDN layers hold the last K−1 conv inputs of the committed tokens (oldest first) and the fp32
  recurrent state after them. A verify span never touches them; `commit(path)` advances them along
  the accepted path from the span's scratch (docs/architecture.md, "Engine state").
- Capacity is fixed when the state is made (one allocation per generation, the shape a captured step
  needs); a span that would pass it is refused with a clear error, never silently grown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftforge.engine.gdn import VerifyScratch, commit_path, compute_dtype

if TYPE_CHECKING:
    from draftforge.engine.target import TargetModel


class CapacityError(ValueError):
    pass


class TargetState:
    def __init__(self, tm: TargetModel, capacity: int) -> None:
        dev, dt = tm.device, tm.dtype
        n_attn, n_gdn = tm.kinds.count("attention"), tm.kinds.count("gdn")
        self.kv = torch.empty(n_attn, 2, tm.num_kv_heads, capacity, tm.head_dim, device=dev, dtype=dt)
        g = tm.gdn
        conv_dim = g.conv_dim if g else 0
        self.conv = torch.zeros(n_gdn, (g.conv_kernel - 1) if g else 0, conv_dim, device=dev, dtype=dt)
        self.rec = torch.zeros(n_gdn, g.num_v_heads if g else 0, g.head_k_dim if g else 0,
                               g.head_v_dim if g else 0, device=dev, dtype=compute_dtype(dt))
        self.capacity = capacity
        self.length = 0
        self.pending = 0  # rows written by the last span and not yet committed
        self.scratch: list[VerifyScratch | None] = [None] * n_gdn

    def reserve(self, n: int) -> None:
        """A span of n tokens is about to be written after the committed rows."""
        if self.length + n > self.capacity:
            raise CapacityError(
                f"engine state: {self.length} committed + {n} new tokens exceed its capacity of {self.capacity} "
                "(prompt + max_new_tokens + verify size); raise the capacity or shorten the prompt"
            )
        self.pending = n

    def commit_all(self) -> None:
        """Keep every row of the last span (prefill): GDN layers already advanced in place."""
        self.length += self.pending
        self.pending = 0

    def commit(self, path: torch.Tensor | list[int]) -> None:
        """Keep the span rows `path` (ascending span indices, a root path) right after the past."""
        steps = path.tolist() if isinstance(path, torch.Tensor) else list(path)
        m = len(steps)
        past = self.length
        rows = None
        if self.kv.shape[0] and steps != list(range(m)):  # a prefix (chains) stays in place: no copy
            rows = torch.tensor(steps, device=self.kv.device) + past
            self.kv[:, :, :, past : past + m] = self.kv.index_select(3, rows)  # gather first: rows may overlap
        if self.scratch:
            idx = torch.tensor(steps, device=self.rec.device)
            for i, scratch in enumerate(self.scratch):
                if scratch is None:
                    raise RuntimeError("engine state: commit(path) without a verify span on a GDN layer")
                commit_path(scratch, self.conv[i], self.rec[i], idx)
                self.scratch[i] = None
        self.length = past + m
        self.pending = 0

    def crop(self, n: int) -> None:
        """Drop committed rows past n (attention-only targets: a GDN state cannot be rewound)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"engine state: crop({n}) with {self.length} rows committed")
        if n != self.length and self.rec.shape[0]:
            raise ValueError("engine state: a hybrid target's recurrent state cannot be cropped; commit a path")
        self.length = n
