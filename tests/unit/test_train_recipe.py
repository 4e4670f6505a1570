"""The published recipe: loss decay by block size, reference tap ids on every shipped target, AdamW betas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from draftforge.target.config import default_tap_ids
from draftforge.train.config import TrainConfig
from draftforge.train.loss import default_gamma, slot_weights

REPO = Path(__file__).resolve().parents[2]


def reference_tap_ids(num_target_layers: int, n: int) -> list[int]:
    """The reference DFlash rule, written out independently (z-lab/dflash model/utils.py)."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + (i * (end - start)) / (n - 1))) for i in range(n)]


@pytest.mark.parametrize("block,gamma", [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_gamma_by_block_size(block, gamma):
    assert default_gamma(block) == gamma
    torch.testing.assert_close(slot_weights(block, None), slot_weights(block, gamma))
    assert slot_weights(block, None)[2] == pytest.approx(math.exp(-1 / gamma))
    assert slot_weights(block, 2.5)[2] == pytest.approx(math.exp(-1 / 2.5))  # configurable


def test_gamma_between_published_sizes_is_monotone():
    gammas = [default_gamma(b) for b in range(2, 33)]
    assert all(b >= a for a, b in zip(gammas, gammas[1:]))
    assert default_gamma(12) == pytest.approx(5 + 2 / 3) and default_gamma(4) == 2.0


def test_recipe_defaults():
    cfg = TrainConfig()
    assert cfg.loss_gamma is None and list(cfg.betas) == [0.9, 0.999]
    assert (cfg.lr, cfg.warmup_ratio, cfg.num_anchors, cfg.batch_seqs) == (6e-4, 0.04, 512, 1)


def test_default_taps_round_half_to_even():
    assert default_tap_ids(30, 5) == [1, 8, 14, 20, 27]  # 20.5 → 20, as Python's round
    assert default_tap_ids(36, 1) == [18]


@pytest.mark.parametrize("path", sorted((REPO / "conf/target").glob("*.yaml")), ids=lambda p: p.stem)
def test_tap_ids_equal_the_reference_rule(path):
    t = yaml.safe_load(path.read_text())["target"]
    L, d = int(t["num_layers"]), t["drafter"]
    ids = d.get("target_layer_ids")
    n = len(ids) if ids else int(d.get("n_taps", 5))
    ref = reference_tap_ids(L, n)
    if len(set(ref)) < n:  # the rule cannot place n distinct taps (4-layer test target): explicit ids
        assert ids and len(set(ids)) == n
        with pytest.raises(ValueError):
            default_tap_ids(L, n)
        return
    assert default_tap_ids(L, n) == ref
    if ids:
        assert list(ids) == ref, f"{path.name}: target_layer_ids {ids} != reference {ref}"


def test_compute_dtype_auto_follows_the_cpu_and_a_bad_name_is_named(monkeypatch) -> None:
    """auto = bf16 autocast only where the CPU multiplies bf16 natively (emulated bf16 is ~10x slower)."""
    import torch

    from draftforge.errors import StageError
    from draftforge.train import loop
    from draftforge.train.config import TrainConfig

    cpu = torch.device("cpu")
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(loop, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert loop.compute_dtype(TrainConfig(compute_dtype="auto"), cpu) == want
        assert loop.compute_dtype(TrainConfig(compute_dtype=""), cpu) == torch.float32  # "": CPU is fp32
    assert loop.compute_dtype(TrainConfig(compute_dtype="bfloat16"), cpu) == torch.bfloat16  # explicit: honoured
    with pytest.raises(StageError, match=r"train.compute_dtype='bf16'"):
        loop.compute_dtype(TrainConfig(compute_dtype="bf16"), cpu)
