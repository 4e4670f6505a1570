"""On-policy replay (train/replay.py, docs/architecture.md "On-policy replay"): the chain walk, its parity with the
engine's T = 0 DFlash decode, the anchors before / after the replay step, resume across it, several ranks."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.errors import ConfigError  # noqa: E402
from draftforge.extract.capture import TapCapture  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.data import anchor_candidates, draw_anchors  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.loop import BlockTask, forward_batch, loop_spec, total_steps, train  # noqa: E402
from draftforge.train.loss import slot_weights  # noqa: E402
from draftforge.train.replay import ReplayTable, accepted_lengths, draw_replay_anchors, walk_chain  # noqa: E402
from draftforge.train.trainer import run  # noqa: E402
from engine_fixtures import one_thread, prompt, tiny_drafter, tiny_dspark_drafter, tiny_target  # noqa: E402, F401  (one_thread: autouse)
from train_fixtures import StopAfter, make_inputs, spawn_gloo, synthetic_items  # noqa: E402


def test_walk_chain_follows_accepted_lengths():
    cand = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13])
    acc = torch.tensor([2, 9, 9, 0, 3, 9, 9, 9, 1])  # only the visited entries matter
    w = walk_chain(cand, acc, 3)
    assert w.starts.tolist() == [5, 8, 9, 13]  # 5 + 2 + 1, 8 + 0 + 1, 9 + 3 + 1
    assert w.accepted.tolist() == [2, 0, 3, 1]
    assert w.rejected.tolist() == [5, 8, 13]  # 9 accepted all 3 drafts
    # the walk ends at the first position that is no candidate (end of the supervised span, or a hole in it)
    w = walk_chain(torch.tensor([2, 3, 4, 9, 10]), torch.tensor([1, 5, 0, 0, 0]), 4)
    assert w.starts.tolist() == [2, 4] and w.rejected.tolist() == [2, 4]
    # per-candidate room: a block the row can check only partly is no rejection when all it can check is right
    w = walk_chain(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 1]), torch.tensor([3, 3, 2, 1]))
    assert w.starts.tolist() == [0, 1, 2] and w.rejected.tolist() == [0, 1, 2]
    w = walk_chain(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 0, 1]), torch.tensor([3, 2, 2, 1]))
    assert w.starts.tolist() == [0, 1] and w.rejected.tolist() == [0]
    assert walk_chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 3).starts.numel() == 0


@pytest.mark.parametrize("arch,vocab,block,seed,kind", [("LlamaForCausalLM", 8, 8, 4, "dflash"),
                                                        ("Qwen3ForCausalLM", 8, 6, 1, "dflash"),
                                                        ("LlamaForCausalLM", 96, 6, 0, "dflash"),
                                                        ("LlamaForCausalLM", 8, 6, 4, "dspark"),
                                                        ("LlamaForCausalLM", 8, 6, 4, "dspark_bonus_anchor")])
def test_walk_equals_the_engines_greedy_chain_rounds(arch, vocab, block, seed, kind):
    """A training row made as curate + extract make one (the target's greedy answer, its tapped features) walked
    with the drafter's teacher-forced blocks gives the engine's T = 0 chain rounds exactly (fp32, CPU): DFlash, and
    DSpark (Markov bias, both block conventions) through the objective's hits."""
    from draftforge.engine import generate, generate_ar, make_method
    from draftforge.train.loop import Objective

    tm = tiny_target(arch, vocab=vocab, seed=seed)
    if kind == "dflash":
        drafter, method, obj = tiny_drafter(tm, seed=seed, block=block), "dflash", None
    else:
        drafter = tiny_dspark_drafter(tm, seed=seed, block=block, bonus_anchor=kind.endswith("bonus_anchor"))
        method, obj = "dspark", Objective({"ce": 1.0})  # the Markov bias from the data token before each slot
    p = prompt(vocab, 6, seed=seed)
    n_new = 40
    answer = generate_ar(tm, p, n_new + 2 * block).tokens  # long enough that every round's block fits in the row
    ids = torch.tensor(p + answer)  # (T,)
    mask = torch.zeros(ids.numel(), dtype=torch.uint8)
    mask[len(p):] = 1
    hidden = TapCapture(tm.hf, list(tm.tap_ids)).run(ids[None], torch.ones(1, ids.numel(), dtype=torch.long)).clone()
    head = FrozenTargetHead(tm.embed.weight.detach().clone(), tm.lm_head.weight.detach().clone())
    cfg = drafter.cfg
    n_draft = cfg.block_size - cfg.first_slot
    weights = slot_weights(cfg.block_size, None, cfg.first_slot)

    def score(batch):
        return forward_batch(drafter, head, batch, weights, "sdpa", obj)

    a = accepted_lengths(score, (ids, mask, hidden), cfg.block_size, cfg.mask_token_id, cfg.first_slot, cfg.pred_offset,
                         chunk=16)  # several chunks
    walk = walk_chain(a.candidates, a.acc, a.room)
    eng = generate(tm, make_method(method, tm, drafter), p, n_new)
    assert eng.tokens == answer[:n_new]  # lossless: the row's answer is what the engine commits
    taus = eng.accept_lengths
    starts = (len(p) + torch.tensor([0, *taus[:-1]]).cumsum(0)).tolist()
    n = len(taus)
    assert walk.starts[:n].tolist() == starts
    assert walk.accepted[:n].tolist() == [t - 1 for t in taus]
    assert walk.rejected[walk.rejected <= starts[-1]].tolist() == [s for s, t in zip(starts, taus) if t - 1 < n_draft]
    assert max(taus) >= 2 or vocab > 8  # the small vocabulary accepts drafts: the walk's steps are not all 1


def test_replay_draw_mixes_rejections_and_uniform_without_duplicates():
    mask = torch.ones(100, dtype=torch.uint8)
    mask[:10] = 0
    rejected = torch.tensor([12, 20, 33, 47, 51, 60, 61, 62, 90])
    a = draw_replay_anchors(mask, rejected, 16, 0.5, seed=0, epoch=1, seq_idx=3)
    assert a.numel() == 16 and torch.unique(a).numel() == 16 and torch.all(a[1:] > a[:-1])
    assert torch.isin(a, anchor_candidates(mask)).all()
    assert int(torch.isin(a, rejected).sum()) >= 8
    assert torch.equal(a, draw_replay_anchors(mask, rejected, 16, 0.5, seed=0, epoch=1, seq_idx=3))
    assert not torch.equal(a, draw_replay_anchors(mask, rejected, 16, 0.5, seed=0, epoch=2, seq_idx=3))
    all_rej = draw_replay_anchors(mask, rejected, 16, 1.0, seed=0, epoch=1, seq_idx=3)
    assert torch.isin(rejected, all_rej).all()  # share 1: every rejection (9 < 16), the rest uniform
    for rej in (None, torch.zeros(0, dtype=torch.long)):  # not walked / nothing rejected: today's draw
        assert torch.equal(draw_replay_anchors(mask, rej, 16, 0.5, 0, 1, 3), draw_anchors(mask, 16, 0, 1, 3))


@pytest.mark.parametrize("field,value", [("replay_from", 1.0), ("replay_from", -0.1), ("replay_share", 1.5),
                                         ("replay_rows", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"train\.{field}"):
        TrainConfig(**{field: value})


@pytest.fixture(scope="module")
def items(tiny_target_info):
    return synthetic_items(tiny_target_info, 8, seed=5, min_len=40, max_len=64)


def cfg_for(**kw) -> TrainConfig:
    base = dict(max_steps=10, batch_seqs=2, num_anchors=6, lr=3e-3, eval_every=5, ckpt_every=3, log_every=100,
                val_max_seqs=2, val_num_anchors=6, init_from_target=False, prefetch=2, replay_rows=6)
    return TrainConfig(**{**base, **kw})


def recorded_run(info, cfg, items, ckpt: Path):
    """Train through the loop, recording each batch's anchors and whether the replay table existed when it was built."""
    inp = make_inputs(info, cfg, items, items[:2], ckpt)
    task = BlockTask(inp)
    seen: dict[int, tuple[torch.Tensor, bool]] = {}
    build = task.batch

    def batch(seqs, step, epoch):
        out = build(seqs, step, epoch)
        seen[step] = (out.anchors.clone(), task.replay is not None)
        return out

    task.batch = batch  # type: ignore[method-assign]
    res = run(task, loop_spec(inp, total_steps(cfg, len(items))[1]))
    return res, task, seen


def test_replay_changes_anchors_only_from_its_step(tiny_target_info, items, tmp_path):
    cfg = cfg_for(replay_from=0.5)
    on, task, seen_on = recorded_run(tiny_target_info, cfg, items, tmp_path / "on")
    off, _, seen_off = recorded_run(tiny_target_info, replace(cfg, replay_from=0.0), items, tmp_path / "off")
    assert task.replay_at == 5 and [p["step"] for p in on.phases] == [5]
    rec = on.phases[0]
    assert rec["replay_rows"] == 6 and rec["replay_rounds"] >= 6 and rec["replay_walk_s"] > 0
    assert rec["replay_rejections"] == task.replay.positions.numel() > 0 and rec["replay_walk_tau"] >= 1
    assert all(built == (step >= 5) for step, (_, built) in seen_on.items())  # no batch of step >= 5 prefetched early
    for step in range(5):
        assert torch.equal(seen_on[step][0], seen_off[step][0])
        assert on.history[step]["loss"] == off.history[step]["loss"]
    assert any(not torch.equal(seen_on[s][0], seen_off[s][0]) for s in range(5, 10))
    assert not off.phases


def test_resume_across_the_replay_step_equals_uninterrupted(tiny_target_info, items, tmp_path):
    """Stopped after the table was built (it comes back from the checkpoint) or before (built on reaching the step):
    the same weights, curve and table as one uninterrupted run."""
    cfg = cfg_for(replay_from=0.5)
    full = train(make_inputs(tiny_target_info, cfg, items, items[:2], tmp_path / "full"))
    table = torch.load(tmp_path / "full" / "step-00000009.pt", weights_only=True)["replay"]
    for stop in (7, 5, 3):  # after the table, right at its step (not built yet), before it
        ckpt = tmp_path / f"stop{stop}"
        inp = make_inputs(tiny_target_info, cfg, items, items[:2], ckpt)
        inp.stop = StopAfter(stop)
        part = train(inp)
        assert part.interrupted and part.step == stop and len(part.phases) == (stop > 5)
        rest = train(make_inputs(tiny_target_info, cfg, items, items[:2], ckpt))
        assert rest.step == 10 and [p["step"] for p in rest.phases] == [5]
        assert [h["loss"] for h in rest.history] == [h["loss"] for h in full.history]
        for k, v in full.model.state_dict().items():
            assert torch.equal(rest.model.state_dict()[k], v), (stop, k)
        again = torch.load(ckpt / "step-00000009.pt", weights_only=True)["replay"]
        for k in ("rows", "offsets", "positions"):
            assert torch.equal(again[k], table[k]), (stop, k)


def _table_worker(rank: int, world: int, info: dict, data_path: str, out_path: str) -> None:
    items = torch.load(data_path, weights_only=False)
    task = BlockTask(make_inputs(info, cfg_for(replay_from=0.5, replay_rows=5), items, None, Path(out_path).parent,
                                 rank=rank, world=world))
    task.enter_phase(5)
    torch.save(task.replay.state(), f"{out_path}.{rank}")


def test_ranks_build_the_one_process_table(tiny_target_info, items, tmp_path):
    """Each of 2 gloo ranks walks its share of the rows; both end with the table one process builds."""
    torch.save(items, tmp_path / "items.pt")
    spawn_gloo(_table_worker, 2, tiny_target_info, str(tmp_path / "items.pt"), str(tmp_path / "table"))
    one = BlockTask(make_inputs(tiny_target_info, cfg_for(replay_from=0.5, replay_rows=5), items, None, tmp_path))
    one.enter_phase(5)
    ref = one.replay.state()
    assert ref["rows"].numel() == 5 and ref["positions"].numel() > 0
    for rank in range(2):
        got = ReplayTable.from_state(torch.load(f"{tmp_path / 'table'}.{rank}", weights_only=True))
        for k in ("rows", "offsets", "positions"):
            assert torch.equal(getattr(got, k), ref[k]), (rank, k)
        for k in ("replay_rows", "replay_rounds", "replay_rejections", "replay_walk_tau"):
            assert got.metrics[k] == ref["metrics"][k], (rank, k)
