"""Distributed and resume behaviour of the training loop (resume and rank-count invariance).

- Global batch = per-rank batch x ranks: 2 gloo processes of b sequences each follow the loss curve
  of 1 process of 2b sequences (same data, same normalization) within float tolerance.
- Interrupt + resume == uninterrupted: step count, optimizer state and curve continue.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.loop import train  # noqa: E402
from train_fixtures import StopAfter, make_inputs, spawn_gloo, synthetic_items  # noqa: E402


def cfg_for(**kw) -> TrainConfig:
    base = dict(max_steps=8, batch_seqs=4, num_anchors=6, lr=3e-3, eval_every=4, ckpt_every=100, log_every=100,
                val_max_seqs=3, val_num_anchors=6, init_from_target=True, prefetch=1)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def items(tiny_target_info):
    return synthetic_items(tiny_target_info, 8, seed=3)


def _worker(rank: int, world: int, info: dict, data_path: str, ckpt: str, out_path: str) -> None:
    items = torch.load(data_path, weights_only=False)
    res = train(make_inputs(info, cfg_for(batch_seqs=2), items, items[:3], Path(ckpt), rank=rank, world=world))
    if rank == 0:
        torch.save({"history": res.history, "evals": res.evals,
                    "weights": {k: v.clone() for k, v in res.model.state_dict().items()}}, out_path)


def test_two_gloo_ranks_of_b_match_one_process_of_2b(tiny_target_info, items, tmp_path):
    single = train(make_inputs(tiny_target_info, cfg_for(batch_seqs=4), items, items[:3], tmp_path / "single"))
    torch.save(items, tmp_path / "items.pt")
    spawn_gloo(_worker, 2, tiny_target_info, str(tmp_path / "items.pt"), str(tmp_path / "ddp"), str(tmp_path / "ddp.pt"))
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=False)
    one = [h["loss"] for h in single.history]
    two = [h["loss"] for h in ddp["history"]]
    assert len(one) == len(two) == 8
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor([h["grad_norm"] for h in ddp["history"]]),
                               torch.tensor([h["grad_norm"] for h in single.history]), rtol=1e-3, atol=1e-5)
    assert ddp["evals"][-1]["val_loss"] == pytest.approx(single.evals[-1]["val_loss"], rel=1e-4)
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(ddp["weights"][k], v, rtol=1e-3, atol=2e-4)  # Adam amplifies fp reassociation


def stopping(inp, stop):
    inp.stop = stop
    return inp


def test_interrupt_and_resume_matches_uninterrupted(tiny_target_info, items, tmp_path):
    cfg = cfg_for(max_steps=10, batch_seqs=2, ckpt_every=3, eval_every=5)
    full = train(make_inputs(tiny_target_info, cfg, items, items[:3], tmp_path / "full"))
    part = train(stopping(make_inputs(tiny_target_info, cfg, items, items[:3], tmp_path / "resumed"), StopAfter(7)))
    assert part.interrupted and part.step == 7 and len(part.history) == 7
    ck = torch.load(tmp_path / "resumed" / "step-00000007.pt", weights_only=False)
    assert ck["step"] == 7 and ck["optimizer"]["state"][0]["step"].item() == 7
    rest = train(make_inputs(tiny_target_info, cfg, items, items[:3], tmp_path / "resumed"))
    assert not rest.interrupted and rest.step == 10
    assert [h["step"] for h in rest.history] == list(range(1, 11))
    torch.testing.assert_close(torch.tensor([h["loss"] for h in rest.history]), torch.tensor([h["loss"] for h in full.history]),
                               rtol=1e-5, atol=1e-6)
    assert [h["lr"] for h in rest.history] == pytest.approx([h["lr"] for h in full.history])
    assert rest.best["val_sim_tau"] == pytest.approx(full.best["val_sim_tau"])
    for k, v in full.model.state_dict().items():
        torch.testing.assert_close(rest.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    # a different config never resumes from these checkpoints
    other = train(stopping(make_inputs(tiny_target_info, cfg, items, items[:3], tmp_path / "resumed", resume_key="other"),
                           StopAfter(1)))
    assert other.step == 1
