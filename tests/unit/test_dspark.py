"""DSpark drafter: rank 0 == DFlash, Markov bias / confidence == direct formulas, config and export round trip."""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.drafter import DFlashConfig, DFlashDrafter
from draftforge.drafter.config import read_exported_config
from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter
from draftforge.drafter.export import expected_keys, export_drafter, load_drafter
from draftforge.errors import StageError

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, mask_token_id=3, target_layer_ids=[0, 2], block_size=4, target_num_layers=4)


def dspark_cfg(**kw) -> DSparkConfig:
    return DSparkConfig(**{**BASE, "markov_rank": 8, **kw})


def _inputs(cfg, T=14, anchors=(3, 9, 1, 13), seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, cfg.feature_dim, generator=g),
            torch.randn(1, len(anchors) * cfg.block_size, cfg.hidden_size, generator=g), torch.tensor([list(anchors)]))


def test_rank0_bonus_anchor_is_exactly_dflash():
    torch.manual_seed(0)
    dflash = DFlashDrafter(DFlashConfig(**BASE)).eval()
    dspark = DSparkDrafter(dspark_cfg(markov_rank=0, bonus_anchor=True, enable_confidence_head=False)).eval()
    assert set(dspark.state_dict()) == set(dflash.state_dict())
    dspark.load_state_dict(dflash.state_dict())
    tapped, emb, anc = _inputs(dflash.cfg)
    lm_head = torch.randn(300, 64)
    prev = torch.randint(0, 300, (1, anc.shape[1] * 4))
    h_ref = dflash(tapped, emb, anc, "sdpa")
    h = dspark(tapped, emb, anc, "sdpa")
    assert torch.equal(dspark.head_logits(h, lm_head, prev), h_ref @ lm_head.t())
    # and the inference pass
    from draftforge.drafter.inference import DraftKV

    a0 = dflash.layers[0].self_attn
    kv_a, kv_b = (DraftKV(len(dflash.layers), a0.n_kv, a0.head_dim, 16, tapped.device, emb.dtype) for _ in range(2))
    args = (emb[:, :4], torch.arange(5, 9), tapped[:, :5], torch.arange(5))
    assert torch.equal(dflash.draft(*args, kv_a.kv, 9), dspark.draft(*args, kv_b.kv, 9))
    assert dspark.cfg.first_slot == 1 and dspark.cfg.n_draft == 3


@pytest.mark.parametrize("with_markov", [True, False])
def test_markov_bias_and_confidence_equal_the_direct_formula(with_markov):
    torch.manual_seed(1)
    cfg = dspark_cfg(confidence_head_with_markov=with_markov)
    m = DSparkDrafter(cfg).eval()
    for p in (m.markov_head.markov_w2.weight, m.confidence_head.proj.weight, m.confidence_head.proj.bias):
        torch.nn.init.normal_(p)
    W1, W2 = m.markov_head.markov_w1.weight.double(), m.markov_head.markov_w2.weight.double()
    w, b = m.confidence_head.proj.weight.double(), m.confidence_head.proj.bias.double()
    prev = torch.tensor([5, 0, 299, 17])
    h = torch.randn(4, 64)
    lm_head = torch.randn(300, 64)
    want_bias = W1[prev] @ W2.t()  # (4, V): B(x) = W1[x] · W2ᵀ
    assert torch.allclose(m.markov_bias(prev).double(), want_bias, atol=1e-5)
    assert torch.allclose(m.head_logits(h, lm_head, prev).double(), h.double() @ lm_head.double().t() + want_bias, atol=1e-4)
    x = torch.cat([h.double(), W1[prev]], -1) if with_markov else h.double()
    assert torch.allclose(m.confidence_logit(h, prev).double(), (x @ w.t()).squeeze(-1) + b, atol=1e-5)
    assert m.confidence_head.proj.weight.shape == (1, 64 + (8 if with_markov else 0))


def test_fresh_markov_head_adds_no_bias():
    m = DSparkDrafter(dspark_cfg())
    assert torch.count_nonzero(m.markov_bias(torch.arange(10))) == 0


def test_config_round_trip_and_vllm_keys(tmp_path):
    cfg = dspark_cfg(enable_confidence_head=True)
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["DSparkDraftModel"] and hf["model_type"] == "qwen3"
    assert (hf["markov_rank"], hf["markov_head_type"], hf["sample_from_anchor"], hf["dspark_bonus_anchor"]) == (8, "vanilla", True, False)
    assert hf["dflash_config"]["target_layer_ids"] == [0, 2] == hf["target_layer_ids"]
    assert DSparkConfig.from_hf_dict(hf) == cfg
    torch.manual_seed(0)
    m = DSparkDrafter(cfg)
    export_drafter(m, cfg, tmp_path / "d", dtype=torch.float32)
    assert read_exported_config(tmp_path / "d") == cfg
    back = load_drafter(tmp_path / "d")
    assert isinstance(back, DSparkDrafter)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= expected_keys(cfg)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    json.loads((tmp_path / "d" / "config.json").read_text())


def test_bad_configs_fail_clearly():
    with pytest.raises(StageError, match="markov_head_type"):
        dspark_cfg(markov_head_type="gated")
    with pytest.raises(StageError, match="confidence_head_with_markov"):
        dspark_cfg(markov_rank=0, enable_confidence_head=True, confidence_head_with_markov=True)
