"""evaluate timing and budget choice: repeats/calibration config keys, interleaved order, median + spread
rows, the pure auto-budget chooser, calibration prompts disjoint from evaluation prompts, report rendering."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftforge.config import compose
from draftforge.errors import ConfigError
from draftforge.evaluate import budget as budget_mod
from draftforge.evaluate import runner
from draftforge.evaluate.aggregate import aggregate
from draftforge.evaluate.budget import calibration_curves, choose_budget, predicted_tokens_per_s
from draftforge.evaluate.config import EvaluateConfig
from draftforge.evaluate.prompts import eval_and_calibration_sets, eval_prompt_sets
from draftforge.report import plots
from draftforge.report.rows import AUTO_NAME, BEST_NAME, budget_choices
from draftforge.report.stage import budget_choice_lines, markdown_table, summary_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_fixtures import tiny_drafter, tiny_target  # noqa: E402


@pytest.mark.parametrize(("override", "named"), [("evaluate.repeats=0", "evaluate.repeats"),
                                                 ("evaluate.calibration_prompts=-1", "evaluate.calibration_prompts")])
def test_new_keys_fail_at_compose_naming_the_key(override, named):
    with pytest.raises(ConfigError) as err:
        compose("default", [override])
    assert f"{named}: " in str(err.value) and "\n" not in str(err.value)
    cfg = compose("default", ["evaluate.repeats=2", "evaluate.calibration_prompts=0"])
    assert cfg.evaluate.repeats == 2 and cfg.evaluate.calibration_prompts == 0
    with pytest.raises(ConfigError, match="evaluate.repeats"):
        EvaluateConfig(repeats=0)


def test_choose_budget_maximises_tau_over_cost():
    # τ rises with the budget, cost rises faster past 32: the best predicted rate is at 32, not at max τ or min cost
    curve = {8: (1.5, 0.10), 16: (1.8, 0.11), 32: (2.2, 0.12), 64: (2.4, 0.16), 128: (2.5, 0.30)}
    assert choose_budget(curve) == 32
    assert predicted_tokens_per_s(2.2, 0.12) == pytest.approx(2.2 / 0.12)
    assert choose_budget({64: (2.0, 0.2), 16: (1.0, 0.1)}) == 16  # a tie goes to the smaller budget
    # within TIE_TOLERANCE of the best is a tie too (calibration noise); beyond it the larger budget wins
    assert choose_budget({3: (1.35, 0.0671), 4: (1.31, 0.0661), 8: (1.50, 0.0730)}) == 3  # 20.1 vs 20.5 tok/s: a tie
    assert choose_budget({3: (1.35, 0.0671), 8: (1.60, 0.0730)}) == 8  # 20.1 vs 21.9 tok/s: 8 wins
    assert budget_mod.TIE_TOLERANCE == 0.03
    assert choose_budget({8: (None, 0.1), 16: (1.2, math.nan), 32: (1.5, 0.0), 64: (1.1, 0.2)}) == 64  # unusable skipped
    assert choose_budget({8: (None, None)}) is None and choose_budget({}) is None


def _rec(method, budget, repeat, decode_s, tokens=(1, 2, 3, 4, 5), accepts=(1, 1, 1, 1), idx=0, split="eval", dataset="d"):
    n = len(tokens) - 1
    return {"dataset": dataset, "temperature": 0.0, "prompt_index": idx, "turn": 0, "method": method, "budget": budget,
            "split": split, "repeat": repeat, "tokens": list(tokens), "accept_lengths": list(accepts), "n_decode": n,
            "decode_s": decode_s, "tpot_s": decode_s / n, "ttft_s": 0.1, "draft_prefill_s": 0.0,
            "stage_s": {"draft": [0.1], "build": [0.01], "verify": [0.2], "commit": [0.01]}}


def test_calibration_curves_tau_first_repeat_cost_median():
    recs = [_rec("ddtree", 8, r, s, accepts=(2, 2), split="calibration") for r, s in ((0, 0.2), (1, 0.4), (2, 0.3))]
    recs.append(_rec("ar", None, 0, 1.0, split="calibration"))  # not a tree method: ignored
    curves = calibration_curves(recs)
    assert list(curves) == [("d", 0.0, "ddtree")]
    tau, cost = curves[("d", 0.0, "ddtree")][8]
    assert tau == 2.0 and cost == pytest.approx(0.3 / 2)  # median decode_s 0.3 over 2 rounds


def test_calibration_cost_is_pooled_over_sets_and_tau_is_each_sets_own():
    """A slow period of the host during set a's budget-8 calibration (its rounds take 2x) would make a choose 4
    alone; pooled with set b's rounds at the same budget the cost is the engine's, and a's higher τ at 8 wins."""
    cal = dict(split="calibration")
    recs = [_rec("ddtree", 4, 0, 0.40, accepts=(2,) * 4, dataset="a", **cal),  # τ 2.0, 0.10 s per round
            _rec("ddtree", 8, 0, 0.96, accepts=(3,) * 4, dataset="a", **cal),  # τ 3.0, 0.24 s per round: slow host
            _rec("ddtree", 4, 0, 0.40, accepts=(1,) * 4, dataset="b", **cal),
            _rec("ddtree", 8, 0, 0.24 * 3, accepts=(1,) * 12, dataset="b", **cal)]  # 0.06 s per round
    assert choose_budget({4: (2.0, 0.10), 8: (3.0, 0.24)}) == 4  # 20 vs 12.5 tok/s on set a's own timings
    curves = calibration_curves(recs)
    assert curves[("a", 0.0, "ddtree")][8] == (3.0, pytest.approx((0.96 + 0.72) / 16))  # 0.105 s: every set's rounds
    assert curves[("b", 0.0, "ddtree")][8] == (1.0, pytest.approx((0.96 + 0.72) / 16))  # τ stays each set's own
    assert curves[("a", 0.0, "ddtree")][4] == (2.0, pytest.approx(0.10))
    assert choose_budget(curves[("a", 0.0, "ddtree")]) == 8  # 28.6 vs 20 tok/s
    assert choose_budget(curves[("b", 0.0, "ddtree")]) == 4
    hot = [dict(r, temperature=1.0) for r in recs[:2]]  # another temperature pools apart
    assert calibration_curves(recs + hot)[("a", 1.0, "ddtree")][8] == (3.0, pytest.approx(0.24))


