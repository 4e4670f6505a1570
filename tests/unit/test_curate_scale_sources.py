"""Sources that scale: reasoning-gym task families (seeds disjoint from evaluation), stdlib code prompt
families, decontamination of their rows counted per eval set, truncation rate in the manifest."""

from __future__ import annotations

from collections import Counter

import pytest

from draftforge.curate.config import CurateConfig, SourceConfig
from draftforge.curate.decontam import Decontaminator
from draftforge.curate.packaged import REASONING_GYM_TASKS, reasoning_gym_tasks
from draftforge.curate.select import select_rows
from draftforge.curate.sources import iter_source
from draftforge.errors import StageError
from draftforge.evaluate.config import EvaluateConfig, GsmSymbolicEvalConfig

EVAL = EvaluateConfig(gsm_symbolic=GsmSymbolicEvalConfig(seed=1000, size=50))
MODULE = '''
def add(a, b):
    """Add."""
    total = a + b
    return total


def scale(xs, k):
    out = []
    for x in xs:
        out.append(x * k)
    return out
'''


def _rows(src: SourceConfig):
    return list(iter_source(src, min_chars=1, on_malformed="drop", eval_cfg=EVAL))


def test_reasoning_gym_families_interleaved_and_seeded():
    src = SourceConfig(name="rg", kind="reasoning_gym", options={"tasks": ["logic", "chain_sum"], "seed": 7, "size": 2})
    rows = _rows(src)
    tasks = REASONING_GYM_TASKS["logic"] + ["chain_sum"]
    assert reasoning_gym_tasks(src) == tasks
    assert [r.id for r in rows] == [f"rg:{t}:s{s}" for s in (7, 8) for t in tasks]  # item i of every task, then i + 1
    assert rows == _rows(src)  # deterministic
    assert len(reasoning_gym_tasks(SourceConfig(kind="reasoning_gym"))) >= 30


def test_reasoning_gym_seeds_must_avoid_eval_seeds_and_tasks_must_exist():
    with pytest.raises(StageError, match=r"overlap the evaluation seeds \[1000, 1050\)"):
        _rows(SourceConfig(name="rg", kind="reasoning_gym", options={"tasks": ["gcd"], "seed": 990, "size": 20}))
    with pytest.raises(StageError, match="unknown reasoning-gym task"):
        _rows(SourceConfig(name="rg", kind="reasoning_gym", options={"tasks": ["no_such_task"], "size": 1}))


def test_stdlib_code_families_several_tasks_per_function(tmp_path):
    (tmp_path / "mod.py").write_text(MODULE)
    opts = {"root": str(tmp_path), "min_function_lines": 3, "tasks": ["explain", "tests", "type_hints", "translate"]}
    one = _rows(SourceConfig(name="c", kind="stdlib_code", options=opts))
    three = _rows(SourceConfig(name="c", kind="stdlib_code", options={**opts, "tasks_per_function": 3}))
    assert len(one) == 2 and len(three) == 6
    assert [r.id for r in three][::3] == [r.id for r in one]  # the first task keeps the single-task id
    assert len({r.messages[0]["content"] for r in three}) == 6


def test_new_sources_decontaminated_and_counted():
    rg = SourceConfig(name="rg", kind="reasoning_gym", options={"tasks": ["gcd", "syllogism"], "seed": 0, "size": 5})
    first = _rows(rg)
    eval_sets = {"held": [[{"role": "user", "content": first[3].messages[0]["content"]}]]}
    cfg = CurateConfig(sources=[rg])
    out: list[dict] = []
    sel = select_rows(cfg, lambda s: iter_source(s, min_chars=1, on_malformed="drop", eval_cfg=EVAL),
                      Decontaminator(eval_sets, ngram=6, threshold=0.5), out.append)
    assert sel.decontam == {"held": {"eval_prompts": 1, "removed": 1}}
    assert sel.per_source["rg"].dropped["contaminated:held"] == 1
    assert first[3].id not in {r["id"] for r in out} and len(out) + sum(sel.per_source["rg"].dropped.values()) == 10


def test_truncation_report():
    from draftforge.curate.stage import truncation_report

    rep = truncation_report(Counter(a=4, b=6), Counter(a=1), 64)
    assert rep["answers"] == 10 and rep["truncated"] == 1 and rep["rate"] == 0.1 and rep["max_new_tokens"] == 64
    assert rep["per_source"]["a"] == {"answers": 4, "truncated": 1, "rate": 0.25}
