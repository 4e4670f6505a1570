"""The evaluate stage end to end on a tiny random target + random drafter (CPU), MLflow on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.cli import make_context, run_stage  # noqa: E402
from draftforge.evaluate.stage import main  # noqa: E402
from draftforge.rows import ROW_KEYS  # noqa: E402
from evaluate_fixtures import tiny_pipeline  # noqa: E402

pytestmark = pytest.mark.integration


def _args(root: Path, *extra: str) -> list[str]:
    return ["experiment=smoke", "target=tiny-random", f"results_root={root}",
            "evaluate.datasets=[chitchat,gsm_symbolic]", "evaluate.gsm_symbolic.size=3", "evaluate.num_prompts=2",
            "evaluate.max_new_tokens=12", "evaluate.budgets=[1,32]", "evaluate.warmup=1", *extra]


def test_stage_writes_rows_lossless_and_marker_last(tmp_path):
    """T = 0 on both sets; T = 0.8 on the sampled subset (chitchat's first prompt) with the lossless check."""
    tiny_pipeline(tmp_path)
    run_stage("evaluate", main, argv=_args(tmp_path, "evaluate.temperatures=[0.0,0.8]", "evaluate.calibration_prompts=2",
                                           "evaluate.sampled_datasets=[chitchat]", "evaluate.sampled_prompts=1"))
    out = tmp_path / "smoke" / "evaluate" / "dflash"
    marker = json.loads((out / "evaluate.json").read_text())
    assert marker["datasets"] == ["chitchat", "gsm_symbolic"]
    rows = marker["rows"]
    assert len(rows) == (2 + 1) * 4  # (datasets at T = 0, chitchat at T = 0.8) × (ar, dflash, ddtree@1, ddtree@32)
    for row in rows:
        assert set(ROW_KEYS) <= set(row) and row["engine"] == "draftforge"
        assert row["tokens_per_s"] > 0 and row["tau"] >= 1.0
        if row["temperature"] == 0.0:
            assert row["lossless_mismatches"] == 0, row  # fp32 CPU: exact
            assert row["n_prompts"] == 2 and "sampling_check" not in row
        else:
            assert row["dataset"] == "chitchat" and row["n_prompts"] == 1 and row["lossless_mismatches"] is None
            assert row["sampling_check"]["n"] == sum(r["n_tokens"] for r in json.loads((out / "chitchat.json").read_text())["responses"]
                                                     if r["split"] == "eval" and r["repeat"] == 0 and r["temperature"] == 0.8
                                                     and (r["method"], r["budget"]) == (row["method"], row["budget"]))  # fmt: skip
    checks = marker["sampling_checks"]  # pooled per method: eval and calibration responses at T = 0.8
    assert [(c["temperature"], c["method"]) for c in checks] == [(0.8, m) for m in ("ar", "ddtree", "dflash")]
    assert all(c["passed"] in (True, None) and c["n"] > 0 for c in checks), checks
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["tau"] == 1.0 and r["speedup_vs_ar"] == pytest.approx(1.0) for r in ar)
    assert sum(r.get("best_budget", False) for r in rows) == 3  # one best budget per dataset × temperature run
    per = json.loads((out / "chitchat.json").read_text())
    first = [r for r in per["responses"] if r["split"] == "eval" and r["repeat"] == 0]
    assert len(first) == 2 * 4 + 1 * 4 and "best" in per["note"] and "auto" in per["note"]
    assert all(bool(r.get("pit")) == (r["temperature"] > 0) for r in first)
    repeats = {r["repeat"] for r in per["responses"]}
    assert len(per["responses"]) == len(repeats) * (2 * 4 + 1 * 4 + 2 * 2 * 2)  # + calibration: 2 T × 2 prompts × 2 budgets
    assert all(r["repeats"] == len(repeats) for r in rows)
    assert sum(r["auto_budget"] for r in rows if r["dataset"] == "chitchat" and r["temperature"] == 0.0 and r["method"] == "ddtree") == 1
    for budget in (1, 32):  # the auto budget's round cost is pooled over the sets (evaluate/budget.py), τ is each set's
        trees = [r for r in rows if (r["method"], r["budget"], r["temperature"]) == ("ddtree", budget, 0.0)]
        assert len(trees) == 2 and trees[0]["calibration_round_ms"] == trees[1]["calibration_round_ms"] is not None
    assert per["rows"] == [r for r in rows if r["dataset"] == "chitchat"]  # the set's file carries the marked rows
    resp = first[0]
    assert {"tokens", "accept_lengths", "stage_s", "ttft_s", "decode_s", "tpot_s"} <= set(resp)
    assert (out / "evaluate.json").stat().st_mtime >= (out / "gsm_symbolic.json").stat().st_mtime
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["draftforge/smoke"], filter_string="tags.stage = 'evaluate'")
    assert len(runs) == 12
    assert set(runs["tags.engine"]) == {"draftforge"}
    assert set(runs["tags.method"]) == {"ar", "dflash", "ddtree"}
    assert set(runs["tags.budget"]) == {"", "1", "32"} and set(runs["tags.dataset"]) == {"chitchat", "gsm_symbolic"}


AUTO_KEYS = ("auto_budget", "calibration_prompts", "calibration_tau", "calibration_round_ms", "calibration_tokens_per_s",
             "auto_vs_best", "auto_budget_note")