def test_rows_carry_median_spread_and_auto_best_flags():
    records = []
    # three repeats; repeat 1 is a slow period for every config alike
    for r, slow in ((0, 1.0), (1, 3.0), (2, 1.2)):
        records += [_rec("ar", None, r, 0.8 * slow), _rec("ddtree", 8, r, 0.4 * slow, accepts=(2, 2)),
                    _rec("ddtree", 32, r, 0.5 * slow, accepts=(4,))]
    records[-1] = _rec("ddtree", 32, 2, 0.8, tokens=(1, 2, 3, 9, 5), accepts=(4,))  # a later repeat's tokens differ
    # calibration: the 8 budget predicts more tokens/s (2 / 0.1) than the 32 budget (4 / 0.5)
    for r in range(3):
        records += [_rec("ddtree", 8, r, 0.2, accepts=(2, 2), idx=5, split="calibration"),
                    _rec("ddtree", 32, r, 0.5, accepts=(4,), idx=5, split="calibration")]
    rows = {(r["method"], r["budget"]): r for r in aggregate(records, calibration_prompts=1)}
    ar, t8, t32 = rows[("ar", None)], rows[("ddtree", 8)], rows[("ddtree", 32)]
    assert ar["repeats"] == 3 and ar["tokens_per_s"] == pytest.approx(4 / (0.8 * 1.2))  # median, not the mean
    assert ar["tokens_per_s_min"] == pytest.approx(4 / 2.4) and ar["tokens_per_s_max"] == pytest.approx(4 / 0.8)
    assert t8["speedup_vs_ar"] == pytest.approx(2.0)  # per-repeat ratios 2, 2, 2: the slow repeat cancels
    assert t8["speedup_vs_ar_min"] == pytest.approx(2.0) == t8["speedup_vs_ar_max"]
    assert t32["speedup_vs_ar_min"] == pytest.approx(1.2) and t32["speedup_vs_ar_max"] == pytest.approx(1.6) == t32["speedup_vs_ar"]
    assert t8["n_responses"] == 1 and t8["tau"] == 2.0 and t8["lossless_mismatches"] == 0  # first repeat
    assert t32["repeat_mismatches"] == 1 and t8["repeat_mismatches"] == 0
    assert t8["best_budget"] and not t32["best_budget"]
    assert t8["auto_budget"] and not t32["auto_budget"] and t8["auto_vs_best"] == pytest.approx(1.0)
    assert t8["calibration_prompts"] == 1 and t8["calibration_tau"] == 2.0
    assert t8["calibration_round_ms"] == pytest.approx(100.0) and t8["calibration_tokens_per_s"] == pytest.approx(20.0)
    assert "auto_budget" not in ar
    off = aggregate([r for r in records if r["split"] == "eval"], calibration_prompts=0)
    trees = [r for r in off if r["method"] == "ddtree"]
    assert not any(r["auto_budget"] for r in trees) and all(r["auto_vs_best"] is None for r in trees)
    assert "calibration disabled" in trees[0]["auto_budget_note"]


