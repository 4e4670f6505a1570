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
