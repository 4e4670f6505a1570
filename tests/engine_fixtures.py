"""Tiny random targets and drafters for engine/tree/evaluate tests (fp32, CPU, seconds)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.model import DFlashDrafter
from draftforge.engine.target import TargetModel, wrap_target
from draftforge.target.config import RandomTargetConfig
from draftforge.target.random import build_random_model


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is ~10x faster than contended multi-threading. Autouse in every
    module that imports it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


def tiny_drafter(tm: TargetModel, seed: int = 0, block: int = 6, mask_id: int = 3, std: float = 0.3,
                 layers: int = 1, window: int = 0, draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    """A random drafter of the target's width; larger init than training's so drafts are not uniform.
    window > 0: every layer but the last is a sliding-window layer (the published Qwen3.6 layout).
    draft_ids (D,) ascending: a draft vocabulary of those tokens (the target's rows of its LM head)."""
    cfg = DFlashConfig(
        hidden_size=tm.hidden_size, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=tm.num_heads,
        num_key_value_heads=tm.num_kv_heads, head_dim=tm.head_dim, vocab_size=tm.vocab_size, mask_token_id=mask_id,
        target_layer_ids=list(tm.tap_ids), block_size=block, target_num_layers=len(tm.layers), sliding_window=window,
        draft_vocab_size=0 if draft_ids is None else int(draft_ids.shape[0]),
    )
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    d.reset_parameters(std=std)
    if draft_ids is not None:
        d.set_draft_vocab(draft_ids, tm.lm_head.weight.detach())
    return d.eval()


def flat_sampling_target() -> TargetModel:
    """A 2-layer Qwen3 on a 4-token vocabulary with flattened next-token distributions (the T > 0 law tests)."""
    spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=4, hidden_size=32, intermediate_size=64,
                              num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, seed=3)
    model = build_random_model(spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)  # flatter next-token distributions than the default init
    return wrap_target(model, (0,))