def test_interleaved_order(monkeypatch):
    """Repeat-major passes; every prompt runs every config back to back; order rotated per repeat."""
    calls = []
    monkeypatch.setattr(runner, "run_turns", lambda es, method, dataset, index, messages, temperature, seed, repeat=0,
                        split="eval", pit=False: calls.append((repeat, index, method)) or [])
    plan = [("ar", None), ("dflash", None), ("ddtree", 8), ("ddtree", 32)]
    runner.run_dataset(None, plan, "d", [(0, []), (1, [])], 0.0, 0, warmup=0, show=False, repeats=2)
    assert [c[:2] for c in calls] == [(r, i) for r in range(2) for i in range(2) for _ in plan]
    assert [c[2] for c in calls[:4]] == plan and [c[2] for c in calls[8:12]] == plan[2:] + plan[:2]
    assert runner.rotated(plan, 0, 1) == plan and runner.calibration_plan(plan) == plan[2:]


def test_calibration_prompts_disjoint_from_eval_prompts(caplog):
    cfg = EvaluateConfig(datasets=["humaneval", "gsm_symbolic", "chitchat", "mt_bench"], num_prompts=4, calibration_prompts=2)
    cfg.gsm_symbolic.size = 5  # a pool with one prompt left after the evaluation ones
    evals, calib = eval_and_calibration_sets(cfg)
    assert evals == eval_prompt_sets(cfg, limit=4)  # what baselines runs on
    assert {k: len(v) for k, v in calib.items()} == {"humaneval": 2, "gsm_symbolic": 1, "chitchat": 2, "mt_bench": 2}
    short = [r.getMessage() for r in caplog.records if "evaluate.calibration_prompts" in r.getMessage()]
    assert short == ["evaluate.calibration_prompts=2: gsm_symbolic's held-out pool gives only 1 after its 4 evaluation "
                     "prompts; calibrating on those 1 (set evaluate.calibration_prompts <= 1 to silence this)"]
    for name, picked in calib.items():
        assert all(i >= 4 for i, _ in picked)
        eval_texts = {json.dumps(p) for p in evals[name]}
        assert not eval_texts & {json.dumps(p) for _, p in picked}, name
    cfg.num_prompts = 0  # every prompt of the pool is an evaluation prompt: nothing left to calibrate on
    assert all(not v for v in eval_and_calibration_sets(cfg)[1].values())
    cfg.num_prompts, cfg.calibration_prompts = 4, 0
    assert all(not v for v in eval_and_calibration_sets(cfg)[1].values())



def test_calibration_skips_prompts_whose_content_repeats_an_evaluation_or_earlier_calibration_prompt(tmp_path):
    """A pool with duplicates by content: records that repeat an evaluation prompt (under another id, with extra
    fields) and a calibration prompt repeated later are skipped, so calibration is disjoint from evaluation by
    content, not only by index, and holds no prompt twice. Exact: the guard compares whole messages."""
    pool = [{"id": 0, "question": "q0"}, {"id": 1, "question": "q1"}, {"id": 2, "question": "q2"},
            {"id": 30, "question": "q0", "answer": "other id, same prompt"},  # index 3: repeats evaluation's q0
            {"id": 4, "question": "q3"},  # index 4: calibration
            {"id": 5, "question": "q3"},  # index 5: repeats calibration's q3
            {"id": 6, "question": "q1"},  # index 6: repeats evaluation's q1
            {"id": 7, "question": "q1 "},  # index 7: differs by a space: another prompt (no normalisation)
            {"id": 8, "question": "q4"}]  # fmt: skip
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pool))
    cfg = EvaluateConfig(datasets=["gsm8k"], dataset_files={"gsm8k": str(path)}, num_prompts=3, calibration_prompts=2)
    evals, calib = eval_and_calibration_sets(cfg)
    text = lambda msgs: msgs[0]["content"]  # noqa: E731
    assert [text(p) for p in evals["gsm8k"]] == ["q0", "q1", "q2"]
    assert [(i, text(p)) for i, p in calib["gsm8k"]] == [(4, "q3"), (7, "q1 ")]
    cfg.calibration_prompts = 3
    picked = eval_and_calibration_sets(cfg)[1]["gsm8k"]
    assert [(i, text(p)) for i, p in picked] == [(4, "q3"), (7, "q1 "), (8, "q4")]
    contents = [json.dumps(p, sort_keys=True) for _, p in picked]
    assert len(set(contents)) == len(contents)
    assert not set(contents) & {json.dumps(p, sort_keys=True) for p in evals["gsm8k"]}

