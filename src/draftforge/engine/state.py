"""The target's decoding state at a fixed capacity: attention KV rows, GDN conv and recurrent states.

Invariants:
- `length` tokens are committed. Attention layers hold their K/V (rotary applied at each row's position)
  in rows 0..length−1; rows past `length` are scratch that a span writes and a commit keeps or drops.
- GDN layers hold the last K−1 conv inputs of the committed tokens (oldest first) and the fp32
  recurrent state after them. A verify span never touches them: it leaves its per-node outputs in the
  verify scratch (`GDNScratch`, rows 0..n−1 of a buffer sized for the largest span) and `commit(path)`
  advances every layer along the accepted path in one batched expression (docs/architecture.md,
  "Engine state").
- Capacity is fixed when the state is made (one allocation; the shape a captured step needs); a span that
  would pass it is refused with a clear error, never silently grown.
The eager and the static (captured) engines share this state and its commit: one KV commit, one GDN
state advance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from draftforge.engine.gdn import compute_dtype

if TYPE_CHECKING:
    from draftforge.engine.target import TargetModel


class CapacityError(ValueError):
    pass


@dataclass
class GDNScratch:
    """What a verify span leaves per GDN layer so that commit(path) can advance the states."""

    conv_in: torch.Tensor  # (n_gdn, N, C) pre-conv inputs of the span's nodes
    G: torch.Tensor  # (n_gdn, Hv, N) fp32 root-path cumulative log-gates
    K: torch.Tensor  # (n_gdn, Hv, N, dk) fp32 normalised keys
    delta: torch.Tensor  # (n_gdn, Hv, N, dv) fp32 solved Δ


class TargetState:
    def __init__(self, tm: TargetModel, capacity: int, max_span: int | None = None) -> None:
        """capacity: KV rows; max_span: the largest verify span (rows of the GDN verify scratch), fixed for a
        captured engine; None grows the scratch to the largest span seen (the eager engine)."""
        dev, dt = tm.device, tm.dtype
        n_attn, n_gdn = tm.kinds.count("attention"), tm.kinds.count("gdn")
        self.kv = torch.zeros(n_attn, 2, tm.num_kv_heads, capacity, tm.head_dim, device=dev, dtype=dt)
        g = tm.gdn
        conv_dim = g.conv_dim if g else 0
        ct = compute_dtype(dt)
        self.conv = torch.zeros(n_gdn, (g.conv_kernel - 1) if g else 0, conv_dim, device=dev, dtype=dt)
        self.rec = torch.zeros(n_gdn, g.num_v_heads if g else 0, g.head_k_dim if g else 0,
                               g.head_v_dim if g else 0, device=dev, dtype=ct)
        self.tm, self.fixed_span = tm, max_span is not None
        self.max_span = 0
        self.scratch: GDNScratch | None = None
        self._grow_scratch(max_span or 1)
        self.capacity = capacity
        self.length = 0
        self.pending = 0  # rows written by the last span and not yet committed

    def _grow_scratch(self, rows: int) -> None:
        g = self.tm.gdn
        if g is None:
            return
        dev, dt, ct, n_gdn = self.conv.device, self.conv.dtype, self.rec.dtype, self.conv.shape[0]
        self.scratch = GDNScratch(
            conv_in=torch.zeros(n_gdn, rows, g.conv_dim, device=dev, dtype=dt),
            G=torch.zeros(n_gdn, g.num_v_heads, rows, device=dev, dtype=ct),
            K=torch.zeros(n_gdn, g.num_v_heads, rows, g.head_k_dim, device=dev, dtype=ct),
            delta=torch.zeros(n_gdn, g.num_v_heads, rows, g.head_v_dim, device=dev, dtype=ct),
        )
        self.max_span = rows

    def reset(self) -> None:
        """A new generation: nothing committed (KV rows past `length` are scratch and stay finite)."""
        self.length, self.pending = 0, 0
        self.conv.zero_()
        self.rec.zero_()

    def reserve(self, n: int, verify: bool = False) -> None:
        """A span of n tokens is about to be written after the committed rows."""
        if self.length + n > self.capacity:
            raise CapacityError(
                f"engine state: {self.length} committed + {n} new tokens exceed its capacity of {self.capacity} "
                "(prompt + max_new_tokens + verify size); raise the capacity or shorten the prompt"
            )
        if verify and self.scratch is not None and n > self.max_span:
            if self.fixed_span:
                raise CapacityError(f"engine state: a verify span of {n} tokens exceeds the fixed GDN scratch of "
                                    f"{self.max_span} rows")
            self._grow_scratch(n)
        self.pending = n

    def commit_all(self) -> None:
        """Keep every row of the last span (prefill, AR step): GDN layers already advanced in place."""
        self.length += self.pending
        self.pending = 0

    @torch.no_grad()
    def commit(self, path: Sequence[int]) -> None:
        """Keep the last verify span's nodes `path` (ascending span indices, a root path) after the past."""
        steps = [int(p) for p in path]
        m, past = len(steps), self.length
        dev = self.kv.device
        if self.kv.shape[0] and steps != list(range(m)):  # a prefix (chains) stays in place: no copy
            src = torch.tensor(steps, device=dev) + past
            dst = torch.arange(past, past + m, device=dev)
            self.kv.index_copy_(3, dst, self.kv.index_select(3, src))  # gather first: rows may overlap
        sc = self.scratch
        if sc is not None:
            p = torch.tensor(steps, device=dev)
            Gm = sc.G[:, :, steps[-1]]  # (L, Hv)
            w = (Gm[..., None] - sc.G[:, :, p]).exp()  # (L, Hv, m): e^(G_m − G_j)
            Kp = sc.K[:, :, p] * w[..., None]  # (L, Hv, m, dk)
            self.rec.copy_(Gm.exp()[..., None, None] * self.rec + Kp.transpose(-1, -2) @ sc.delta[:, :, p])
            km1 = self.conv.shape[1]
            self.conv.copy_(torch.cat([self.conv, sc.conv_in[:, p].to(self.conv.dtype)], dim=1)[:, -km1:])
        self.length = past + m
        self.pending = 0

    def crop(self, n: int) -> None:
        """Drop committed rows past n (attention-only targets: a GDN state cannot be rewound)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"engine state: crop({n}) with {self.length} rows committed")
        if n != self.length and self.rec.shape[0]:
            raise ValueError("engine state: a hybrid target's recurrent state cannot be cropped; commit a path")
        self.length = n
