"""The DFlash drafter's block pass at a fixed context capacity, for the captured engine (`graph.py`).

Its context K/V cache has a fixed capacity; each round writes the new committed features (≤ B, padded:
padded rows land in block slots that the block then overwrites) and the block at slot indices, and the
block attends under the mask "column < start + B". A prompt longer than one block is written to the
context cache eagerly once. With the engine's fused blocks (`fused.py`) the pass runs the drafter's
fused / compiled blocks; otherwise the drafter's own modules.
"""

from __future__ import annotations

from typing import Any

import torch

from draftforge.drafter.attention import apply_rope as drafter_rope
from draftforge.engine import fused as fused_blocks
from draftforge.engine.capture import align, capture_graph
from draftforge.engine.state import CapacityError
from draftforge.engine.target import attend_folded


class StaticDrafter:
    """The DFlash drafter's block pass at a fixed context capacity (see the module docstring)."""

    def __init__(self, eng: Any, drafter: Any) -> None:
        self.eng, self.d = eng, drafter
        cfg = drafter.cfg
        if tuple(cfg.target_layer_ids) != eng.tm.tap_ids:
            raise ValueError(f"drafter taps {cfg.target_layer_ids} != target wrapper taps {list(eng.tm.tap_ids)}")
        self.B, self.mask_id = cfg.block_size, cfg.mask_token_id
        a0 = drafter.layers[0].self_attn
        self.n_kv, self.hd = a0.n_kv, a0.head_dim
        self.group = a0.n_heads // a0.n_kv
        dev, self.dt = eng.tm.device, drafter.fc.weight.dtype
        self.cap = align(eng.capacity + 2 * self.B)
        self.kv = torch.zeros(len(drafter.layers), 2, self.n_kv, self.cap, self.hd, device=dev, dtype=self.dt)
        self.cols = torch.arange(self.cap, device=dev)
        self.feats = torch.zeros(1, self.B, drafter.fc.in_features, device=dev, dtype=self.dt)
        self.meta = torch.zeros(3, self.B, dtype=torch.long, device=dev)  # ids, context slots, block slots
        self.hmeta = torch.zeros(3, self.B, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.logits = torch.zeros(self.B - 1, eng.tm.vocab_size, device=dev, dtype=eng.tm.dtype)
        self.graph = None
        self.blocks = eng.blocks  # the engine's fused (or compiled) blocks serve the drafter too
        self.fused = fused_blocks.fuse_drafter(drafter) if eng.blocks is not None else None

    def _rope(self, positions: torch.Tensor):
        return self.d._rope(positions, self.dt)

    def _step(self) -> None:
        d, B = self.d, self.B
        ids, cslots, bslots = self.meta[0:1], self.meta[1], self.meta[2]
        ctx = d.project_context(self.feats).to(self.dt)
        c_cos, c_sin = self._rope(cslots)
        b_cos, b_sin = self._rope(bslots)
        vis = self.cols < bslots[-1:] + 1  # committed context and the block (non-causal)
        mask = torch.zeros((), device=vis.device, dtype=self.dt).masked_fill(~vis, float("-inf"))
        mask = mask.expand(self.group * B, self.cap).contiguous()[None, None]
        h = self.eng.tm.embed(ids).to(self.dt)
        if self.blocks is not None:
            cos, sin = self._rope(torch.cat([cslots, bslots]))  # (1, 2B, hd)
            for i, layer in enumerate(d.layers):
                fl = self.fused[i]
                q, k, v = self.blocks.draft_qkv(layer, fl.wqkv, h, ctx, cos, sin)
                for rows, slots in ((slice(0, B), cslots), (slice(B, 2 * B), bslots)):  # block after context
                    self.kv[i, 0].index_copy_(1, slots, k[0, :, rows])
                    self.kv[i, 1].index_copy_(1, slots, v[0, :, rows])
                h = self.blocks.draft_out(layer, fl.wgu, h, q, self.kv[i, 0], self.kv[i, 1], mask)
            h = d.norm(h)
            self.logits.copy_(self.eng.tm.lm_head(h[0, 1:].to(self.eng.tm.dtype)))
            return
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            kc, vc = a.project_kv(ctx, c_cos, c_sin)
            self.kv[i, 0].index_copy_(1, cslots, kc[0])
            self.kv[i, 1].index_copy_(1, cslots, vc[0])
            x = layer.input_layernorm(h)
            q = a.q_norm(a.q_proj(x).view(1, B, a.n_heads, a.head_dim)).transpose(1, 2)
            q = drafter_rope(q, b_cos, b_sin)
            kb, vb = a.project_kv(x, b_cos, b_sin)
            self.kv[i, 0].index_copy_(1, bslots, kb[0])  # after the context: padded context slots are overwritten
            self.kv[i, 1].index_copy_(1, bslots, vb[0])
            o = attend_folded(q, self.kv[i, 0][None], self.kv[i, 1][None], mask, None)
            h = h + a.o_proj(o.transpose(1, 2).reshape(1, B, a.n_heads * a.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = d.norm(h)
        self.logits.copy_(self.eng.tm.lm_head(h[0, 1:].to(self.eng.tm.dtype)))

    def write_context(self, feats: torch.Tensor, base: int) -> None:
        """Eager: context K/V of `feats` (1, n, F) at positions base.. (a prompt longer than one block)."""
        n = feats.shape[1]
        if base + n > self.cap:
            raise CapacityError(f"captured engine: drafter context {base + n} exceeds its capacity {self.cap}")
        ctx = self.d.project_context(feats).to(self.dt)
        pos = torch.arange(base, base + n, device=feats.device)
        cos, sin = self._rope(pos)
        for i, layer in enumerate(self.d.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            self.kv[i, 0].index_copy_(1, pos, k[0])
            self.kv[i, 1].index_copy_(1, pos, v[0])

    def capture(self, pool) -> None:
        self.hmeta[1] = torch.arange(self.B)
        self.hmeta[2] = torch.arange(self.B)
        self.meta.copy_(self.hmeta)
        self.graph = capture_graph(self._step, pool)

    def run(self, bonus: int, start: int, pending: torch.Tensor | None) -> torch.Tensor:
        n_new = 0 if pending is None else pending.shape[1]
        if start + self.B > self.cap:
            raise CapacityError(f"captured engine: drafter block at {start} exceeds its capacity {self.cap}")
        if n_new > self.B:
            self.write_context(pending, start - n_new)
            n_new = 0
        elif n_new:
            self.feats[:, :n_new].copy_(pending)
        m = self.hmeta
        m[0, 0], m[0, 1:] = bonus, self.mask_id
        m[1] = start - n_new + torch.arange(self.B)
        m[2] = start + torch.arange(self.B)
        self.meta.copy_(m, non_blocking=self.meta.device.type == "cuda")
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.logits.clone()

    def context(self) -> StaticDrafterContext:
        return StaticDrafterContext(self)


class StaticDrafterContext:
    """Drop-in for methods.DrafterContext (add / block_logits) over the static drafter."""

    def __init__(self, sd: StaticDrafter) -> None:
        self.sd, self.drafter = sd, sd.d
        self.block, self.mask_id = sd.B, sd.mask_id
        self.pending: torch.Tensor | None = None

    def add(self, taps: torch.Tensor | None) -> None:
        if taps is None or not taps.shape[1]:
            return
        self.pending = taps if self.pending is None else torch.cat([self.pending, taps], dim=1)

    def block_logits(self, bonus: int, start: int) -> torch.Tensor:
        out = self.sd.run(bonus, start, self.pending)
        self.pending = None
        return out
