"""Tiny random targets and drafters for engine/tree/evaluate tests (fp32, CPU, seconds)."""

from __future__ import annotations

import torch

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.model import DFlashDrafter
from draftforge.engine.target import TargetModel, wrap_target
from draftforge.target.config import RandomTargetConfig
from draftforge.target.random import build_random_model

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
HYBRID_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


def tiny_target(arch: str = "LlamaForCausalLM", vocab: int = 96, seed: int = 0, layers: int = 4,
                taps: tuple[int, ...] = (0, 2)) -> TargetModel:
    spec = RandomTargetConfig(architecture=arch, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                              num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed)
    return wrap_target(build_random_model(spec), taps)


def tiny_hybrid_target(arch: str = "Qwen3_5ForCausalLM", vocab: int = 96, seed: int = 0, layers: int = 8,
                       taps: tuple[int, ...] = (1, 3, 5)) -> TargetModel:
    """8 layers, 3 Gated DeltaNet : 1 gated attention (Qwen3.5 text or Qwen3-Next with MoE MLPs)."""
    spec = RandomTargetConfig(architecture=arch, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                              num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed)
    return wrap_target(build_random_model(spec), taps)


def tiny_drafter(tm: TargetModel, seed: int = 0, block: int = 6, mask_id: int = 3, std: float = 0.3) -> DFlashDrafter:
    """A random drafter of the target's width; larger init than training's so drafts are not uniform."""
    cfg = DFlashConfig(
        hidden_size=tm.hidden_size, intermediate_size=128, num_hidden_layers=1, num_attention_heads=tm.num_heads,
        num_key_value_heads=tm.num_kv_heads, head_dim=tm.head_dim, vocab_size=tm.vocab_size, mask_token_id=mask_id,
        target_layer_ids=list(tm.tap_ids), block_size=block, target_num_layers=len(tm.layers),
    )
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    d.reset_parameters(std=std)
    return d.eval()


def prompt(vocab: int, n: int = 7, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def tiny_dspark_drafter(tm: TargetModel, seed: int = 0, block: int = 6, mask_id: int = 3, std: float = 0.3,
                        rank: int = 8, bonus_anchor: bool = False, markov_scale: float = 1.0):
    """A random DSpark drafter (Markov head with a non-zero, random bias; confidence head with Markov input)."""
    from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter

    cfg = DSparkConfig(
        hidden_size=tm.hidden_size, intermediate_size=128, num_hidden_layers=1, num_attention_heads=tm.num_heads,
        num_key_value_heads=tm.num_kv_heads, head_dim=tm.head_dim, vocab_size=tm.vocab_size, mask_token_id=mask_id,
        target_layer_ids=list(tm.tap_ids), block_size=block, target_num_layers=len(tm.layers),
        markov_rank=rank, bonus_anchor=bonus_anchor,
    )
    torch.manual_seed(seed)
    d = DSparkDrafter(cfg)
    d.reset_parameters(std=std)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, 0.0, markov_scale / rank**0.5)
    return d.eval()
