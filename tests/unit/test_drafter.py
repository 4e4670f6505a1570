"""DFlash drafter: mask semantics, dense == flex, training forward == incremental inference, export."""

from __future__ import annotations

import json

import pytest
import torch

from drafter_fixtures import drafter_of, tiny_shape
from draftforge.drafter import DFlashConfig, DFlashDrafter
from draftforge.drafter.attention import HAS_FLEX, dense_block_mask, flex_block_mask
from draftforge.drafter.export import check_keys, expected_keys, export_drafter, load_drafter
from draftforge.errors import StageError

B = 4


def small_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=300, mask_token_id=3, target_layer_ids=[0, 2], block_size=B, target_num_layers=4)
    return DFlashConfig(**{**base, **kw})


@pytest.fixture(params=["full", "sliding"])
def model(request):
    """Every layer full attention, or [sliding, full] with a window that cuts into the context."""
    torch.manual_seed(0)
    extra = {} if request.param == "full" else {"sliding_window": 5}
    return DFlashDrafter(small_cfg(**extra)).eval()


def inputs(cfg: DFlashConfig, T: int = 14, anchors=(3, 9, 1, 13), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tapped = torch.randn(1, T, cfg.feature_dim, generator=g)
    anc = torch.tensor([list(anchors)])
    emb = torch.randn(1, len(anchors) * cfg.block_size, cfg.hidden_size, generator=g)
    return tapped, emb, anc


def test_dense_mask_is_exactly_the_dflash_rule():
    anchors = torch.tensor([[5, 0, 9], [2, 7, 7]])
    T = 10
    mask = dense_block_mask(anchors, T, B)  # (S, 1, Q, T+Q)
    S, N = anchors.shape
    for s in range(S):
        for q in range(N * B):
            n = q // B
            for kv in range(T + N * B):
                want = kv < anchors[s, n] if kv < T else (kv - T) // B == n
                assert bool(mask[s, 0, q, kv]) == bool(want), (s, q, kv)


def test_sliding_mask_is_windowed_and_causal_inside_the_block():
    anchors = torch.tensor([[5, 0, 9], [2, 7, 7]])
    T, W = 10, 4
    mask = dense_block_mask(anchors, T, B, window=W)
    S, N = anchors.shape
    for s in range(S):
        for q in range(N * B):
            n, k = q // B, q % B
            pos = int(anchors[s, n]) + k
            for kv in range(T + N * B):
                if kv < T:
                    want = kv < anchors[s, n] and pos - kv < W
                else:
                    want = (kv - T) // B == n and (kv - T) % B <= k
                assert bool(mask[s, 0, q, kv]) == bool(want), (s, q, kv)
    cfg = small_cfg(sliding_window=W)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    with pytest.raises(StageError, match="sliding_window"):
        small_cfg(layer_types=["sliding_attention", "full_attention"])


@pytest.mark.skipif(not HAS_FLEX, reason="torch without flex_attention")
@pytest.mark.parametrize("window", [0, 37])
def test_flex_block_mask_equals_dense_mask(window):
    anchors = torch.tensor([[5, 0, 9, 3], [2, 7, 7, 1]])
    T = 300  # spans several 128-token tiles
    block_mask = flex_block_mask(anchors, T, B, window)
    dense = block_mask.to_dense()  # tile-level; compare through the mask_mod instead
    assert dense.shape[0] == 2
    full = dense_block_mask(anchors, T, B, window)
    mm = block_mask.mask_mod
    q = torch.arange(anchors.shape[1] * B)[:, None]
    kv = torch.arange(T + anchors.shape[1] * B)[None, :]
    for b in range(2):
        got = mm(torch.tensor(b), torch.tensor(0), q, kv)
        assert torch.equal(got, full[b, 0])


def test_block_sees_no_other_block_and_no_context_at_or_after_its_anchor(model):
    """Perturbation test on the real model: what a block must not see cannot change its output."""
    cfg = model.cfg
    tapped, emb, anc = inputs(cfg)
    with torch.no_grad():
        ref = model(tapped, emb, anc, "sdpa")
    n, a = 0, int(anc[0, 0])  # block 0, anchor 3
    t2, e2 = tapped.clone(), emb.clone()
    t2[:, a:] += torch.randn_like(t2[:, a:])  # context at/after the anchor
    e2[:, B:] += torch.randn_like(e2[:, B:])  # every other block
    with torch.no_grad():
        out = model(t2, e2, anc, "sdpa")
    torch.testing.assert_close(out[:, n * B : (n + 1) * B], ref[:, :B], rtol=0, atol=1e-5)
    # ...while context before the anchor does matter
    t3 = tapped.clone()
    t3[:, a - 1] += 1.0
    with torch.no_grad():
        out3 = model(t3, emb, anc, "sdpa")
    assert (out3[:, :B] - ref[:, :B]).abs().max() > 1e-4


@pytest.mark.skipif(not HAS_FLEX, reason="torch without flex_attention")
def test_flex_and_dense_forward_match(model):
    tapped, emb, anc = inputs(model.cfg)
    with torch.no_grad():  # FlexAttention has no backward on CPU (torch 2.13); GPU grads: tests/gpu
        dense = model(tapped, emb, anc, "sdpa")
        flex = model(tapped, emb, anc, "flex")
    torch.testing.assert_close(dense, flex, rtol=1e-4, atol=1e-5)


def test_training_forward_equals_incremental_draft_with_cache_crop(model):
    """The inference block pass (drafter.draft, the engine's) over a context cache written round by round
    equals the training forward's blocks, also after drafting past a later start and coming back."""
    from draftforge.drafter.inference import DraftKV

    cfg = model.cfg
    tapped, emb, anc = inputs(cfg)
    a0 = model.layers[0].self_attn
    with torch.no_grad():
        ref = model(tapped, emb, anc, "sdpa")
        cache = DraftKV(len(model.layers), a0.n_kv, a0.head_dim, 8, tapped.device, emb.dtype)  # grows
        # round 1 at start 1 (anchor of block 2), then draft past it, crop, and continue at 3, 9, 13
        length = 0
        for n, start in [(2, 1), (0, 3), (1, 9), (3, 13)]:
            cache.ensure(start + B)
            out = model.draft(emb[:, n * B : (n + 1) * B], torch.arange(start, start + B), tapped[:, length:start],
                              torch.arange(length, start), cache.kv, start + B)
            torch.testing.assert_close(out, ref[:, n * B : (n + 1) * B], rtol=1e-4, atol=1e-5)
            length = start  # context only: the block's rows are scratch for the next round


def test_config_from_target_and_hf_round_trip(tiny_target_info):
    shape = drafter_of()  # tiny-random's drafter section: 1 layer, block 8
    cfg = DFlashConfig.from_target(tiny_target_info, shape)
    d = tiny_target_info["drafter"]  # what the target fixes: taps, mask token
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size) == (tiny_target_info["hidden_size"], 1, 8) == (
        tiny_target_info["hidden_size"], shape.num_layers, shape.block_size)
    assert cfg.target_layer_ids == d["target_layer_ids"] and cfg.feature_dim == len(d["target_layer_ids"]) * cfg.hidden_size
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {"mask_token_id": d["mask_token_id"], "target_layer_ids": d["target_layer_ids"]}
    assert set(hf["layer_types"]) == {"full_attention"} and "eagle_config" not in hf
    assert DFlashConfig.from_hf_dict(hf) == cfg
    windowed = DFlashConfig.from_target(tiny_target_info, tiny_shape(num_layers=3, sliding_window=16))
    hf = windowed.to_hf_dict()
    assert hf["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert hf["sliding_window"] == 16 and hf["use_sliding_window"] is True
    assert DFlashConfig.from_hf_dict(hf) == windowed
    with pytest.raises(StageError, match="mask_token_id"):
        DFlashConfig.from_target({**tiny_target_info, "drafter": {**d, "mask_token_id": 10**6}}, shape)


def test_export_round_trip_and_key_check(model, tmp_path):
    cfg = model.cfg
    out = export_drafter(model, cfg, tmp_path / "drafter", dtype=torch.float32)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and "eagle_config" not in hf
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert names == expected_keys(cfg)
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    loaded = load_drafter(out)
    tapped, emb, anc = inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tapped, emb, anc, "sdpa"), model(tapped, emb, anc, "sdpa"))
    state = {k: v for k, v in model.state_dict().items()}
    with pytest.raises(StageError, match="unexpected"):
        check_keys({**state, "model.embed_tokens.weight": torch.zeros(300, 64)}, cfg)
    with pytest.raises(StageError, match="missing"):
        check_keys({k: v for k, v in state.items() if k != "layers.1.self_attn.k_norm.weight"}, cfg)
    with pytest.raises(StageError, match="wrong shapes"):
        check_keys({**state, "fc.weight": torch.zeros(64, 64)}, cfg)


