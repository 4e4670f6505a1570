"""Fused projections and compiled blocks: what the captured engine adds on top of the one layer path.

A captured step (`graph.py`) removes Python and launch overhead but still replays every small kernel the
HF modules launch: per dense layer ~50 (RMSNorm in fp32 pieces, separate q/k/v and gate/up GEMVs, q/k
norms, rotary, residual adds). At one token per step each costs a few microseconds even inside a CUDA
graph (docs/benchmarks.md). So, on top of the same functions the eager engine runs:

- Fused projections: q/k/v and gate/up weights are concatenated once and the HF Linear weights are
  re-pointed at views of the fused tensor (no second copy; the eager path reads the same storage). The eager
  engine fuses a CPU fp32 target's projections too: there one larger product streams faster than two or three
  (engine/cpu_linear.py).
- `torch.compile` of the layer blocks (`blocks.py`: qkv, post-attention, split, MLP) and of the drafter's
  block-pass blocks (`drafter/inference.py`), the module passed as an argument so one compiled graph
  serves every layer of one structure (dynamo lifts the parameters to inputs). Cache writes stay outside.

Invariant: compiled blocks compute the same function as the plain ones; only the rounding of fused
reductions may differ (fp32: tokens equal except at exact ties; checked by tests/gpu).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from draftforge.drafter import inference
from draftforge.engine import blocks
from draftforge.engine.blocks import FusedLayer


def _fuse(linears: list[nn.Linear], bias: bool) -> torch.Tensor:
    """Concatenate Linear weights (or biases) along the output axis; re-point each at a view of the result."""
    parts = [lin.bias if bias else lin.weight for lin in linears]
    fused = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for lin, p in zip(linears, parts):
        view = nn.Parameter(fused[start : start + p.shape[0]], requires_grad=False)
        setattr(lin, "bias" if bias else "weight", view)
        start += p.shape[0]
    return fused


def _views_of(linears: list[nn.Linear], fused: torch.Tensor | None, bias: bool) -> bool:
    """Whether each Linear's weight (or bias) is still its row range of `fused` (None: nothing was fused).

    A module `.to(device or dtype)` or a parameter reassigned gives the Linears new tensors and leaves a fused
    copy stale: its values and placement are no longer the model's."""
    if fused is None:
        return True
    start, row_bytes = 0, fused.stride(0) * fused.element_size()
    for lin in linears:
        p = lin.bias if bias else lin.weight
        if p is None or p.device != fused.device or p.dtype != fused.dtype \
                or p.data_ptr() != fused.data_ptr() + start * row_bytes:
            return False
        start += p.shape[0]
    return start == fused.shape[0]


def _dense_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not hasattr(mlp, "experts")


def _projections(layer: nn.Module, kind: str) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The Linears a layer fuses: q/k/v (attention layers) and gate/up (bias-free dense MLPs); [] where none."""
    qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj] if kind == "attention" else []
    mlp = layer.mlp
    gu = [mlp.gate_proj, mlp.up_proj] if _dense_mlp(mlp) and mlp.gate_proj.bias is None and mlp.up_proj.bias is None \
        else []
    return qkv, gu


@torch.no_grad()
def fuse_projections(tm: Any) -> list[FusedLayer]:
    """Per layer: fused q/k/v (attention layers) and gate/up (dense MLPs); idempotent while the weights stay
    where they were fused (a layer whose Linears moved or were reassigned since is fused again from them)."""
    out = []
    for layer, kind in zip(tm.layers, tm.kinds):
        qkv, gu = _projections(layer, kind)
        cached = getattr(layer, "_draftforge_fused", None)
        if cached is not None and _views_of(qkv, cached.wqkv, False) and _views_of(qkv, cached.bqkv, True) \
                and _views_of(gu, cached.wgu, False):
            out.append(cached)
            continue
        wqkv = bqkv = wgu = None
        q_out = kv_out = 0
        if qkv:
            q_out, kv_out = qkv[0].out_features, qkv[1].out_features
            has_bias = [lin.bias is not None for lin in qkv]
            if any(has_bias) and not all(has_bias):
                raise ValueError("compiled engine: q/k/v projections with biases on some but not all of them")
            wqkv = _fuse(qkv, bias=False)
            bqkv = _fuse(qkv, bias=True) if all(has_bias) else None
        if gu:
            wgu = _fuse(gu, bias=False)
        fl = FusedLayer(wqkv=wqkv, bqkv=bqkv, q_out=q_out, kv_out=kv_out, wgu=wgu)
        layer._draftforge_fused = fl
        out.append(fl)
    return out


@dataclass
class FusedDraftLayer:
    wqkv: torch.Tensor  # (q_out + 2·kv_out, H)
    wgu: torch.Tensor  # (2·I, H)


@torch.no_grad()
def fuse_drafter(drafter: nn.Module) -> list[FusedDraftLayer]:
    """Per drafter layer: fused q/k/v and gate/up weights (views re-pointed and re-fused after a move, as in
    `fuse_projections`)."""
    out = []
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gu = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
        cached = getattr(layer, "_draftforge_fused", None)
        if cached is None or not (_views_of(qkv, cached.wqkv, False) and _views_of(gu, cached.wgu, False)):
            cached = FusedDraftLayer(wqkv=_fuse(qkv, bias=False), wgu=_fuse(gu, bias=False))
            layer._draftforge_fused = cached
        out.append(cached)
    return out


@dataclass
class LayerBlocks:
    qkv: Any  # blocks.qkv_block
    post: Any  # blocks.post_attention
    split: Any  # blocks.split_block
    mlp: Any  # blocks.mlp_block
    draft_qkv: Any  # drafter.inference.draft_qkv_block
    draft_out: Any  # drafter.inference.draft_out_block


def plain_blocks() -> LayerBlocks:
    """The layer blocks as plain functions (the eager engine, and the static step without compile)."""
    return LayerBlocks(qkv=blocks.qkv_block, post=blocks.post_attention, split=blocks.split_block,
                       mlp=blocks.mlp_block, draft_qkv=inference.draft_qkv_block, draft_out=inference.draft_out_block)


def layer_blocks(compiled: bool) -> LayerBlocks:
    """The blocks, under torch.compile when `compiled` (static shapes: one graph per verify bucket, shared by
    every layer of one structure); as plain functions otherwise."""
    plain = plain_blocks()
    if not compiled:
        return plain
    import torch._dynamo
    import torch._inductor.config

    # entries per block: buckets × layer structures (attention / GDN, with or without a dense MLP)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # round to the model dtype where the eager code casts (bf16 results then differ from eager by ties only)
    torch._inductor.config.emulate_precision_casts = True
    kw: dict[str, Any] = {"dynamic": False, "fullgraph": True}
    return LayerBlocks(**{f.name: torch.compile(getattr(plain, f.name), **kw) for f in fields(LayerBlocks)})