def test_interrupted_run_reuses_finished_datasets_only_with_the_same_inputs(tmp_path, monkeypatch):
    """Killed on the second dataset: the rerun times only that one (the first is reused, its MLflow runs not
    logged twice); after success the records are gone, and a changed config measures everything again."""
    import mlflow

    from draftforge.evaluate import stage

    tiny_pipeline(tmp_path)
    timed: list[str] = []
    real = stage.run_dataset

    def run_dataset(es, plan, dataset, *a, **kw):
        timed.append(dataset)
        if dataset == "gsm_symbolic" and fail:
            raise KeyboardInterrupt  # the machine goes away mid-stage
        return real(es, plan, dataset, *a, **kw)

    monkeypatch.setattr(stage, "run_dataset", run_dataset)
    fail = True
    with pytest.raises(KeyboardInterrupt):
        stage.main(make_context("evaluate", _args(tmp_path)))
    out = tmp_path / "smoke" / "evaluate" / "dflash"
    first = json.loads((out / "chitchat.json").read_text())
    assert not (out / "evaluate.json").exists() and set(timed) == {"chitchat", "gsm_symbolic"}
    fail, timed[:] = False, []
    run_stage("evaluate", main, argv=_args(tmp_path))
    assert set(timed) == {"gsm_symbolic"}  # chitchat reused
    marker = json.loads((out / "evaluate.json").read_text())
    unmarked = [{k: v for k, v in r.items() if k not in AUTO_KEYS} for r in marker["rows"] if r["dataset"] == "chitchat"]
    assert unmarked == first["rows"]  # reused as measured; the auto budget is marked once every set is done
    assert not (tmp_path / "smoke" / ".work" / "evaluate" / "dflash" / "finished").exists()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["draftforge/smoke"], filter_string="tags.stage = 'evaluate'")
    assert len(runs) == 2 * 4  # datasets × (ar, dflash, ddtree@1, ddtree@32): nothing logged twice
    timed[:] = []
    run_stage("evaluate", main, argv=_args(tmp_path, "evaluate.max_new_tokens=10"))
    assert set(timed) == {"chitchat", "gsm_symbolic"}


def test_torchrun_data_parallel_cpu(tmp_path):
    """Two CPU ranks (gloo) split the prompts; rank 0 merges every response into one set of rows."""
    import os
    import subprocess

    tiny_pipeline(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "draftforge.evaluate", *_args(tmp_path, "tracking.enabled=false", "evaluate.num_prompts=3",
                                         "evaluate.datasets=[chitchat]", "evaluate.warmup=0", "evaluate.calibration_prompts=2")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per = json.loads((tmp_path / "smoke" / "evaluate" / "dflash" / "chitchat.json").read_text())
    evald = [r for r in per["responses"] if r["split"] == "eval"]
    assert sorted({r["prompt_index"] for r in evald}) == [0, 1, 2]  # rank 0 took 0, 2; rank 1 took 1
    assert len(evald) == 3 * 4 * len({r["repeat"] for r in evald})
    assert sorted({r["prompt_index"] for r in per["responses"] if r["split"] == "calibration"}) == [3, 4]
    assert all(r["n_prompts"] == 3 and r["lossless_mismatches"] == 0 for r in per["rows"])


def test_stage_with_a_dspark_drafter_runs_markov_methods_losslessly(tmp_path):
    tiny_pipeline(tmp_path, dspark_rank=8)
    # drafter.draft_vocab_size=0: the tiny target's 512 tokens are fewer than conf/drafter/dspark.yaml's 8,192
    run_stage("evaluate", main, argv=_args(tmp_path, "drafter=dspark", "drafter.draft_vocab_size=0", "evaluate.datasets=[chitchat]",
                                           "evaluate.methods=[ar,dflash,dspark,ddtree,ddtree_markov,mtp]"))
    rows = json.loads((tmp_path / "smoke" / "evaluate" / "dspark" / "evaluate.json").read_text())["rows"]
    got = [(r["method"], r["budget"]) for r in rows]  # the dspark branch's methods only (branch_methods)
    assert got == [("ar", None), ("dspark", None), ("ddtree", 1), ("ddtree", 32),
                   ("ddtree_markov", 1), ("ddtree_markov", 32)]
    assert all(r["lossless_mismatches"] == 0 for r in rows)
    assert {r["drafter"] for r in rows} == {"dspark"}
    assert sum(r.get("best_budget", False) for r in rows) == 2  # one per tree method


def test_dflash_drafter_refuses_markov_methods(tmp_path, capsys):
    import shutil

    tiny_pipeline(tmp_path)  # a DFlash export in the dflash branch, put where the dspark branch reads its drafter
    shutil.copytree(tmp_path / "smoke" / "train" / "dflash", tmp_path / "smoke" / "train" / "dspark")
    with pytest.raises(SystemExit) as err:  # run_stage: the StageError as one stderr line and exit code 2
        run_stage("evaluate", main, argv=_args(tmp_path, "drafter=dspark", "drafter.draft_vocab_size=0",
                                               "evaluate.methods=[ar,ddtree_markov]"))
    assert err.value.code == 2 and "['ddtree_markov'] need a DSpark drafter" in capsys.readouterr().err
