"""DSpark training on a tiny target: the distribution objective decreases, analytic val metrics, warm start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter  # noqa: E402
from draftforge.drafter.export import export_drafter  # noqa: E402
from draftforge.train.config import TrainConfig, needs_last_layer  # noqa: E402
from draftforge.train.data import collate  # noqa: E402
from draftforge.train.loop import build_model, train  # noqa: E402
from train_fixtures import load_target, make_inputs, synthetic_items  # noqa: E402


@pytest.fixture(scope="module")
def items(tiny_target_info):
    """(ids, mask, taps, last) with last = the target's final-normed last-layer states."""
    model = load_target(tiny_target_info)
    out = []
    for ids, mask, taps in synthetic_items(tiny_target_info, 8, seed=0, model=model):
        with torch.no_grad():
            last = model(ids[None], output_hidden_states=True).hidden_states[-1][0].float()
        out.append((ids, mask, taps, last))
    return out


def _dspark_inputs(info, cfg, items, tmp_path, **heads):
    inp = make_inputs(info, cfg, items[:6], items[6:], tmp_path)
    inp.dcfg = DSparkConfig.from_dflash(inp.dcfg, **heads)
    return inp


def test_collate_dspark_convention():
    ids = torch.arange(10, 30)
    mask = torch.ones(20, dtype=torch.uint8)
    b = collate([(ids, mask, torch.zeros(20, 2), torch.zeros(20, 3))], [torch.tensor([2, 17])], 4, 3,
                first_slot=0, pred_offset=1)
    assert b.targets[0, 0].tolist() == [13, 14, 15, 16] and b.prev_ids[0, 0].tolist() == [12, 13, 14, 15]
    assert b.valid[0, 1].tolist() == [True, True, False, False]  # predicted positions 18, 19 | 20, 21 outside
    assert b.last.shape == (1, 20, 3)


def test_dspark_loss_decreases_with_analytic_metrics(tiny_target_info, items, tmp_path):
    cfg = TrainConfig(max_steps=24, batch_seqs=2, num_anchors=8, lr=3e-3, eval_every=12, ckpt_every=24, log_every=4,
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False, drafter_type="dspark",
                      markov_rank=16, loss_vocab_chunk=100)
    res = train(_dspark_inputs(tiny_target_info, cfg, items, tmp_path, markov_rank=16))
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    ev = res.evals[-1]
    B = res.model.cfg.block_size
    assert {"val_analytic_tau", "val_conf_ece", "val_analytic_accept_0", f"val_analytic_accept_{B - 1}", "val_acc_slot_0"} <= set(ev)
    assert 1.0 <= ev["val_analytic_tau"] <= B + 1 and 0 <= ev["val_conf_ece"] <= 1
    assert torch.count_nonzero(res.model.markov_head.markov_w2.weight) > 0  # the Markov head learned


def test_dflash_can_train_on_the_target_distribution(tiny_target_info, items, tmp_path):
    cfg = TrainConfig(max_steps=2, batch_seqs=2, num_anchors=4, eval_every=2, ckpt_every=2, val_max_seqs=1,
                      val_num_anchors=4, init_from_target=False, loss_kl=1.0, loss_ce=0.5)
    res = train(make_inputs(tiny_target_info, cfg, items[:4], items[6:7], tmp_path))
    assert "val_analytic_tau" in res.evals[-1] and isinstance(res.model, DFlashDrafter)


def test_warm_start_from_a_dflash_drafter(tiny_target_info, items, tmp_path):
    torch.manual_seed(3)
    dcfg = DFlashConfig.from_target(tiny_target_info)
    src = DFlashDrafter(dcfg)
    export_drafter(src, dcfg, tmp_path / "dflash", dtype=torch.float32)
    cfg = TrainConfig(init_from=str(tmp_path / "dflash"), drafter_type="dspark", markov_rank=8)
    model = build_model(_dspark_inputs(tiny_target_info, cfg, items, tmp_path, markov_rank=8))
    assert isinstance(model, DSparkDrafter)
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_needs_last_layer_switch():
    class Root:
        def __init__(self, **kw):
            self.train = TrainConfig(**kw)

    assert not needs_last_layer(Root())
    assert needs_last_layer(Root(drafter_type="dspark"))
    assert needs_last_layer(Root(loss_tv=1.0))
