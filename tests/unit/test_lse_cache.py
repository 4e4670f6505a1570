"""The target-normaliser cache of the distribution objective with a draft vocabulary (train/lse_cache.py): its
values are the objective's, each position is computed once over all epochs, training with it follows training
without it, and a position the source does not supervise is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drafter_fixtures import drafter_of
from draftforge.drafter.config import DFlashConfig
from draftforge.train.config import TrainConfig
from draftforge.train.data import InMemorySource
from draftforge.train.dspark_loss import target_lse
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import BlockTask, draft_vocab_for, loop_spec, total_steps
from draftforge.train.lse_cache import TargetLseCache
from draftforge.train.trainer import run
from train_fixtures import make_inputs, synthetic_items, with_last

EPOCHS = 3


@pytest.fixture(scope="module")
def items(tiny_target_info):
    return with_last(tiny_target_info, synthetic_items(tiny_target_info, 4, seed=11))


def _supervised_next(items) -> int:
    return sum(int((it[1][1:] > 0).sum()) for it in items)


def test_values_are_the_objectives_normaliser_and_each_is_computed_once(tiny_target_info, items):
    head = FrozenTargetHead.from_target(tiny_target_info["hf_path"])
    cache = TargetLseCache(head.lm_head, InMemorySource(items), 1024, torch.float32)
    width = max(it[0].numel() for it in items)
    seq_ids = torch.tensor([2, 0])
    # positions 5.. are followed by a supervised token (prompt_len 6): rows at 5, 9, 17 of batch sequence 0, 8 of 1
    distinct = torch.tensor([5, 9, 17, width + 8])
    got = cache.lookup(seq_ids, distinct, width, torch.float32)
    ht = torch.stack([items[2][3][5], items[2][3][9], items[2][3][17], items[0][3][8]])
    torch.testing.assert_close(got, target_lse(ht, head.lm_head), rtol=1e-6, atol=1e-6)
    assert cache.computed == _supervised_next([items[2], items[0]])  # every supervised position of both, once
    again = cache.lookup(seq_ids, distinct, width, torch.float32)
    assert torch.equal(again, got) and cache.computed == _supervised_next([items[2], items[0]])
    with pytest.raises(ValueError, match="sequence 2: a row at a position whose next token is not supervised"):
        cache.lookup(seq_ids, torch.tensor([3]), width, torch.float32)  # inside the prompt


class _Recomputed(InMemorySource):
    """The same items, declared as computed on access: no cache."""

    stored_features = False


def _task(info, items, source_cls, ckpt_dir):
    dcfg = dataclasses.replace(DFlashConfig.from_target(info, drafter_of()), draft_vocab_size=64)
    steps = EPOCHS * len(items) // 2
    cfg = TrainConfig(max_steps=steps, batch_seqs=2, num_anchors=6, lr=3e-3, eval_every=100, ckpt_every=100,
                      log_every=100, val_max_seqs=2, val_num_anchors=6, prefetch=1)  # fmt: skip
    inp = make_inputs(info, cfg, items, items[:2], ckpt_dir)
    inp.dcfg, inp.train_source, inp.acceptance_weighting = dcfg, source_cls(items), True
    inp.draft_ids = draft_vocab_for(inp.train_source, dcfg)[0]
    assert total_steps(cfg, len(items))[1] == steps
    task = BlockTask(inp)
    return task, run(task, loop_spec(inp, steps))


def test_training_with_the_cache_follows_training_without_it(tiny_target_info, items, tmp_path):
    cached, with_cache = _task(tiny_target_info, items, InMemorySource, tmp_path / "cached")
    plain, without = _task(tiny_target_info, items, _Recomputed, tmp_path / "plain")
    assert plain.lse_cache is None and cached.lse_cache is not None
    # over 3 epochs each supervised position is computed at most once and read back after
    assert 0 < cached.lse_cache.computed <= _supervised_next(items) < cached.lse_cache.reads
    torch.testing.assert_close(torch.tensor([h["loss"] for h in with_cache.history]),
                               torch.tensor([h["loss"] for h in without.history]), rtol=1e-5, atol=1e-6)  # fmt: skip
    for k, v in without.model.state_dict().items():
        torch.testing.assert_close(with_cache.model.state_dict()[k], v, rtol=1e-4, atol=1e-5)