def test_a_truncated_export_is_one_error_naming_the_file(tmp_path):
    """A drafter export whose model.safetensors was cut short (a copy interrupted, a full disk elsewhere) is one
    StageError naming the file, not the safetensors library's traceback."""
    torch.manual_seed(0)
    cfg = small_cfg()
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter", dtype=torch.float32)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    for cut in (len(data) // 2, 4):  # data cut short; the header itself cut short
        weights.write_bytes(data[:cut])
        with pytest.raises(StageError, match=rf"{weights}: not a readable safetensors file \(.*\); it is truncated") as err:
            load_drafter(out)
        assert "\n" not in str(err.value)


def test_a_config_edited_after_export_is_refused_by_every_reader(tmp_path, tiny_target_info):
    """config.json records its own checksum at export: a changed block_size or taps (the weights stay loadable, so
    nothing else would notice) is one StageError naming the file in load_drafter (evaluate), the vLLM spec reader
    (baselines) and the target check; a reformatted but unchanged config still loads."""
    from draftforge.baselines.spec import read_drafter_config
    from draftforge.drafter.config import check_drafter_target

    torch.manual_seed(0)
    cfg = small_cfg(hidden_size=tiny_target_info["hidden_size"], vocab_size=tiny_target_info["vocab_size"],
                    target_num_layers=tiny_target_info["num_layers"], target_layer_ids=[0, 1], mask_token_id=3)
    fingerprint = {"draftforge": {"target": tiny_target_info["name"], "target_fingerprint": tiny_target_info["fingerprint"]}}
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter", dtype=torch.float32, extra_config=fingerprint)
    cfg_path = out / "config.json"
    exported = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(reversed(list(exported.items())))))  # same content, another layout
    assert load_drafter(out).cfg == cfg
    assert read_drafter_config(out, tiny_target_info)["block_size"] == B
    for key, value in (("block_size", 64), ("block_size", 2), ("dflash_config", {**exported["dflash_config"], "target_layer_ids": [1, 0]})):
        cfg_path.write_text(json.dumps({**exported, key: value}, indent=2))
        for read in (load_drafter, lambda d: read_drafter_config(d, tiny_target_info), lambda d: check_drafter_target(d, tiny_target_info)):
            with pytest.raises(StageError, match=rf"^{cfg_path}: edited after export .*retrain / re-export") as err:
                read(out)
            assert "\n" not in str(err.value)
    cfg_path.write_text(json.dumps(exported))
    assert load_drafter(out).cfg == cfg


