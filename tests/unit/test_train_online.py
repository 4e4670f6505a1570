"""Online features (train.features=online) equal the extract stage's offline features, and training on
either gives the same first losses (fp32, CPU, tiny random target); an objective that needs the target's
distribution (acceptance weighting) gets its final-normed last layer online too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from drafter_fixtures import drafter_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter.config import DFlashConfig  # noqa: E402
from draftforge.extract.stage import run_extract  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.features import open_features  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.loop import TrainInputs, train  # noqa: E402
from draftforge.train.online import open_online  # noqa: E402
from extract_fixtures import EXPERIMENT, context, make_experiment  # noqa: E402

LENGTHS = {"train": [[40, 33, 64, 21, 52], [28, 47, 36]], "val": [[30, 44]]}


@pytest.fixture(scope="module")
def world(tiny_target_info, tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    make_experiment(root, tiny_target_info, LENGTHS, seed=4)
    ctx = context(root)
    run_extract(ctx)
    offline = open_features(ctx.input_dir("extract"), tiny_target_info, dtype=torch.float32)
    online = open_online(root / EXPERIMENT / "curate", tiny_target_info, ctx.cfg.extract, torch.device("cpu"), torch.float32)
    return offline, online


def test_online_features_equal_offline(world):
    (off_train, off_val), (on_train, on_val, _) = world
    for off, on in ((off_train, on_train), (off_val, on_val)):
        assert len(off) == len(on) > 0
        for i in range(len(off)):
            ids_a, mask_a, h_a = off[i]
            ids_b, mask_b, h_b = on[i]
            assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b)
            assert h_b.dtype == torch.float32 and h_b.shape == h_a.shape
            torch.testing.assert_close(h_b, h_a, rtol=1e-5, atol=1e-5)


def test_first_losses_equal_online_and_offline(tiny_target_info, world, tmp_path):
    (off_train, off_val), (on_train, on_val, _) = world
    cfg = TrainConfig(max_steps=5, batch_seqs=2, num_anchors=8, lr=3e-3, eval_every=5, ckpt_every=100, log_every=100,
                      val_max_seqs=2, val_num_anchors=8, init_from_target=False, prefetch=1)
    curves = []
    for name, tr, va in (("offline", off_train, off_val), ("online", on_train, on_val)):
        inp = TrainInputs(cfg=cfg, dcfg=DFlashConfig.from_target(tiny_target_info, drafter_of()), train_source=tr, val_source=va,
                          head=FrozenTargetHead.from_target(tiny_target_info["hf_path"]), ckpt_dir=tmp_path / name, resume_key=name)
        res = train(inp)
        curves.append(([h["loss"] for h in res.history], res.evals[-1]))
    (loss_off, eval_off), (loss_on, eval_on) = curves
    assert len(loss_off) == len(loss_on) == 5
    torch.testing.assert_close(torch.tensor(loss_on), torch.tensor(loss_off), rtol=0, atol=1e-5)
    assert eval_on["val_loss"] == pytest.approx(eval_off["val_loss"], abs=1e-5)
    assert eval_on["val_sim_tau"] == pytest.approx(eval_off["val_sim_tau"])


def test_stage_trains_online_without_a_feature_store(tiny_target_info, tmp_path):
    import json

    from draftforge.cli import make_context
    from draftforge.train.stage import main

    make_experiment(tmp_path, tiny_target_info, LENGTHS, seed=4, chat_template_kwargs={"enable_thinking": False})
    from extract_fixtures import overrides

    ctx = make_context("train", overrides(tmp_path, "train.features=online", "train.max_steps=3", "train.num_anchors=8",
                                          "train.eval_every=3", "train.val_max_seqs=2", "train.val_num_anchors=8"))
    ctx.out_dir.mkdir(parents=True)
    ctx.work_dir.mkdir(parents=True)
    main(ctx)
    metrics = json.loads((ctx.out_dir / "metrics.json").read_text())
    assert metrics["features"] == "online" and metrics["steps"] == 3 and metrics["loss_gamma"] == 4.0  # B = 8
    assert not (tmp_path / EXPERIMENT / "extract").exists()
    # the chat mode of the data it trained on (curate's record), for evaluate / baselines to check
    exported = json.loads((ctx.out_dir / "drafter" / "config.json").read_text())["draftforge"]
    assert metrics["chat_template_kwargs"] == exported["chat_template_kwargs"] == {"enable_thinking": False}


def test_online_last_layer_is_the_final_norm_output(tiny_target_info, tmp_path):
    from draftforge.target.load import load_target_model

    make_experiment(tmp_path, tiny_target_info, LENGTHS, seed=4)
    ctx = context(tmp_path)
    train_src, _, _ = open_online(tmp_path / EXPERIMENT / "curate", tiny_target_info, ctx.cfg.extract, torch.device("cpu"),
                                  torch.float32, last=True)  # fmt: skip
    ids, _, hidden, last = train_src[0]
    model = load_target_model(tiny_target_info, dtype=torch.float32, device="cpu")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed
    assert last.shape == (ids.shape[0], ref.shape[-1]) and hidden.shape[0] == ids.shape[0]
    torch.testing.assert_close(last, ref, rtol=1e-5, atol=1e-5)


def test_stage_trains_acceptance_weighted_online(tiny_target_info, tmp_path):
    import json

    from draftforge.cli import make_context
    from draftforge.train.stage import main
    from extract_fixtures import overrides

    make_experiment(tmp_path, tiny_target_info, LENGTHS, seed=4)
    ctx = make_context("train", overrides(tmp_path, "drafter=dflash_aw", "drafter.draft_vocab_size=0", "train.features=online",
                                          "train.max_steps=3", "train.num_anchors=8", "train.eval_every=3",
                                          "train.val_max_seqs=2", "train.val_num_anchors=8"))  # fmt: skip
    ctx.out_dir.mkdir(parents=True)
    ctx.work_dir.mkdir(parents=True)
    main(ctx)
    metrics = json.loads((ctx.out_dir / "metrics.json").read_text())
    assert metrics["features"] == "online" and metrics["steps"] == 3 and metrics["best"]["val_sim_tau"] >= 1.0
