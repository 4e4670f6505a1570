"""report over a real MLflow store and results folder: one link per run of the current config of each (stage,
branch), nothing of a branch removed from `drafters` (links, plots)."""

from __future__ import annotations

import re
from pathlib import Path

from draftforge.cli import run_stage
from draftforge.io import write_json
from draftforge.paths import stage_dir, stage_marker
from draftforge.report.stage import main as report_main
from draftforge.tracking import mlflow_run

EXP = "smoke"
BRANCHES = ("dflash", "dspark")


def _row(engine: str, branch: str, method: str, tps: float, budget=None) -> dict:
    return {"dataset": "chitchat", "engine": engine, "drafter": branch, "method": method, "budget": budget,
            "temperature": 0.0, "tokens_per_s": tps, "tau": 1.0 if method == "ar" else 2.0, "speedup_vs_ar": tps / 10,
            "status": "ok"}


def _finished_stages(root: Path) -> None:
    """Every upstream marker the report reads, for both branches."""
    write_json(stage_marker(root, EXP, "target"), {"name": "tiny-random", "architecture": "LlamaForCausalLM",
                                                    "num_layers": 4, "hidden_size": 64})
    write_json(stage_marker(root, EXP, "curate"), {"counts": {"kept": 5}})
    for b in BRANCHES:
        write_json(stage_marker(root, EXP, "train", b), {
            "train_curve": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], "val_curve": [{"step": 2, "val_sim_tau": 1.4}],
            "drafter": {"num_hidden_layers": 1, "block_size": 8, "target_layer_ids": [1]}, "steps": 2,
            "best": {"val_sim_tau": 1.4}, "selected": "last"})  # fmt: skip
        write_json(stage_marker(root, EXP, "evaluate", b), {"rows": [_row("draftforge", b, "ar", 10.0),
                                                                     _row("draftforge", b, "ddtree", 14.0, 8)]})
        write_json(stage_marker(root, EXP, "baselines", b), {"rows": [_row("vllm", b, "ar", 20.0)]})


def _log_stage_runs(root: Path, evaluate_hash: str = "e1", budget: int = 8) -> None:
    """What one pipeline run logs: a run per stage, per branch, and per evaluate row."""
    with mlflow_run(results_root=root, experiment=EXP, stage="target", run_name="target/tiny-random", tags={"config_hash": "t1"}):
        pass
    for b in BRANCHES:
        tags = {"drafter": b, "config_hash": f"train-{b}"}
        with mlflow_run(results_root=root, experiment=EXP, stage="train", run_name="train/tiny-random", tags=tags):
            pass
        for name in (f"{b}/chitchat/ar/T0.0", f"{b}/chitchat/ddtree@{budget}/T0.0"):
            with mlflow_run(results_root=root, experiment=EXP, stage="evaluate", run_name=name,
                            tags={"drafter": b, "config_hash": evaluate_hash}):
                pass


def _report(root: Path, drafters: str, *extra: str) -> str:
    run_stage("report", report_main, [f"experiment={EXP}", "target=tiny-random", f"results_root={root}",
                                      f"drafters={drafters}", *extra])  # fmt: skip
    return (stage_dir(root, EXP, "report") / "summary.md").read_text()


def _links(text: str) -> list[str]:
    section = text.split("## MLflow runs", 1)[1]
    return re.findall(r"^- \[([^]]+)\]\(http[^)]*/runs/\w+\) — (.*)$", section, flags=re.M)


def test_links_once_per_run_of_the_current_config_of_listed_branches(tmp_path):
    root = tmp_path / "results"
    _finished_stages(root)
    _log_stage_runs(root, evaluate_hash="e0", budget=64)  # an older evaluate config (another budget)
    for _ in range(3):  # three reruns of the current config
        _log_stage_runs(root)
    want = [("target/tiny-random", "stage `target`")]
    for stage in ("train", "evaluate"):
        for b in BRANCHES:
            names = ["train/tiny-random"] if stage == "train" else [f"{b}/chitchat/ar/T0.0", f"{b}/chitchat/ddtree@8/T0.0"]
            want += [(n, f"stage `{stage}`, branch `{b}`") for n in names]
    assert _links(_report(root, "[dflash,dspark]")) == want
    text = _report(root, "[dflash]")  # dspark removed from the experiment
    assert _links(text) == [w for w in want if "dspark" not in w[1]]
    assert "dspark/" not in text and "`dspark`" not in text


def test_plots_of_a_removed_branch_leave_the_report(tmp_path):
    root = tmp_path / "results"
    _finished_stages(root)
    report_dir = stage_dir(root, EXP, "report")
    _report(root, "[dflash,dspark]", "tracking.enabled=false")
    assert (report_dir / "training_curve_dspark.png").is_file()
    text = _report(root, "[dflash]", "tracking.enabled=false")
    assert "training_curve_dspark" not in text
    assert sorted(p.name for p in report_dir.glob("*.png")) == ["acceptance_by_position.png", "acceptance_hist.png",
                                                                 "ddtree_budget.png", "tokens_per_s.png",
                                                                 "training_curve_dflash.png"]
    _report(root, "[dflash]", "tracking.enabled=false", "report.plots=false")
    assert not list(report_dir.glob("*.png"))  # plots off: none of an earlier report's plots stays beside it
