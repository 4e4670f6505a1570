"""Curate and evaluate apply the same hold-out rules: a change planted in `draftforge.holdout` moves both."""

from __future__ import annotations

import pytest

from draftforge import holdout
from draftforge.curate.config import SourceConfig
from draftforge.curate.packaged import iter_chitchat, iter_gsm_symbolic
from draftforge.curate.schema import Drop, Row
from draftforge.errors import StageError
from draftforge.evaluate.config import EvaluateConfig
from draftforge.evaluate.prompts import chitchat_prompts, gsm_symbolic_prompts


def test_planted_chitchat_rule_is_seen_by_curate_and_evaluate(monkeypatch: pytest.MonkeyPatch) -> None:
    ev = EvaluateConfig(datasets=["chitchat"])
    src = SourceConfig(name="chitchat", kind="chitchat")
    every_id = [item.id.split(":", 1)[1] for item in iter_chitchat(src, 1, ev) if isinstance(item, Row)]
    planted = set(sorted(every_id)[:5])
    monkeypatch.setattr(holdout, "chitchat_is_heldout", lambda conv_id, per_10k: conv_id in planted)

    items = list(iter_chitchat(src, 1, ev))
    dropped = [i for i in items if isinstance(i, Drop) and i.reason == "eval_holdout"]
    kept = {i.id.split(":", 1)[1] for i in items if isinstance(i, Row)}
    assert len(dropped) == len(planted) and not kept & planted  # curate drops exactly the planted ids
    prompts = chitchat_prompts(ev)
    assert 0 < len(prompts) <= len(planted)  # evaluate draws only from them


def test_planted_gsm_range_is_seen_by_curate_and_evaluate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holdout, "gsm_symbolic_seed_range", lambda ev: range(5, 8))
    ev = EvaluateConfig(datasets=["gsm_symbolic"])
    with pytest.raises(StageError, match=r"overlap the evaluation seeds \[5, 8\)"):
        next(iter_gsm_symbolic(SourceConfig(name="gsm", kind="gsm_symbolic", options={"seed": 0, "size": 10}), 1, ev))
    ours = [p[0]["content"] for p in gsm_symbolic_prompts(ev)]
    monkeypatch.undo()
    theirs = [r.messages[0]["content"] for r in iter_gsm_symbolic(
        SourceConfig(name="gsm", kind="gsm_symbolic", options={"seed": 5, "size": 3}), 1, EvaluateConfig())]  # fmt: skip
    assert len(ours) == 3 and ours == theirs  # evaluate's prompts are the items of seeds 5..7


def test_chitchat_heldout_is_a_deterministic_hash_bucket() -> None:
    ids = [f"conv-{i}" for i in range(20000)]
    held = [i for i in ids if holdout.chitchat_is_heldout(i, 300)]
    assert 0.02 < len(held) / len(ids) < 0.04
    assert not any(holdout.chitchat_is_heldout(i, 0) for i in ids[:100])


def test_gsm_seed_ranges() -> None:
    ev = EvaluateConfig()
    assert holdout.gsm_symbolic_seed_range(ev) == range(ev.gsm_symbolic.seed, ev.gsm_symbolic.seed + ev.gsm_symbolic.size)
    assert holdout.seed_ranges_overlap(range(0, 10), range(9, 12))
    assert not holdout.seed_ranges_overlap(range(0, 10), range(10, 12))


@pytest.mark.parametrize("per_10k", [2500, 40])
def test_curate_holds_out_the_experiment_chitchat_fraction(tmp_path, per_10k: int) -> None:
    """The composed experiment's evaluate.chitchat.holdout_per_10k (not the evaluate section's default) decides
    which chitchat conversations curate's selection drops as eval_holdout: the count equals the hash-bucket count
    computed here from the package's conversation ids. (Sampling ~nothing keeps the run to the hold-out check.)"""
    import hashlib
    import importlib.util
    import json
    from pathlib import Path

    from omegaconf import OmegaConf

    from draftforge.chat import ChatMode
    from draftforge.config import compose
    from draftforge.curate.stage import build_selection, curate_config

    assert per_10k != EvaluateConfig().chitchat.holdout_per_10k
    cfg = compose("smoke", ["target=tiny-random", f"evaluate.chitchat.holdout_per_10k={per_10k}"])
    cfg.curate = OmegaConf.merge(cfg.curate, {
        "sources": [{"name": "chitchat", "kind": "chitchat", "sample": 1e-12, "options": {"max_turns": 3}}],
        "max_rows": None, "decontam": {"enabled": False}, "filters": {"on_empty_source": "warn"},
    })  # fmt: skip
    _, stats = build_selection(tmp_path, cfg, curate_config(cfg), None, "fingerprint", False, ChatMode())
    ids = json.loads((Path(importlib.util.find_spec("chitchat_dataset").origin).parent / "dataset.json").read_text())
    want = sum(int(hashlib.sha256(i.encode()).hexdigest()[:8], 16) % 10000 < per_10k for i in ids)
    assert 0 < want < len(ids)
    src = stats["per_source"]["chitchat"]
    assert src["in"] == len(ids) and src["dropped"]["eval_holdout"] == want, src
