"""DSpark drafter: the DFlash backbone plus a low-rank Markov head and a confidence head (vLLM's `dspark`).

Heads (vLLM 0.32 `qwen3_dspark.py`, `DSparkMarkovHead` / `DSparkConfidenceHead`; same names and shapes):
    e      = markov_w1[prev]                         (r,)  Embedding(V, r) of the token before the predicted one
    bias   = markov_w2 · e                           (V',) markov_w2.weight (V', r), LM-head-like
    logits = lm_head(h_slot) + bias
V' is the rows the drafter drafts over: the target's vocabulary V, or its draft vocabulary's D rows
(docs/architecture.md, "Draft vocabulary"; vLLM's DSparkMarkovHead takes the same two sizes). `prev` is a target
token id either way (the bonus token comes from the target), so markov_w1 keeps all V rows.
    conf   = sigmoid(proj([h_slot; e]))              proj Linear(H + r, 1, bias) (or Linear(H, 1) without e)

Block conventions (`bonus_anchor`):
    False (vLLM's `sample_from_anchor: true`, DSpark's default): the block [anchor, mask x (B-1)] sits at
          positions a..a+B-1 and EVERY slot k predicts the token at a+k+1 (B drafts per block).
    True  (`dspark_bonus_anchor: true`, the DFlash fill-in layout): slot 0 is the anchor, slots k=1..B-1
          predict the token at a+k (B-1 drafts).
In both, `prev` for the slot predicting position p is the token at p-1 (the anchor for the first slot;
the previously drafted token at inference, the data token when training). `markov_rank: 0` with
`bonus_anchor: true` is exactly the DFlash drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.model import DFlashDrafter
from draftforge.drafter.settings import DrafterConfig as Shape
from draftforge.drafter.types.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE  # vLLM: Qwen3DSparkModel
from draftforge.drafter.types.dspark import is_dspark  # noqa: F401  (train/loop.py imports it from here)
from draftforge.errors import StageError

MARKOV_HEAD_TYPES = ("vanilla",)  # the only head type vLLM 0.32 loads


@dataclass
class DSparkConfig(DFlashConfig):
    ARCHITECTURE: ClassVar[str] = DSPARK_ARCHITECTURE
    # Head defaults are the `drafter` section's (drafter.settings.DrafterConfig), written there once.
    markov_rank: int = Shape.markov_rank
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = Shape.confidence_head
    confidence_head_with_markov: bool = Shape.confidence_head_with_markov
    bonus_anchor: bool = Shape.bonus_anchor  # False: every slot predicts the next position (vLLM sample_from_anchor)

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.markov_rank < 0:
            problems.append(f"markov_rank {self.markov_rank} < 0")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            problems.append(f"markov_head_type {self.markov_head_type!r}: only {list(MARKOV_HEAD_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            problems.append("confidence_head_with_markov needs markov_rank > 0")
        if problems:
            raise StageError("drafter config: " + "; ".join(problems))

    @property
    def first_slot(self) -> int:
        """The first block slot that predicts a token."""
        return 1 if self.bonus_anchor else 0

    @property
    def pred_offset(self) -> int:
        """Slot k predicts the token at anchor + k + pred_offset."""
        return 0 if self.bonus_anchor else 1

    @property
    def n_draft(self) -> int:
        return self.block_size - self.first_slot

    @property
    def draft_rows(self) -> int:
        """Rows of the drafter's logits (and of the Markov bias): D with a draft vocabulary, else V."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def confidence_input_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM's Qwen3DSparkModel: markov_head.*, confidence_head.proj.*"""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.markov_rank > 0:
            shapes["markov_head.markov_w1.weight"] = (self.vocab_size, self.markov_rank)
            shapes["markov_head.markov_w2.weight"] = (self.draft_rows, self.markov_rank)
        if self.enable_confidence_head:
            shapes["confidence_head.proj.weight"] = (1, self.confidence_input_dim)
            shapes["confidence_head.proj.bias"] = (1,)
        return shapes

    def as_exported(self, where: str) -> DFlashConfig:
        """Without a Markov head vLLM's dspark loader has nothing to serve: a rank-0 drafter with DFlash's
        block convention and no confidence head IS a DFlash drafter and is exported as one."""
        if self.markov_rank:
            return self
        if not self.bonus_anchor or self.enable_confidence_head:
            raise StageError(f"{where}: markov_rank 0 exports only as DFlash (bonus_anchor: true, no confidence head)")
        return DFlashConfig.from_dict(self.to_dict())

    @classmethod
    def shape_fields(cls, shape: Any) -> dict[str, Any]:
        """The backbone's fields plus the heads; the confidence head reads the Markov embedding only when
        there is a Markov head."""
        rank = int(shape.markov_rank)
        return {**super().shape_fields(shape), "markov_rank": rank, "enable_confidence_head": bool(shape.confidence_head),
                "confidence_head_with_markov": bool(shape.confidence_head_with_markov) and rank > 0,
                "bonus_anchor": bool(shape.bonus_anchor)}

    @classmethod
    def from_dflash(cls, base: DFlashConfig, **heads: Any) -> "DSparkConfig":
        values = {k: v for k, v in base.to_dict().items()}
        values.update(heads)
        return cls(**values)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as vLLM's `dspark` method reads a dense Qwen3 DSpark drafter."""
        hf = super().to_hf_dict()
        hf.update({
            "architectures": [DSPARK_ARCHITECTURE],
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sample_from_anchor": not self.bonus_anchor,
            "dspark_bonus_anchor": self.bonus_anchor,
            "mask_token_id": self.mask_token_id,
            # vLLM reads dflash_config.target_layer_ids first (0-based, +1 internally); stated twice.
            "target_layer_ids": list(self.target_layer_ids),
        })
        return hf

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], where: str = "config.json") -> "DSparkConfig":
        if hf.get("architectures") != [DSPARK_ARCHITECTURE]:
            raise StageError(f"{where}: architectures {hf.get('architectures')} is not [{DSPARK_ARCHITECTURE!r}]")
        base = DFlashConfig.from_hf_dict({**hf, "architectures": ["DFlashDraftModel"]}, where)
        try:
            return cls.from_dflash(base, markov_rank=int(hf["markov_rank"]),
                                   markov_head_type=str(hf.get("markov_head_type", "vanilla")),
                                   enable_confidence_head=bool(hf.get("enable_confidence_head", False)),
                                   confidence_head_with_markov=bool(hf.get("confidence_head_with_markov", False)),
                                   bonus_anchor=bool(hf.get("dspark_bonus_anchor", not hf.get("sample_from_anchor", True))))
        except (KeyError, TypeError, ValueError) as exc:
            raise StageError(f"{where}: missing or bad DSpark key ({exc!r})") from None


