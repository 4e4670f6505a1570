"""report over drafter branches: rows from every branch's markers, per-branch best tree and parity, the drafter column."""

from __future__ import annotations

import csv
import io

from draftforge.io import write_json
from draftforge.report.parity import parity_block
from draftforge.report.rows import best_ddtree, collect_rows
from draftforge.report.stage import summary_csv


def _row(engine, drafter, method, tps, tau, budget=None):
    return {"dataset": "chitchat", "engine": engine, "drafter": drafter, "method": method, "budget": budget,
            "temperature": 0.0, "tokens_per_s": tps, "tau": tau, "status": "ok"}


def test_rows_of_every_branch_best_tree_and_parity_per_branch(tmp_path):
    branches = {
        "dflash": ([_row("draftforge", "dflash", "ar", 10, 1.0), _row("draftforge", "dflash", "dflash", 12, 2.0),
                    _row("draftforge", "dflash", "ddtree", 14, 2.5, 8), _row("draftforge", "dflash", "ddtree", 13, 2.9, 16)],
                   [_row("vllm", "dflash", "dflash", 20, 2.04)]),
        "dspark": ([_row("draftforge", "dspark", "ar", 9, 1.0), _row("draftforge", "dspark", "dspark", 12, 2.4),
                    _row("draftforge", "dspark", "ddtree", 13, 2.6, 8), _row("draftforge", "dspark", "ddtree_markov", 16, 3.1, 8)],
                   [_row("vllm", "dspark", "dspark", 18, 3.0)]),
    }
    ev, bl = [], []
    for name, (ours, theirs) in branches.items():
        ev.append(tmp_path / "evaluate" / name / "evaluate.json")
        bl.append(tmp_path / "baselines" / name / "baselines.json")
        write_json(ev[-1], {"rows": ours})
        write_json(bl[-1], {"rows": theirs})
    rows = collect_rows(ev, bl)
    assert len(rows) == 10 and [r["drafter"] for r in rows[:4]] == ["dflash"] * 4  # sorted by engine, then branch
    assert best_ddtree(rows, ("ddtree",), drafter="dflash")["chitchat"]["budget"] == 8  # highest tokens/s, not τ
    assert best_ddtree(rows)["chitchat"]["method"] == "ddtree_markov"  # any branch, either tree method
    dflash = parity_block(rows, 0.05, method="dflash", drafter="dflash")["datasets"]["chitchat"]
    dspark = parity_block(rows, 0.05, method="dspark", drafter="dspark")["datasets"]["chitchat"]
    assert dflash["within_tolerance"] and abs(dflash["rel_diff"] - 0.02) < 1e-9
    assert not dspark["within_tolerance"] and abs(dspark["rel_diff"] - 0.25) < 1e-9
    table = list(csv.DictReader(io.StringIO(summary_csv(rows))))
    assert {(r["drafter"], r["method"]) for r in table if r["engine"] == "vllm"} == {("dflash", "dflash"), ("dspark", "dspark")}
