"""Train stage units: anchors, collation, decayed loss, acceptance metrics, the loop, feature source."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.errors import StageError  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.data import anchor_candidates, collate, draw_anchors, epoch_order, rank_share  # noqa: E402
from draftforge.train.loop import lr_lambda, train, val_indices  # noqa: E402
from draftforge.train.loss import BlockOutputs, block_losses, slot_stats, slot_weights, summarize  # noqa: E402
from train_fixtures import make_inputs, synthetic_items, write_extract_index  # noqa: E402


@pytest.fixture(scope="module")
def items(tiny_target_info):
    return synthetic_items(tiny_target_info, 8, seed=0)


def test_slot_weights_decay_and_slot0_excluded():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[8], torch.tensor(math.exp(-1.0)))
    assert torch.all(w[2:] < w[1:-1])


def test_loss_is_weighted_ce_normalized_by_valid_weights():
    torch.manual_seed(0)
    S, N, Bk, H, V = 1, 2, 4, 8, 11
    h = torch.randn(S, N * Bk, H)
    head = torch.randn(V, H)
    targets = torch.randint(0, V, (S, N, Bk))
    valid = torch.tensor([[[False, True, True, False], [False, True, False, False]]])
    w = slot_weights(Bk, 2.0)
    out = block_losses(h, head, targets, valid, w, chunk=2)
    logits = (h.view(S, N, Bk, H) @ head.t())
    ce = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(S, N, Bk)
    wk = w.expand(S, N, Bk) * valid
    torch.testing.assert_close(out.weighted_ce_sum / out.weight_sum, (wk * ce).sum() / wk.sum())
    torch.testing.assert_close(out.weight_sum, wk.sum())


def test_simulated_acceptance_and_per_slot_accuracy():
    correct = torch.tensor([[[True, True, True, False], [False, True, False, True], [False, False, False, False]]])
    valid = torch.tensor([[[False, True, True, True], [False, True, True, True], [False, False, False, False]]])
    out = BlockOutputs(torch.tensor(0.0), torch.tensor(1.0), correct & valid, valid)
    m = summarize(slot_stats(out, valid[..., 1]), 4)
    assert m["sim_tau"] == pytest.approx(1 + (2 + 1) / 2)  # prefixes: 2 and 1 over 2 real blocks
    assert m["acc_slot_1"] == 1.0 and m["acc_slot_2"] == 0.5 and m["acc_slot_3"] == 0.5


def test_anchors_supervised_fresh_per_epoch_and_deterministic():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.uint8)
    cand = anchor_candidates(mask)
    assert cand.tolist() == [2, 3, 6, 7, 8]  # anchor and next token supervised
    a0 = draw_anchors(torch.ones(200, dtype=torch.uint8), 16, seed=0, epoch=0, seq_idx=5)
    a1 = draw_anchors(torch.ones(200, dtype=torch.uint8), 16, seed=0, epoch=1, seq_idx=5)
    assert a0.numel() == 16 and not torch.equal(a0, a1)
    assert torch.equal(a0, draw_anchors(torch.ones(200, dtype=torch.uint8), 16, seed=0, epoch=0, seq_idx=5))
    assert torch.all(a0[1:] > a0[:-1])


def test_epoch_order_covers_all_and_ranks_split_each_step():
    steps = epoch_order(10, 4, seed=0, epoch=0)
    assert len(steps) == 3 and all(len(s) == 4 for s in steps)
    assert set(sum(steps, [])) == set(range(10))
    shares = [rank_share(steps[0], r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(steps[0])


def test_collate_targets_and_validity():
    ids = torch.arange(10, 20)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.uint8)
    hidden = torch.randn(10, 6)
    batch = collate([(ids, mask, hidden)], [torch.tensor([2, 8])], block_size=4, mask_token_id=3)
    assert batch.block_ids.tolist() == [[12, 3, 3, 3, 18, 3, 3, 3]]
    assert batch.targets[0, 0].tolist() == [12, 13, 14, 15]
    assert batch.valid[0, 0].tolist() == [False, True, True, True]
    assert batch.valid[0, 1].tolist() == [False, True, False, False]  # position 10, 11 beyond the end


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(100, 0.04, 0.0)
    assert f(0) == pytest.approx(0.25) and f(3) == pytest.approx(1.0)
    assert f(52) == pytest.approx(0.5, abs=0.02) and f(99) < 0.01


def test_val_subset_spreads_over_the_length_sorted_split():
    assert val_indices(64, 24) == [i * 64 // 24 for i in range(24)]
    picked = val_indices(64, 24)
    assert picked[0] == 0 and picked[-1] >= 60 and len(set(picked)) == 24  # not the 24 longest (a prefix)
    assert val_indices(5, 24) == [0, 1, 2, 3, 4] and val_indices(0, 24) == [] and val_indices(10, 0) == []


def test_loop_learns_and_tracks_best(tiny_target_info, items, tmp_path):
    cfg = TrainConfig(max_steps=24, batch_seqs=2, num_anchors=8, lr=3e-3, eval_every=8, ckpt_every=8, log_every=4,
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False)
    res = train(make_inputs(tiny_target_info, cfg, items[:6], items[:2], tmp_path))
    losses = [h["loss"] for h in res.history]
    assert len(losses) == 24 and res.step == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5
    assert [e["step"] for e in res.evals] == [8, 16, 24]
    assert res.best["val_sim_tau"] == max(e["val_sim_tau"] for e in res.evals)
    assert (tmp_path / "best.pt").is_file() and (tmp_path / "latest").is_file()


def test_sharded_source_reads_what_was_written_and_refuses_other_targets(tiny_target_info, items, tmp_path):
    from draftforge.train.features import open_features

    info = tiny_target_info
    d = write_extract_index(tmp_path / "extract", {"train": items[:5], "val": items[5:]}, info)
    train_src, val_src = open_features(d, info, dtype=torch.float32)
    assert len(train_src) == 5 and len(val_src) == 3
    for i in (4, 0, 2):
        ids, mask, hidden = train_src[i]
        assert torch.equal(ids, items[i][0]) and torch.equal(mask, items[i][1])
        torch.testing.assert_close(hidden, items[i][2])
    bad = write_extract_index(tmp_path / "other", {"train": items[:2]}, info, fingerprint="f" * 64)
    with pytest.raises(StageError, match="target"):
        open_features(bad, info)
    taps = write_extract_index(tmp_path / "taps", {"train": items[:2]}, info, taps=[0, 1])
    with pytest.raises(StageError, match="tapped layers"):
        open_features(taps, info)
