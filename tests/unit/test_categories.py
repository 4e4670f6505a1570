"""Prompt categories: which category each evaluation prompt has, τ and speedup per category in evaluate's rows,
and the report's category table / by_category.csv."""

from __future__ import annotations

import csv
import io
import json

import pytest

from draftforge.evaluate.aggregate import aggregate
from draftforge.evaluate.prompts import (
    category_of,
    file_prompts,
    interleave_by_category,
    mt_bench_path,
    mt_bench_prompts,
)
from draftforge.report.categories import category_csv, category_lines


def test_interleaving_puts_one_prompt_of_each_category_first() -> None:
    items = [([{"role": "user", "content": f"{c}{i}"}], c) for c in "abc" for i in range(3)]
    order = [m[0]["content"] for m, _ in interleave_by_category(items)]
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    assert interleave_by_category([]) == []


def test_mt_bench_categories_align_with_its_prompts() -> None:
    try:
        path = mt_bench_path()
    except Exception as exc:  # the package is a test dependency (scripts/setup.sh): a missing one is a failure
        pytest.fail(str(exc))
    prompts, categories = mt_bench_prompts(), category_of("mt_bench", None)
    assert len(prompts) == len(categories) == 80
    assert len(set(categories[:8])) == 8  # the first n prompts span n categories
    by_text = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        by_text[rec["turns"][0]] = rec["category"]
    assert [by_text[p[0]["content"]] for p in prompts] == categories  # each prompt keeps its own category
    assert category_of("humaneval", None) == "coding" and category_of("gsm_symbolic", None) == "math"


def test_an_mtbench_file_without_categories_keeps_its_order(tmp_path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [f"q{i}", "more"]}) for i in range(3)))
    assert [p[0]["content"] for p in file_prompts("mtbench", path)] == ["q0", "q1", "q2"]


def _rec(method, budget, idx, category, decode_s, accepts, repeat=0):
    n = sum(accepts)
    return {"dataset": "mt", "temperature": 0.0, "prompt_index": idx, "turn": 0, "method": method, "budget": budget,
            "split": "eval", "repeat": repeat, "tokens": list(range(n + 1)), "accept_lengths": list(accepts),
            "n_decode": n, "decode_s": decode_s, "tpot_s": decode_s / n, "ttft_s": 0.1, "draft_prefill_s": 0.0,
            "stage_s": {"draft": [0.1], "build": [0.0], "verify": [0.2], "commit": [0.0]}, "category": category}


def test_rows_carry_tau_and_speedup_per_category() -> None:
    records = [_rec("ar", None, 0, "math", 0.4, (1, 1, 1, 1)), _rec("ar", None, 1, "writing", 0.8, (1, 1, 1, 1)),
               _rec("dflash", None, 0, "math", 0.2, (3, 1)), _rec("dflash", None, 1, "writing", 0.8, (1, 1, 2))]
    rows = {r["method"]: r for r in aggregate(records)}
    cats = rows["dflash"]["by_category"]
    assert cats["math"]["tau"] == pytest.approx(2.0) and cats["writing"]["tau"] == pytest.approx(4 / 3)
    assert cats["math"]["speedup_vs_ar"] == pytest.approx(0.1 / 0.05)  # TPOT 0.4/4 vs 0.2/4
    assert cats["writing"]["speedup_vs_ar"] == pytest.approx(0.2 / 0.2)
    assert cats["math"]["n_prompts"] == 1 and cats["math"]["rounds"] == 2
    assert rows["dflash"]["tau"] == pytest.approx(8 / 5)  # the row itself: all its responses
    assert rows["ar"]["by_category"]["math"]["speedup_vs_ar"] == pytest.approx(1.0)


def test_report_table_and_csv_by_category() -> None:
    records = [_rec("ar", None, 0, "math", 0.4, (1, 1, 1, 1)), _rec("dflash", None, 0, "math", 0.2, (3, 1)),
               _rec("ar", None, 1, "coding", 0.4, (1, 1, 1, 1)), _rec("dflash", None, 1, "coding", 0.8, (1, 1, 2))]
    rows = aggregate(records)
    for r in rows:
        r["drafter"] = "dflash"
    lines = category_lines(rows, [])
    assert lines[0] == "| engine | drafter / method | mt · coding | mt · math |"
    assert lines[2] == "| draftforge | dflash / `dflash` | 0.50× (τ 1.33) | 2.00× (τ 2.00) |"
    table = list(csv.DictReader(io.StringIO(category_csv(rows))))
    assert {(t["method"], t["category"]) for t in table} == {("ar", "math"), ("ar", "coding"), ("dflash", "math"),
                                                            ("dflash", "coding")}
    assert category_lines([{**r, "by_category": {}} for r in rows], []) == []


def test_long_context_prompts_reach_their_size_and_carry_their_kind() -> None:
    from draftforge.config import compose
    from draftforge.evaluate.long_context import CHARS_PER_TOKEN, CODE, CONVERSATIONS
    from draftforge.evaluate.prompts import load_prompt_set

    cfg = compose("default", ["evaluate.long_context.min_tokens=1024", "evaluate.long_context.size=4"])
    prompts, categories = load_prompt_set("long_context", cfg), category_of("long_context", cfg)
    assert categories == [CODE, CONVERSATIONS, CODE, CONVERSATIONS]
    assert all(len(p) == 1 and len(p[0]["content"]) >= 1024 * CHARS_PER_TOKEN for p in prompts)
    assert prompts[0][0]["content"].startswith("The opening of the Python module `")
    assert prompts[1][0]["content"].startswith("Conversation 1:\nA: ")
    assert load_prompt_set("long_context", cfg) == prompts  # deterministic
    with pytest.raises(Exception, match="evaluate.long_context.min_tokens=100000000: no stdlib module"):
        load_prompt_set("long_context", compose("default", ["evaluate.long_context.min_tokens=100000000"]))


def test_the_category_table_shows_each_columns_prompt_length() -> None:
    records = [_rec("ar", None, 0, "math", 0.4, (1, 1, 1, 1)), _rec("dflash", None, 0, "math", 0.2, (3, 1))]
    for r in records:
        r["prompt_len"] = 4321
    rows = aggregate(records)
    assert rows[0]["prompt_tokens"] == 4321
    assert category_lines(rows, [])[0] == "| engine | drafter / method | mt · math (~4,321 tok) |"
