"""DSpark training on a tiny target: the distribution objective decreases, analytic val metrics, warm start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from drafter_fixtures import drafter_of  # noqa: E402
from draftforge.drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter  # noqa: E402
from draftforge.drafter.export import export_drafter  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
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
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False, loss_vocab_chunk=100)
    res = train(_dspark_inputs(tiny_target_info, cfg, items, tmp_path, markov_rank=16))
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    ev = res.evals[-1]
    B = res.model.cfg.block_size
    assert {"val_analytic_tau", "val_conf_ece", "val_analytic_accept_0", f"val_analytic_accept_{B - 1}", "val_acc_slot_0"} <= set(ev)
    assert 1.0 <= ev["val_analytic_tau"] <= B + 1 and 0 <= ev["val_conf_ece"] <= 1
    assert torch.count_nonzero(res.model.markov_head.markov_w2.weight) > 0  # the Markov head learned


def test_dspark_trains_over_a_draft_vocabulary(tiny_target_info, items, tmp_path):
    """A DSpark drafter with a draft vocabulary: its Markov W2 has the D rows, the objective decreases and the
    export carries vLLM's d2t with it."""
    from draftforge.drafter.export import load_drafter
    from draftforge.train.loop import draft_vocab_for

    cfg = TrainConfig(max_steps=24, batch_seqs=2, num_anchors=8, lr=3e-3, eval_every=12, ckpt_every=24, log_every=4,
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False)
    inp = _dspark_inputs(tiny_target_info, cfg, items, tmp_path, markov_rank=16, draft_vocab_size=48)
    inp.draft_ids = draft_vocab_for(inp.train_source, inp.dcfg)[0]
    res = train(inp)
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    assert res.model.markov_head.markov_w2.weight.shape == (48, 16)
    assert torch.count_nonzero(res.model.markov_head.markov_w2.weight) > 0
    assert torch.equal(res.model.draft_ids, inp.draft_ids)
    out = export_drafter(res.model, res.model.cfg, tmp_path / "drafter", dtype=torch.float32)
    back = load_drafter(out)
    assert torch.equal(back.draft_ids, inp.draft_ids) and back.markov_head.markov_w2.weight.shape == (48, 16)


def test_dflash_can_train_on_the_target_distribution(tiny_target_info, items, tmp_path):
    cfg = TrainConfig(max_steps=2, batch_seqs=2, num_anchors=4, eval_every=2, ckpt_every=2, val_max_seqs=1,
                      val_num_anchors=4, init_from_target=False)
    inp = make_inputs(tiny_target_info, cfg, items[:4], items[6:7], tmp_path)
    inp.loss_weights = {"kl": 1.0, "ce": 0.5}  # a dflash drafter file with loss_kl / loss_ce set
    res = train(inp)
    assert "val_analytic_tau" in res.evals[-1] and isinstance(res.model, DFlashDrafter)


def test_acceptance_weighted_dflash_loss_decreases(tiny_target_info, items, tmp_path):
    """drafter.acceptance_weighting on a CE-only DFlash drafter: the objective runs (it reads the target's
    distribution for the weights) and decreases."""
    cfg = TrainConfig(max_steps=24, batch_seqs=2, num_anchors=8, lr=3e-3, eval_every=24, ckpt_every=24, log_every=4,
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False, loss_vocab_chunk=100)
    inp = make_inputs(tiny_target_info, cfg, items[:6], items[6:], tmp_path)
    inp.acceptance_weighting = True
    res = train(inp)
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    assert "val_analytic_tau" in res.evals[-1]


def test_warm_start_from_a_dflash_drafter(tiny_target_info, items, tmp_path):
    torch.manual_seed(3)
    dcfg = DFlashConfig.from_target(tiny_target_info, drafter_of())
    src = DFlashDrafter(dcfg)
    export_drafter(src, dcfg, tmp_path / "dflash", dtype=torch.float32)
    cfg = TrainConfig(init_from=str(tmp_path / "dflash"))
    model = build_model(_dspark_inputs(tiny_target_info, cfg, items, tmp_path, markov_rank=8))
    assert isinstance(model, DSparkDrafter)
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_needs_last_layer_switch():
    """Extract stores the last layer iff a listed drafter reads it; it is tracked as a derived value, so adding a
    drafter that does not read it leaves extract's params (and so Snakemake's rerun decision) unchanged."""
    from draftforge.config import compose, stage_params
    from draftforge.drafter.settings import needs_last_layer

    def cfg(*o):
        return compose("smoke", ["target=tiny-random", *o])

    assert not needs_last_layer(cfg("drafters=[dflash]"))
    assert needs_last_layer(cfg("drafters=[dflash,dspark]"))
    assert needs_last_layer(cfg("drafters=[dflash]", "drafter.loss_tv=1.0"))  # DFlash on the target's distribution
    assert needs_last_layer(cfg("drafters=[dflash]", "drafter.acceptance_weighting=true"))
    assert needs_last_layer(cfg("drafters=[mtp]"))  # a trained MTP head reads the last layer
    assert not needs_last_layer(cfg("drafters=[mtp]", "target.mtp_layers=1"))  # native MTP: nothing to train
    plain = stage_params(cfg("drafters=[dflash]"), "extract")
    assert plain["derived"] == {"stores_last_layer": False} and "drafters" not in plain
    assert stage_params(cfg("drafters=[dflash,dspark]"), "extract") != plain
