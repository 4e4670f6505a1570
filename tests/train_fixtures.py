"""Fixtures of the train tests: features from a real (tiny, random) target, in memory.

The per-sequence tuple is exactly the extract reader's: (input_ids (T,) int64, loss_mask (T,) uint8,
hidden (T, n_taps*H) float32) with hidden = concat over taps L of HF hidden_states[L+1].
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftforge.drafter.config import DFlashConfig
from draftforge.train.config import TrainConfig
from draftforge.train.data import InMemorySource
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs


def load_target(info: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(info["hf_path"], dtype=torch.float32).eval()


@torch.no_grad()
def tapped_features(model, ids: torch.Tensor, taps: list[int]) -> torch.Tensor:
    """ids (T,) → (T, n_taps*H): outputs of decoder layers `taps` (HF hidden_states[L+1])."""
    out = model(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[t + 1][0] for t in taps], dim=-1).float()


def synthetic_items(info: dict, n_seq: int, seed: int = 0, min_len: int = 24, max_len: int = 48, prompt_len: int = 6, model=None):
    """Random byte-token sequences; loss mask covers everything after a short prompt."""
    model = model or load_target(info)
    taps = info["drafter"]["target_layer_ids"]
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n_seq):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(6, 262, (T,), generator=gen)
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[prompt_len:] = 1
        items.append((ids, mask, tapped_features(model, ids, taps)))
    return items


def make_inputs(info: dict, cfg: TrainConfig, train_items, val_items, ckpt_dir: Path, rank: int = 0, world: int = 1, resume_key: str = "test") -> TrainInputs:
    dcfg = DFlashConfig.from_target(info)
    return TrainInputs(
        cfg=cfg,
        dcfg=dcfg,
        train_source=InMemorySource(train_items),
        val_source=InMemorySource(val_items) if val_items else None,
        head=FrozenTargetHead.from_target(info["hf_path"]),
        ckpt_dir=Path(ckpt_dir),
        resume_key=resume_key,
        rank=rank,
        world=world,
        target_hf_path=info["hf_path"],
    )
