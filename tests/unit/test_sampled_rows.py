"""T > 0 rows: which prompts run at a sampling temperature (evaluate and vLLM baselines alike), parity per
temperature, and the report's lossless-check lines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftforge.baselines.stage import prompt_segments
from draftforge.errors import ConfigError
from draftforge.evaluate.config import EvaluateConfig
from draftforge.evaluate.prompts import prompts_at
from draftforge.report.parity import parity_block
from draftforge.report.sampling import sampled_temperatures, sampling_check_lines


def test_prompts_at_a_sampling_temperature_are_the_sampled_subset():
    ev = EvaluateConfig(datasets=["humaneval", "mt_bench"], num_prompts=4, temperatures=[0.0, 1.0],
                        sampled_datasets=["mt_bench"], sampled_prompts=2)  # fmt: skip
    assert prompts_at(ev, "humaneval", 0.0, 4) == 4 and prompts_at(ev, "mt_bench", 0.0, 4) == 4
    assert prompts_at(ev, "humaneval", 1.0, 4) == 0 and prompts_at(ev, "mt_bench", 1.0, 4) == 2
    assert prompts_at(ev, "mt_bench", 1.0, 1) == 1  # never more than the T = 0 prompts
    every = EvaluateConfig(datasets=["humaneval"], temperatures=[0.0, 0.7])
    assert prompts_at(every, "humaneval", 0.7, 4) == 4  # [] / 0: the same as at T = 0


def test_a_sampled_set_that_is_not_evaluated_runs_nothing_and_bad_counts_are_refused():
    ev = EvaluateConfig(datasets=["humaneval"], temperatures=[0.0, 1.0], sampled_datasets=["mt_bench"])
    assert prompts_at(ev, "humaneval", 1.0, 4) == 0  # humaneval is not sampled; mt_bench is not evaluated
    with pytest.raises(ConfigError, match="evaluate.sampled_prompts"):
        EvaluateConfig(sampled_prompts=-1)


def test_baselines_segments_follow_the_sampled_subset():
    ev = EvaluateConfig(datasets=["humaneval", "mt_bench"], num_prompts=3, sampled_datasets=["mt_bench"], sampled_prompts=1)
    ctx = SimpleNamespace(cfg=SimpleNamespace(evaluate=ev))
    rendered = {d: [{"id": f"{d}-{i}", "token_ids": [i]} for i in range(3)] for d in ("humaneval", "mt_bench")}
    segs = prompt_segments(ctx, rendered, ["humaneval", "mt_bench"], [0.0, 1.0])
    assert [(s["dataset"], s["temperature"], [p["id"] for p in s["prompts"]]) for s in segs] == [
        ("humaneval", 0.0, ["humaneval-0", "humaneval-1", "humaneval-2"]),
        ("mt_bench", 0.0, ["mt_bench-0", "mt_bench-1", "mt_bench-2"]),
        ("mt_bench", 1.0, ["mt_bench-0"]),
    ]


def _row(engine, method, tau, temperature):
    return {"dataset": "mt_bench", "engine": engine, "drafter": "dflash", "method": method, "budget": None,
            "temperature": temperature, "tau": tau, "status": "ok"}


def test_parity_compares_rows_of_one_temperature():
    rows = [_row("draftforge", "dflash", 2.0, 0.0), _row("vllm", "dflash", 2.02, 0.0),
            _row("draftforge", "dflash", 1.5, 1.0), _row("vllm", "dflash", 1.8, 1.0)]
    greedy = parity_block(rows, 0.05, "dflash", "dflash")
    sampled = parity_block(rows, 0.05, "dflash", "dflash", temperature=1.0)
    assert greedy["temperature"] == 0.0 and greedy["all_within"] is True
    assert sampled["datasets"]["mt_bench"]["rel_diff"] == pytest.approx(0.2) and sampled["all_within"] is False
    assert parity_block(rows, 0.05, "dflash", "dflash", temperature=0.7)["reason"].endswith("at T=0.7")
    assert sampled_temperatures(rows) == [1.0]


def test_sampling_check_lines_name_a_failure():
    check = {"temperature": 1.0, "responses": 8, "accepted_drafts": 120, "n": 512, "p_value": 2e-9, "tv": 0.2,
             "detectable_tv": 0.09, "power": 0.8, "alpha": 0.001}
    lines = sampling_check_lines({"dflash": [{**check, "method": "ddtree", "passed": False},
                                             {**check, "method": "ar", "passed": True, "p_value": 0.5}]})
    assert "`ddtree`" in lines[0] and "**FAILED**" in lines[0] and "p = 2e-09" in lines[0] and "TV ≥ 0.09" in lines[0]
    assert lines[1].endswith(": passed")
