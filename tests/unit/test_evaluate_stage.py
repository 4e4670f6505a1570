"""evaluate stage pieces: method plan, clear errors, multi-turn split, aggregation definitions."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.cli import run_stage  # noqa: E402
from draftforge.errors import StageError  # noqa: E402
from draftforge.evaluate.aggregate import aggregate, first_mismatch  # noqa: E402
from draftforge.evaluate.runner import method_plan, split_turns  # noqa: E402
from draftforge.evaluate.stage import main  # noqa: E402


def _args(root: Path, *extra: str) -> list[str]:
    return ["experiment=smoke", "target=tiny-random", f"results_root={root}", "tracking.enabled=false",
            "evaluate.datasets=[chitchat,gsm_symbolic]", "evaluate.gsm_symbolic.size=3", "evaluate.num_prompts=2",
            "evaluate.max_new_tokens=12", "evaluate.budgets=[1,32]", "evaluate.warmup=1", *extra]


def test_bad_inputs_are_one_clear_error(tmp_path):
    assert method_plan(["ddtree", "dflash"], [16, 4]) == [("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 4)]
    with pytest.raises(StageError, match="evaluate.methods: unknown"):
        method_plan(["ar", "medusa"], [16])
    with pytest.raises(StageError, match="evaluate.budgets"):
        method_plan(["ddtree"], [0])
    with pytest.raises(SystemExit):  # no target stage yet → exit 2 with one line
        run_stage("evaluate", main, argv=_args(tmp_path))


def test_max_new_tokens_beyond_the_targets_positions_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from draftforge.config import compose
    from draftforge.io import write_json
    from draftforge.paths import stage_marker
    from draftforge.target.stage import resolve_target

    cfg = compose("smoke", ["target=tiny-random", f"results_root={tmp_path}"])
    info = resolve_target(cfg.target, tmp_path)
    write_json(stage_marker(tmp_path, "smoke", "target"), {**info, "max_position_embeddings": 64})
    monkeypatch.setattr("draftforge.evaluate.stage.load_engines", lambda *a: pytest.fail("loaded models"))
    with pytest.raises(SystemExit) as exit_:
        run_stage("evaluate", main, argv=_args(tmp_path, "evaluate.max_new_tokens=100"))
    assert exit_.value.code == 2
    assert "evaluate.max_new_tokens: 100 is above the target's max_position_embeddings 64" in capsys.readouterr().err


def test_split_turns_multiturn():
    convo = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert split_turns(convo) == [[convo[0]], convo]
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]
    assert split_turns(chat) == [chat]


def test_aggregate_definitions():
    def rec(method, budget, tokens, accepts, decode_s, idx=0):
        return {"dataset": "d", "temperature": 0.0, "prompt_index": idx, "turn": 0, "method": method, "budget": budget,
                "tokens": tokens, "accept_lengths": accepts, "n_decode": len(tokens) - 1, "decode_s": decode_s,
                "tpot_s": decode_s / (len(tokens) - 1), "ttft_s": 0.1, "draft_prefill_s": 0.0,
                "stage_s": {"draft": [0.1], "build": [0.01], "verify": [0.2], "commit": [0.01]}}
    records = [rec("ar", None, [1, 2, 3, 4, 5], [1] * 4, 0.4), rec("ddtree", 8, [1, 2, 3, 4, 5], [3, 2], 0.1),
               rec("dflash", None, [1, 2, 9, 4, 5], [2, 2], 0.2)]
    rows = {r["method"]: r for r in aggregate(records)}
    assert rows["ddtree"]["tau"] == 2.5 and rows["ddtree"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert rows["ddtree"]["tau_histogram"] == {"2": 1, "3": 1} and rows["ddtree"]["best_budget"]
    assert rows["dflash"]["lossless_mismatches"] == 1 and rows["dflash"]["mismatch_positions"] == [2]
    assert rows["ar"]["tokens_per_s"] == pytest.approx(10.0)
    assert first_mismatch([1, 2], [1, 2, 3]) == 2 and first_mismatch([1], [1]) is None


def test_mtp_method_trained_head_and_missing_head(tmp_path, capsys):
    """The mtp branch: one clear error line without a head; with its train branch's trained head
    (train/mtp/mtp) the rows carry AR and MTP only (drafter.settings.branch_methods), lossless at T=0,
    named by their source and branch."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head
    from evaluate_fixtures import tiny_pipeline

    info = tiny_pipeline(tmp_path)
    args = _args(tmp_path, "drafter=mtp", "evaluate.methods=[ar,dflash,ddtree,mtp]", "evaluate.mtp_drafts=2",
                 "evaluate.datasets=[chitchat]")
    with pytest.raises(SystemExit):
        run_stage("evaluate", main, argv=args)
    assert "evaluate.methods: 'mtp' needs an MTP head" in capsys.readouterr().err
    head, _ = new_trained_head(info["hf_path"])
    export_mimo_head(head, tmp_path / "smoke" / "train" / "mtp" / "mtp", info["hf_path"], dtype=__import__("torch").float32)
    run_stage("evaluate", main, argv=args)
    rows = json.loads((tmp_path / "smoke" / "evaluate" / "mtp" / "evaluate.json").read_text())["rows"]
    mtp = [r for r in rows if r["method"] == "mtp"]
    assert [r["method"] for r in rows] == ["ar", "mtp"] and mtp[0]["mtp_source"] == "trained"
    assert {r["drafter"] for r in rows} == {"mtp"}
    assert mtp[0]["lossless_mismatches"] == 0 and mtp[0]["tau"] >= 1.0


def test_finished_dataset_records_are_reused_only_when_whole_and_keyed(tmp_path):
    """A torn, foreign or differently keyed record is ignored (the dataset is measured again), never trusted."""
    from types import SimpleNamespace

    from draftforge.evaluate.resume import clear_finished, load_finished, save_finished

    ctx = SimpleNamespace(work_dir=tmp_path)
    payload = {"dataset": "chitchat", "rows": [{"method": "ar"}], "responses": []}
    save_finished(ctx, "chitchat", "k1", payload)
    assert load_finished(ctx, "chitchat", "k1") == payload
    assert load_finished(ctx, "chitchat", "k2") is None and load_finished(ctx, "gsm_symbolic", "k1") is None
    path = tmp_path / "finished" / "chitchat.json"
    for text in ('{"key": "k1", "payl', "[1, 2]", '{"key": "k1", "payload": {"rows": 3}}'):
        path.write_text(text)
        assert load_finished(ctx, "chitchat", "k1") is None, text
    clear_finished(ctx)
    assert not (tmp_path / "finished").exists()