def test_warm_start_copies_target_layers(tiny_target_info):
    from draftforge.drafter.warm_start import init_from_target, read_tensors

    cfg = DFlashConfig.from_target(tiny_target_info, drafter_of())
    m = DFlashDrafter(cfg)
    used = init_from_target(m, tiny_target_info["hf_path"])
    assert used == list(range(cfg.target_num_layers - cfg.num_hidden_layers, cfg.target_num_layers))
    src = read_tensors(tiny_target_info["hf_path"], [f"model.layers.{used[0]}.mlp.up_proj.weight"])
    assert torch.equal(m.layers[0].mlp.up_proj.weight, next(iter(src.values())))
    assert torch.equal(m.norm.weight, read_tensors(tiny_target_info["hf_path"], ["model.norm.weight"])["model.norm.weight"])


def test_warm_start_from_a_hybrid_target_uses_attention_layers_and_its_conventions(tmp_path):
    """Qwen3.5: sources are full-attention layers; the draft reproduces their (ungated) queries and norms."""
    import yaml

    from draftforge.drafter.warm_start import init_from_target
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import build_random_model, save_random_target

    conf = yaml.safe_load(open("conf/target/tiny-hybrid-random.yaml"))
    spec = RandomTargetConfig(**{**conf["target"]["random"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16})
    folder = save_random_target(spec, tmp_path / "hybrid")
    with torch.no_grad():  # zero-centred norms are zeros at init: give them values so the 1 + w rule is seen
        model = build_random_model(spec)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
        model.save_pretrained(folder)
    cfg = small_cfg(num_hidden_layers=2, target_num_layers=8, intermediate_size=96)
    m = DFlashDrafter(cfg)
    assert init_from_target(m, folder) == [3, 7]  # the two attention layers (3 GDN : 1 attention)
    attn, layer = model.model.layers[7].self_attn, model.model.layers[7]
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        q_target = attn.q_norm(attn.q_proj(x).view(1, 5, 4, 32)[..., :16])  # the query half, per head
        q_draft = m.layers[1].self_attn.q_norm(m.layers[1].self_attn.q_proj(x).view(1, 5, 4, 16))
        torch.testing.assert_close(q_draft, q_target, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.layers[1].input_layernorm(x), layer.input_layernorm(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.norm(x), model.model.norm(x), rtol=1e-5, atol=1e-5)