def _report_rows(with_auto: bool = True):
    rows = [{"dataset": "humaneval", "engine": "draftforge", "drafter": "dflash", "method": "ar", "budget": None, "temperature": 0.0,
             "tokens_per_s": 10.0, "tokens_per_s_min": 9.0, "tokens_per_s_max": 11.0, "speedup_vs_ar": 1.0,
             "speedup_vs_ar_min": 1.0, "speedup_vs_ar_max": 1.0, "repeats": 3, "tau": 1.0, "status": "ok"},
            {"dataset": "humaneval", "engine": "vllm", "method": "ar", "budget": None, "temperature": 0.0,
             "tokens_per_s": 30.0, "tau": 1.0, "status": "ok"}]
    for b, tps in ((8, 9.0), (16, 12.0), (32, 11.0)):
        rows.append({"dataset": "humaneval", "engine": "draftforge", "drafter": "dflash", "method": "ddtree", "budget": b, "temperature": 0.0,
                     "tokens_per_s": tps, "tokens_per_s_min": tps - 1, "tokens_per_s_max": tps + 0.5, "repeats": 3,
                     "speedup_vs_ar": tps / 10, "speedup_vs_ar_min": tps / 10 - 0.05, "speedup_vs_ar_max": tps / 10 + 0.05,
                     "tau": 1.5, "status": "ok", "best_budget": b == 16, "auto_budget": with_auto and b == 32,
                     "calibration_prompts": 2 if with_auto else 0, "calibration_tau": 1.6, "calibration_round_ms": 140.0,
                     "calibration_tokens_per_s": 11.4, "auto_vs_best": 11.0 / 12.0 if with_auto else None})
        if not with_auto:
            rows[-1]["auto_budget_note"] = "calibration disabled (evaluate.calibration_prompts = 0)"
    return rows


def test_report_renders_spread_and_both_budgets(tmp_path):
    rows = _report_rows()
    table = markdown_table(rows)
    assert "11.0 [10.0–11.5]" in table and "32 (auto)" in table and "16 (best)" in table
    assert "| 30.0 |" in table  # vLLM rows: no spread
    (choice,) = budget_choices(rows)
    assert choice["auto"]["budget"] == 32 and choice["best"]["budget"] == 16
    line = budget_choice_lines([choice])[0]
    assert f"{AUTO_NAME}: 32" in line and f"{BEST_NAME}: 16" in line and "auto = **92%**" in line
    assert "dflash/`ddtree`" in line
    assert "2 calibration prompt(s)" in line and "round 140.0 ms (pooled over the sets) = 11.4" in line
    off = budget_choice_lines(budget_choices(_report_rows(with_auto=False)))[0]
    assert f"{AUTO_NAME}: none — calibration disabled" in off and f"{BEST_NAME}: 16" in off
    header = summary_csv(rows).splitlines()[0].split(",")
    assert {"tokens_per_s_min", "tokens_per_s_max", "auto_budget", "best_budget"} <= set(header)
    assert plots.ddtree_budget_sweep(rows, tmp_path / "budget.png").stat().st_size > 1000
    assert plots.tokens_per_s_by_method(rows, tmp_path / "tps.png").stat().st_size > 1000