def some_ids(vocab: int, size: int, seed: int = 0) -> torch.Tensor:
    """(size,) ascending distinct random token ids (a draft vocabulary)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def prompt(vocab: int, n: int = 7, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def tiny_dspark_drafter(tm: TargetModel, seed: int = 0, block: int = 6, mask_id: int = 3, std: float = 0.3,
                        rank: int = 8, bonus_anchor: bool = False, markov_scale: float = 1.0,
                        draft_ids: torch.Tensor | None = None):
    """A random DSpark drafter (Markov head with a non-zero, random bias; confidence head with Markov input);
    draft_ids (D,) ascending: a draft vocabulary of those tokens (its Markov W2 then has D rows)."""
    from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter

    cfg = DSparkConfig(
        hidden_size=tm.hidden_size, intermediate_size=128, num_hidden_layers=1, num_attention_heads=tm.num_heads,
        num_key_value_heads=tm.num_kv_heads, head_dim=tm.head_dim, vocab_size=tm.vocab_size, mask_token_id=mask_id,
        target_layer_ids=list(tm.tap_ids), block_size=block, target_num_layers=len(tm.layers),
        markov_rank=rank, bonus_anchor=bonus_anchor, draft_vocab_size=0 if draft_ids is None else int(draft_ids.shape[0]),
    )
    torch.manual_seed(seed)
    d = DSparkDrafter(cfg)
    d.reset_parameters(std=std)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, 0.0, markov_scale / rank**0.5)
    if draft_ids is not None:
        d.set_draft_vocab(draft_ids, tm.lm_head.weight.detach())
    return d.eval()


def random_head(tm, seed: int = 0, std: float = 0.2):
    """A random MTP head for a tiny target: Qwen2 layer in MiMo form (dense), the target's own
    full-attention layer in Qwen3.5 form (hybrid)."""
    from draftforge.drafter.mtp import MTPHead, trained_head_config

    torch.manual_seed(seed)
    cfg = tm.hf.config
    if tm.hybrid:
        head = MTPHead(cfg, "qwen3_5", "native")
    else:
        head = MTPHead(trained_head_config(cfg.to_dict()), "mimo", "trained")
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std * 2.4 / p.shape[-1] ** 0.5 / 0.2)
    return head.eval()


def drafter_kinds() -> dict:
    """Every drafter type × convention the engine serves → (builder(tm), the methods that run it). Together
    they cover every registered engine method (tests/unit/test_engine_graph.py checks that)."""

    def mtp(tm: TargetModel):
        head = random_head(tm, seed=3)
        head.num_drafts = 3
        return head

    return {
        "dflash": (lambda tm: tiny_drafter(tm, seed=3), ("dflash", "ddtree", "ddtree_lookup")),
        "dflash_sliding": (lambda tm: tiny_drafter(tm, seed=3, layers=2, window=4), ("dflash", "ddtree")),
        "dflash_draft_vocab": (lambda tm: tiny_drafter(tm, seed=3, draft_ids=some_ids(tm.vocab_size, tm.vocab_size * 2 // 3)),
                               ("dflash", "ddtree")),
        "dspark": (lambda tm: tiny_dspark_drafter(tm, seed=3), ("dflash", "ddtree", "dspark", "ddtree_markov")),
        "dspark_bonus_anchor": (lambda tm: tiny_dspark_drafter(tm, seed=3, bonus_anchor=True),
                                ("dflash", "ddtree", "dspark", "ddtree_markov")),
        "dspark_draft_vocab": (lambda tm: tiny_dspark_drafter(tm, seed=3, draft_ids=some_ids(tm.vocab_size, tm.vocab_size * 2 // 3)),
                               ("dflash", "ddtree", "dspark", "ddtree_markov")),
        "mtp": (mtp, ("mtp",)),
    }


# ------------------------------------------------------------------ T > 0: sampled tokens vs the exact target law
def chi2_critical(df: int, z: float) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df) for a standard-normal quantile z."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def exact_joint(tm: TargetModel, p: list[int], n_tok: int, temperature: float) -> dict[tuple[int, ...], float]:
    """Exact target distribution of the first n_tok sampled tokens, by enumeration."""
    V = tm.vocab_size
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n_tok - 1):
            logits = tm.hf(torch.tensor([p + list(seq)])).logits[0, len(p) - 1 :]  # (n_tok, V)
            step = torch.softmax(logits.double() / temperature, -1)
            pre = 1.0
            for i, t in enumerate(seq):
                pre *= step[i, t].item()
            for last in range(V):
                probs[seq + (last,)] = pre * step[n_tok - 1, last].item()
    return probs


def assert_matches_target_law(counts: Counter, n: int, tm: TargetModel, p: list[int], n_tok: int,
                              temperature: float) -> None:
    """Pearson chi-square of n sampled n_tok-prefixes against the exact joint, rejected at α = 1e-3 (z = 3.09);
    cells with expectation < 5 pooled. Negative control: the same counts against the T = 0.4 joint must be
    rejected, or the test has no power."""

    def chi2(probs: dict[tuple[int, ...], float]) -> tuple[float, int]:
        cells = [(counts.get(k, 0), n * q) for k, q in probs.items()]
        big = [(o, e) for o, e in cells if e >= 5]
        small_o, small_e = sum(o for o, e in cells if e < 5), sum(e for o, e in cells if e < 5)
        if small_e > 0:
            big.append((small_o, small_e))
        return sum((o - e) ** 2 / e for o, e in big), len(big) - 1

    stat, df = chi2(exact_joint(tm, p, n_tok, temperature))
    assert stat < chi2_critical(df, 3.09), f"chi2 {stat:.1f} on {df} df"
    wrong, wdf = chi2(exact_joint(tm, p, n_tok, 0.4))
    assert wrong > chi2_critical(wdf, 3.09), "negative control not rejected: the test has no power"
