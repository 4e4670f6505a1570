"""Training the MTP head (train/mtp.py): resume and rank-count invariance, as the drafter's loop.

- Interrupt (a stop at step k, or an exception inside step k) + resume == uninterrupted: bit-identical
  weights, loss curve, val history and best step (fp32, CPU).
- Global batch = mtp_batch_seqs x ranks: 2 gloo ranks of 1 sequence follow the loss curve of 1 process
  of 2 sequences; every rank records the same val history and best step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter.mtp import new_trained_head  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.data import InMemorySource  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.mtp import MTPInputs, train_mtp  # noqa: E402
from train_fixtures import StopAfter, load_target, spawn_gloo, tapped_features, with_last  # noqa: E402

CFG = dict(mtp_steps=8, mtp_lr=1e-2, mtp_depth=2, mtp_rows=12, mtp_val_drafts=2, mtp_eval_every=2, max_seq_len=40,
           val_max_seqs=2, seed=0, ckpt_every=3, keep_checkpoints=2)


@pytest.fixture(scope="module")
def items(tiny_target_info):
    """8 sequences of one 5-token cycle (a head learns it in a few steps, so val τ moves and the best
    step is neither the first nor the last), with the target's taps and final-normed last layer."""
    model = load_target(tiny_target_info)
    cycle = torch.randint(6, 262, (5,), generator=torch.Generator().manual_seed(0))
    items = []
    for s in range(8):
        T = 16 + 2 * s
        ids = cycle.roll(s).repeat(T // 5 + 1)[:T]
        mask = torch.ones(T, dtype=torch.uint8)
        mask[:3] = 0
        items.append((ids, mask, tapped_features(model, ids, tiny_target_info["drafter"]["target_layer_ids"])))
    return with_last(tiny_target_info, items, model)


def _train(info: dict, items, ckpt: Path | None, train_src=None, batch_seqs: int = 1, resume_key: str = "k", **kw):
    torch.manual_seed(0)
    head, _ = new_trained_head(info["hf_path"], seed=0)
    frozen = FrozenTargetHead.from_target(info["hf_path"])
    cfg = TrainConfig(**CFG, mtp_batch_seqs=batch_seqs)
    return train_mtp(MTPInputs(cfg, head, frozen, train_src or InMemorySource(items[:6]), InMemorySource(items[6:]),
                               ckpt_dir=ckpt, resume_key=resume_key, **kw))


class CrashAt(InMemorySource):
    """A train source whose n-th read raises (a job killed inside a step)."""

    def __init__(self, items, n: int) -> None:
        super().__init__(items)
        self.n = n

    def __getitem__(self, i: int):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("killed")
        return super().__getitem__(i)


def _same(a, b) -> None:
    assert a.history == b.history and a.evals == b.evals and a.best == b.best
    for k, v in a.model.state_dict().items():  # the last weights
        assert torch.equal(b.model.state_dict()[k], v), k
    for k, v in a.selected().items():  # the selected (best val τ) weights
        assert torch.equal(b.selected()[k], v), k


@pytest.mark.parametrize("how", ["stop", "crash"])
def test_interrupted_mtp_training_resumes_bit_identically(tiny_target_info, items, tmp_path, how):
    full = _train(tiny_target_info, items, tmp_path / "full")
    assert full.step == 8 and [e["step"] for e in full.evals] == [2, 4, 6, 8] and full.best["step"] == 6
    assert len({h["mtp_loss"] for h in full.history}) == 8 and full.resumed_from is None
    ck = tmp_path / "resumed"
    if how == "stop":
        part = _train(tiny_target_info, items, ck, stop=StopAfter(5))
        assert part.interrupted and part.step == 5 and len(part.history) == 5
        at = 5
    else:  # batch_seqs 1: read n is step n; the last checkpoint before step 5 is step 3's
        with pytest.raises(RuntimeError, match="killed"):
            _train(tiny_target_info, items, ck, train_src=CrashAt(items[:6], 5))
        at = 3
    assert (ck / "latest").read_text().strip() == f"step-{at:08d}.pt"
    saved = torch.load(ck / f"step-{at:08d}.pt", weights_only=True)
    assert saved["step"] == at and saved["optimizer"]["state"][0]["step"].item() == at
    best_then = max((e for e in full.evals if e["step"] <= at), key=lambda e: e["val_mtp_sim_tau"])
    assert saved["best"] == best_then and saved["best_model"] is not None
    assert {"model", "scheduler", "rng", "history", "evals", "resume_key"} <= set(saved)
    rest = _train(tiny_target_info, items, ck)
    assert rest.resumed_from == at and rest.step == 8 and not rest.interrupted
    _same(full, rest)
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000006.pt", "step-00000008.pt"]  # keep_checkpoints
    again = _train(tiny_target_info, items, ck)  # finished: nothing is trained again, the same head comes back
    assert again.resumed_from == 8
    _same(full, again)
    other = _train(tiny_target_info, items, ck, resume_key="other", stop=StopAfter(1))  # another config starts fresh
    assert other.resumed_from is None and other.step == 1


def _worker(rank: int, world: int, info: dict, data_path: str, ckpt: str, out: str) -> None:
    items = torch.load(data_path, weights_only=False)
    res = _train(info, items, Path(ckpt), batch_seqs=1, rank=rank, world=world)
    torch.save({"history": res.history, "evals": res.evals, "best": res.best,
                "weights": {k: v.clone() for k, v in res.selected().items()}}, f"{out}.{rank}")


def test_two_gloo_ranks_of_one_sequence_match_one_process_of_two(tiny_target_info, items, tmp_path):
    single = _train(tiny_target_info, items, None, batch_seqs=2)
    torch.save(items, tmp_path / "items.pt")
    spawn_gloo(_worker, 2, tiny_target_info, str(tmp_path / "items.pt"), str(tmp_path / "ckpt"), str(tmp_path / "out"))
    r0, r1 = (torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1))
    assert len(r0["history"]) == len(single.history) == 8
    for key in ("mtp_loss", "mtp_loss_1", "mtp_loss_2"):
        torch.testing.assert_close(torch.tensor([h[key] for h in r0["history"]]),
                                   torch.tensor([h[key] for h in single.history]), rtol=1e-5, atol=1e-5)
    assert r1["history"] == r0["history"] and r1["evals"] == r0["evals"] and r1["best"] == r0["best"]  # ranks agree
    assert r0["best"]["step"] == single.best["step"] and len({e["val_mtp_sim_tau"] for e in single.evals}) > 1
    for e2, e1 in zip(r0["evals"], single.evals, strict=True):
        assert e2.keys() == e1.keys() and all(e2[k] == pytest.approx(e1[k], abs=1e-6) for k in e1)
    for k, v in single.selected().items():  # rank 0 holds the selected weights
        torch.testing.assert_close(r0["weights"][k], v, rtol=1e-3, atol=2e-4)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000008.pt"  # rank 0 wrote the checkpoints