def test_report_says_why_the_auto_budget_misses_the_oracle():
    """Below 90% of the oracle's tokens/s the line names the cause it can tell from the rows."""
    rows = _report_rows()
    tree = {r["budget"]: r for r in rows if r["method"] == "ddtree"}
    tree[32].update(tokens_per_s=10.0, tokens_per_s_min=9.5, tokens_per_s_max=10.5, tau=1.4)
    for b, (tau, ms) in {8: (1.3, 120.0), 16: (1.6, 110.0), 32: (1.4, 130.0)}.items():
        tree[b].update(tau=tau, round_ms=ms)
    (choice,) = budget_choices(rows)
    assert choice["auto_vs_best"] == pytest.approx(10 / 12)
    line = budget_choice_lines([choice])[0]
    assert "Below 90%" in line and "on the evaluation prompts picks 16, as the oracle does" in line
    assert "32: τ 1.60 (1.40), round 140 (130) ms; 16: τ 1.60 (1.60), round 140 (110) ms" in line
    assert "spreads overlap" not in line
    tree[32].update(round_ms=60.0, tokens_per_s_max=11.5)  # the rule now picks 32 on the evaluation data as well
    (choice,) = budget_choices(rows)
    assert any("picks 32 on the evaluation prompts too" in w for w in choice["why"])
    assert any("spreads overlap (auto max 11.5 ≥ oracle min 11.0" in w for w in choice["why"])
    tree[32].update(tokens_per_s=11.0)  # 92%: within the goal, no reasons
    assert budget_choices(rows)[0]["why"] == [] and "Below" not in budget_choice_lines(budget_choices(rows))[0]


def test_stage_rows_and_calibration_split(tmp_path):
    """The stage end to end (tiny target, random drafter): rows carry repeats + spread, auto and best flags;
    calibration responses use prompts after the evaluation ones."""
    from draftforge.cli import run_stage
    from draftforge.evaluate.stage import main
    from evaluate_fixtures import tiny_pipeline

    tiny_pipeline(tmp_path)
    run_stage("evaluate", main, argv=[
        "experiment=smoke", "target=tiny-random", f"results_root={tmp_path}", "tracking.enabled=false",
        "evaluate.datasets=[chitchat]", "evaluate.num_prompts=2",
        "evaluate.max_new_tokens=8", "drafter=dflash", "evaluate.methods=[ar,ddtree]", "evaluate.budgets=[1,8]", "evaluate.warmup=0",
        "evaluate.repeats=2", "evaluate.calibration_prompts=1"])  # fmt: skip
    per = json.loads((tmp_path / "smoke" / "evaluate" / "dflash" / "chitchat.json").read_text())
    resp = per["responses"]
    assert {r["prompt_index"] for r in resp if r["split"] == "eval"} == {0, 1}
    assert {r["prompt_index"] for r in resp if r["split"] == "calibration"} == {2}
    assert {r["repeat"] for r in resp} == {0, 1} and len(resp) == 2 * 2 * 3 + 2 * 2
    rows = per["rows"]
    assert all(r["repeats"] == 2 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] for r in rows)
    assert all(r["repeat_mismatches"] == 0 and r["lossless_mismatches"] == 0 for r in rows)
    trees = [r for r in rows if r["method"] == "ddtree"]
    assert sum(r["auto_budget"] for r in trees) == 1 and sum(r["best_budget"] for r in trees) == 1
    assert all(r["calibration_prompts"] == 1 and r["calibration_tau"] >= 1.0 for r in trees)


def test_decode_rows_cover_every_chunk_and_verify_a_plan_may_multiply():
    from draftforge.engine.lookup import LOOKUP_DEPTH

    tm = tiny_target()
    plan = [("ar", None), ("dflash", None), ("ddtree", 3), ("ddtree", 64), ("ddtree_lookup", 3)]
    es = SimpleNamespace(tm=tm, drafter=tiny_drafter(tm, block=16))
    # chunks 1…17, DDTree verifies budget + 1, the lookup's tree budget + 1 … budget + 1 + LOOKUP_DEPTH
    assert runner.decode_rows(es, plan) == set(range(1, 18)) | {65} | set(range(4, 5 + LOOKUP_DEPTH))
    es = SimpleNamespace(tm=tm, drafter=tiny_drafter(tm, block=32))
    assert runner.decode_rows(es, plan[:2]) == set(range(1, 34))
    assert runner.decode_rows(SimpleNamespace(tm=tm, drafter=None), [("ar", None)]) == set(range(1, 18))