class MarkovHead(nn.Module):
    """vLLM's DSparkMarkovHead (vanilla): markov_w1 Embedding(V, r) over target ids, markov_w2 weight (V', r) over
    the drafted rows (V' = V, or a draft vocabulary's D)."""

    def __init__(self, vocab_size: int, rank: int, draft_rows: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_rows, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return markov_embed @ self.markov_w2.weight.t().to(markov_embed.dtype)


class ConfidenceHead(nn.Module):
    """vLLM's DSparkConfidenceHead: proj Linear(input_dim, 1, bias) on [hidden; markov_embed] (fp32)."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return (x.float() @ self.proj.weight.float().t()).squeeze(-1) + self.proj.bias.float()


class DSparkDrafter(DFlashDrafter):
    """DFlash backbone (same forward / draft API) + Markov and confidence heads."""

    def __init__(self, cfg: DSparkConfig, attn_impl: str = "auto") -> None:
        super().__init__(cfg, attn_impl)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.draft_rows) if cfg.markov_rank > 0 else None
        self.confidence_head = (ConfidenceHead(cfg.confidence_input_dim, cfg.confidence_head_with_markov)
                                if cfg.enable_confidence_head else None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)  # normal(std) for every Linear, ones for norms
        if getattr(self, "markov_head", None) is not None:
            # Bias starts at zero (a DFlash warm start keeps its logits); W1 carries unit-scale codes.
            nn.init.normal_(self.markov_head.markov_w1.weight, 0.0, 1.0)
            nn.init.zeros_(self.markov_head.markov_w2.weight)
        if getattr(self, "confidence_head", None) is not None:
            nn.init.zeros_(self.confidence_head.proj.bias)

    # ---- heads -----------------------------------------------------------------------------------
    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        return self.markov_head.embed(prev_ids) if self.markov_head is not None else None

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """prev_ids (...,) target ids → (..., V') logit bias over the drafted rows (None without a Markov head)."""
        if self.markov_head is None:
            return None
        return self.markov_head.bias(self.markov_head.embed(prev_ids))

    def head_logits(self, h: torch.Tensor, lm_head: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """h (..., H) predicting slots, lm_head (V', H) the drafted rows, prev_ids (...,) → logits (..., V') =
        lm_head(h) + bias(prev)."""
        logits = h @ lm_head.t().to(h.dtype)
        bias = self.markov_bias(prev_ids)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def confidence_logit(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(...,) fp32 logit of the acceptance probability (sigmoid → vLLM's compute_confidence)."""
        if self.confidence_head is None:
            raise ValueError("DSpark drafter has no confidence head (enable_confidence_head: false)")
        e = self.markov_embed(prev_ids)
        if self.confidence_head.with_markov and e is None:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")
        return self.confidence_head(h, e)