def _stop_worker(rank: int, world: int, info: dict, data_path: str, root: str, out: str) -> None:
    """Uninterrupted; then rank 1 alone asked to stop in step 4; then the rerun: all in one gloo group."""
    items = torch.load(data_path, weights_only=False)
    full = _train(info, items, Path(root) / "full", rank=rank, world=world)
    part = _train(info, items, Path(root) / "resumed", rank=rank, world=world, stop=StopAfter(4) if rank == 1 else None)
    rest = _train(info, items, Path(root) / "resumed", rank=rank, world=world)

    def dump(r):
        return {"step": r.step, "interrupted": r.interrupted, "resumed_from": r.resumed_from, "history": r.history,
                "evals": r.evals, "best": r.best, "last": r.model.state_dict(), "selected": r.selected()}

    torch.save({"full": dump(full), "part": dump(part), "rest": dump(rest)}, f"{out}.{rank}")


def test_one_ranks_stop_vote_stops_every_rank_and_the_mtp_run_resumes_bit_identically(tiny_target_info, items, tmp_path):
    """The MTP head through the one loop (train/trainer.py), 2 gloo ranks: a stop asked of rank 1 only is summed
    over ranks, so both ranks stop after step 4; rank 0 writes step 4's checkpoint (not a ckpt_every step);
    the rerun resumes there and ends with the uninterrupted run's history, val history, best and weights."""
    torch.save(items, tmp_path / "items.pt")
    spawn_gloo(_stop_worker, 2, tiny_target_info, str(tmp_path / "items.pt"), str(tmp_path), str(tmp_path / "out"))
    r0, r1 = (torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1))
    for r in (r0, r1):
        assert r["part"]["interrupted"] and r["part"]["step"] == 4 and len(r["part"]["history"]) == 4
        assert r["rest"]["resumed_from"] == 4 and r["rest"]["step"] == 8 and not r["rest"]["interrupted"]
        assert r["full"]["resumed_from"] is None and r["full"]["step"] == 8
        for key in ("history", "evals", "best"):
            assert r["rest"][key] == r["full"][key], key
        for k, v in r["full"]["last"].items():
            assert torch.equal(r["rest"]["last"][k], v), k
    assert r1["full"]["history"] == r0["full"]["history"]  # ranks agree
    assert (tmp_path / "resumed" / "latest").read_text().strip() == "step-00000008.pt"
    saved = torch.load(tmp_path / "resumed" / "step-00000008.pt", weights_only=True)
    assert saved["step"] == 8 and saved["best_model"] is not None and saved["best"] == r0["full"]["best"]
    for k, v in r0["full"]["selected"].items():  # rank 0: the best val τ weights, whether resumed or not
        assert torch.equal(r0["rest"]["selected"][k], v), k
    assert {"lr", "grad_norm", "epoch"} <= set(r0["full"]["history"][0])  # the loop's record, as a drafter's
