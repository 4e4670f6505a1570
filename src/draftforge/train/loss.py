"""Decayed block cross-entropy and the acceptance metrics (docs/architecture.md, "Drafter and training objective").

Slot k (1..B-1) of a block predicts the token at anchor+k with weight w_k = exp(-(k-1)/gamma);
slot 0 (the anchor itself) and unsupervised / out-of-sequence slots do not count. The loss is
sum(w * CE) / sum(w) over valid slots. The frozen LM head runs on valid slots only (it dominates
the cost of small drafters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# gamma by block size, the DFlash paper's values (SpecForge's trainer suggests the same: "7 for
# block_size=16, 5 for 10, 4 for 8"). Larger blocks keep more weight on late slots.
GAMMA_BY_BLOCK = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """The published gamma for B = 8 / 10 / 16; other sizes: piecewise linear through those points
    (B/2 up to 10, then +1/3 per slot), so the weight of the last slot stays comparable."""
    if block_size in GAMMA_BY_BLOCK:
        return GAMMA_BY_BLOCK[block_size]
    if block_size <= 10:
        return max(1.0, block_size / 2)
    return 5.0 + (block_size - 10) / 3


def resolve_gamma(gamma: float | None, block_size: int) -> float:
    return float(gamma) if gamma is not None else default_gamma(block_size)


def slot_weights(block_size: int, gamma: float | None, first_slot: int = 1) -> torch.Tensor:
    """(B,) float32: w_k = 0 for k < first_slot, exp(-(k-first_slot)/gamma) after (first draft: 1;
    gamma None: by block size)."""
    gamma = resolve_gamma(gamma, block_size)
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - first_slot) / gamma)
    w[:first_slot] = 0.0
    return w


@dataclass
class BlockOutputs:
    """Per valid slot results of one batch (M valid slots)."""

    weighted_ce_sum: torch.Tensor  # scalar, differentiable: sum_k w_k * CE_k
    weight_sum: torch.Tensor  # scalar: sum of w over valid slots
    correct: torch.Tensor  # (S, N, B) bool: argmax == target at valid slots (False elsewhere)
    valid: torch.Tensor  # (S, N, B) bool


def _ce_chunk(h: torch.Tensor, lm_head: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h (m, H), target (m,) row of lm_head or -1 (none: CE 0) → CE (m,) fp32 and top-1 hits (m,). Matmul in the
    autocast dtype, softmax fp32."""
    logits = (h @ lm_head.t()).float()  # (m, V)
    return F.cross_entropy(logits, target, reduction="none", ignore_index=-1), logits.detach().argmax(-1) == target


_CE = {"fn": _ce_chunk}


def compile_loss() -> None:
    """Fuse the fp32 upcast + log-softmax + NLL of the LM-head chunk (torch.compile; GPU training)."""
    _CE["fn"] = torch.compile(_ce_chunk, dynamic=True)


def block_losses(
    h: torch.Tensor,  # (S, N*B, H) drafter output after the final norm
    lm_head: torch.Tensor,  # (V, H) frozen target LM head (a draft vocabulary: its D rows)
    targets: torch.Tensor,  # (S, N, B) row of lm_head; -1: a token the head cannot draft (no CE, never a hit)
    valid: torch.Tensor,  # (S, N, B) bool
    weights: torch.Tensor,  # (B,)
    chunk: int = 8192,
) -> BlockOutputs:
    S, N, B = valid.shape
    flat_valid = valid.reshape(-1)
    hv = h.reshape(S * N * B, -1)[flat_valid]  # (M, H): only valid slots meet the LM head
    tv = targets.reshape(-1)[flat_valid]  # (M,)
    wv = weights.to(h.device)[None, None, :].expand(S, N, B).reshape(-1)[flat_valid]  # (M,)
    wv = wv * (tv >= 0)  # a token outside a draft vocabulary is learnt by no row: out of the mean
    ce_parts, hit_parts = [], []
    for lo in range(0, hv.shape[0], chunk):
        ce, hits = _CE["fn"](hv[lo : lo + chunk], lm_head, tv[lo : lo + chunk])
        ce_parts.append(ce)
        hit_parts.append(hits)
    ce = torch.cat(ce_parts) if ce_parts else h.new_zeros(0, dtype=torch.float32)
    hits = torch.cat(hit_parts) if hit_parts else torch.zeros(0, dtype=torch.bool, device=h.device)
    correct = torch.zeros(S * N * B, dtype=torch.bool, device=h.device)
    correct[flat_valid] = hits
    # h.sum()*0 keeps the graph connected when a batch has no valid slot (every parameter gets a gradient on every rank).
    weighted = (wv * ce).sum() + h.sum() * 0.0
    return BlockOutputs(weighted, wv.sum().detach(), correct.view(S, N, B), valid)


def accepted_prefix(ok: torch.Tensor, first_slot: int = 1) -> torch.Tensor:
    """(..., B) bool per slot → (...) int64: the length of the prefix of slots first_slot.. that are all True (a
    block's accepted drafts when `ok` is argmax == data; its checkable drafts when `ok` is valid)."""
    return torch.cumprod(ok[..., first_slot:].long(), dim=-1).sum(-1)


def slot_stats(out: BlockOutputs, anchor_real: torch.Tensor, first_slot: int = 1) -> torch.Tensor:
    """Sums for per-slot accuracy and simulated acceptance, as one vector (all-reducible).

    anchor_real (S, N) bool. Layout: [correct per slot (B), valid per slot (B), sum of accepted
    prefix lengths over blocks, number of blocks]. Simulated acceptance of a block = 1 + length of
    the prefix of slots 1..B-1 whose argmax is right (an invalid slot ends the prefix).
    """
    correct_per_slot = out.correct.sum(dim=(0, 1)).float()  # (B,)
    valid_per_slot = out.valid.sum(dim=(0, 1)).float()
    prefix = accepted_prefix(out.correct, first_slot).float()  # (S, N)
    accepted = (prefix * anchor_real).sum().reshape(1)
    blocks = anchor_real.sum().float().reshape(1)
    return torch.cat([correct_per_slot, valid_per_slot, accepted, blocks])


def summarize(stats: torch.Tensor, block_size: int, first_slot: int = 1) -> dict[str, float]:
    """Metrics from (possibly all-reduced) slot_stats sums: acc_slot_k, acc, sim_tau."""
    B, f = block_size, first_slot
    correct, valid = stats[:B], stats[B : 2 * B]
    accepted, blocks = float(stats[2 * B]), float(stats[2 * B + 1])
    metrics = {f"acc_slot_{k}": float(correct[k] / valid[k]) if valid[k] > 0 else 0.0 for k in range(f, B)}
    metrics["acc"] = float(correct[f:].sum() / valid[f:].sum()) if valid[f:].sum() > 0 else 0.0
    metrics["sim_tau"] = 1.0 + accepted / blocks if blocks > 0 else 1.0
    return metrics
