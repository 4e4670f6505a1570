"""report: the headline speedup is the auto (calibrated) budget's, split into τ and round cost, the oracle beside it."""

from __future__ import annotations

import pytest

from draftforge.report.headline import headline_lines, round_cost_steps
from draftforge.report.rows import budget_choices, vs_mtp


def _row(method, tps, budget=None, tau=1.0, auto=False, best=False, engine="draftforge", drafter="dflash", dataset="humaneval"):
    return {"dataset": dataset, "engine": engine, "drafter": drafter, "method": method, "budget": budget, "temperature": 0.0,
            "tokens_per_s": tps, "tau": tau, "speedup_vs_ar": tps / 10, "status": "ok", "auto_budget": auto, "best_budget": best}


def _rows():
    return [_row("ar", 10.0), _row("dflash", 8.0, tau=1.2),
            _row("ddtree", 12.0, 8, tau=1.5, auto=True), _row("ddtree", 15.0, 16, tau=2.0, best=True),
            _row("ddtree", 9.0, 64, tau=2.4), _row("mtp", 6.0, tau=1.3, drafter="mtp"),
            _row("dflash", 9.0, tau=1.2, engine="vllm")]


def test_round_cost_is_tau_over_speedup():
    assert round_cost_steps(_row("ddtree", 12.0, 8, tau=1.5)) == pytest.approx(1.25)
    assert round_cost_steps({"tau": 1.5, "speedup_vs_ar": None}) != round_cost_steps({"tau": 1.5, "speedup_vs_ar": None})  # nan


def test_headline_reads_the_auto_budget_and_shows_the_oracle_beside_it():
    rows = _rows()
    text = "\n".join(headline_lines(rows, budget_choices(rows)))
    tree = next(line for line in text.splitlines() if "`ddtree`" in line)
    assert "**1.20×** @8 (τ 1.50 ÷ round 1.25 AR)" in tree  # the calibrated budget, not the oracle's 1.50×
    assert "oracle 1.50× @16" in tree
    chain = next(line for line in text.splitlines() if "dflash / `dflash`" in line and line.startswith("| draftforge"))
    assert "**0.80×** (τ 1.20 ÷ round 1.50 AR)" in chain and "oracle" not in chain
    assert any(line.startswith("| vllm") for line in text.splitlines())


def test_headline_says_when_a_tree_has_no_auto_budget():
    rows = [{**r, "auto_budget": False} for r in _rows()]
    tree = next(line for line in headline_lines(rows, budget_choices(rows)) if "`ddtree`" in line)
    assert "no auto budget; oracle 1.50× @16" in tree


def test_vs_mtp_compares_the_calibrated_tree_not_the_oracle():
    rows = _rows()
    assert vs_mtp(rows)["humaneval"]["ddtree_tokens_per_s"] == 12.0  # auto @8, not the oracle's 15.0 @16
    unflagged = [{**r, "auto_budget": False} for r in rows]  # no calibration: the fastest tree, as before
    assert vs_mtp(unflagged)["humaneval"]["ddtree_tokens_per_s"] == 15.0


def test_position_acceptance_from_the_engine_histogram_and_from_vllm_counters() -> None:
    from draftforge.report.plots import position_acceptance

    # tokens committed per round 1, 1, 2, 4 → accepted drafts 0, 0, 1, 3: τ = 2
    engine = {"method": "dflash", "tau_histogram": {"1": 2, "2": 1, "4": 1}, "tau": 2.0}
    per_pos = position_acceptance(engine)
    assert per_pos == [0.5, 0.25, 0.25]
    assert sum(per_pos) == engine["tau"] - 1  # a round's accepted drafts = Σ_k 1[draft k accepted]
    vllm = {"method": "ngram", "acceptance_per_pos": [0.6, 0.3], "tau_histogram": None}
    assert position_acceptance(vllm) == [0.6, 0.3]  # vLLM's own counters, the same definition
    assert position_acceptance({"method": "dflash", "tau_histogram": {"1": 5}}) == [0.0]  # no draft ever accepted
    assert position_acceptance({"method": "ar"}) == []
