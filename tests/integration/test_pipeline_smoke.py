"""End to end: `snakemake --cores all --config experiment=smoke` from a clean copy of the repo, then
rerun decisions read from Snakemake's own dry-run, then `mlflow ui` in headless Chromium."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from draftforge.stages import PER_DRAFTER, STAGE_MARKERS, STAGES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_fixtures import pipeline_snakemake  # noqa: E402

# xdist_group: one pytest-xdist worker runs this module and its sibling (the local smoke and SLURM pipeline
# tests), so the session's smoke_repo and SLURM cluster are built once
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(3600),
              pytest.mark.xdist_group("smoke_pipeline")]

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "plugins"  # toy_drafter.py: a drafter type registered from outside draftforge
BIN = Path(sys.executable).parent
# experiment=smoke trains one drafter branch (drafters: [dflash]); the stage table says which stages branch.
MARKERS = {stage: f"{stage}/dflash/{marker}" if stage in PER_DRAFTER else f"{stage}/{marker}"
           for stage, marker in STAGE_MARKERS.items()}


def snakemake(repo: Path, *args: str, timeout: int = 3000, pythonpath: str = "") -> subprocess.CompletedProcess:
    return pipeline_snakemake(repo, *args, timeout=timeout, pythonpath=pythonpath)


# smoke_repo (tests/conftest.py, session-scoped): the clean copy after the smoke pipeline, shared with
# tests/integration/test_pipeline_slurm.py, which compares its SLURM run with it.


def test_every_stage_wrote_its_outputs(smoke_repo: Path) -> None:
    exp = smoke_repo / "results" / "smoke"
    for stage, marker in MARKERS.items():
        assert (exp / marker).is_file(), f"{stage}: {marker} missing"
        assert (exp / marker).with_name("provenance.json").is_file(), f"{stage}: provenance.json missing"
    assert list((exp / "curate").glob("train-*.parquet"))
    assert list((exp / "extract").glob("shard-*.safetensors"))
    assert (exp / "train" / "dflash" / "drafter" / "config.json").is_file()
    for png in ("tokens_per_s.png", "ddtree_budget.png", "acceptance_hist.png", "acceptance_by_position.png"):
        assert (exp / "report" / png).stat().st_size > 1000


def test_report_rows_cover_every_method(smoke_repo: Path) -> None:
    with open(smoke_repo / "results" / "smoke" / "report" / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    ours = {(r["method"], r["budget"]) for r in rows if r["engine"] == "draftforge" and r["status"] == "ok"}
    assert {m for m, _ in ours} >= {"ar", "dflash", "ddtree"}
    assert len({b for m, b in ours if m == "ddtree"}) >= 2
    vllm = {r["method"] for r in rows if r["engine"] == "vllm" and r["status"] == "ok"}
    assert {"ar", "ngram", "dflash"} <= vllm
    for r in rows:
        if r["status"] == "ok" and r["method"] in ("dflash", "ddtree") and r["engine"] == "draftforge":
            assert float(r["tau"]) >= 1.0
            if float(r["temperature"]) == 0.0:
                assert int(float(r["lossless_mismatches"])) == 0
    text = (smoke_repo / "results" / "smoke" / "report" / "summary.md").read_text()
    assert "| dataset |" in text and "#/experiments/" in text
    assert "τ vLLM" in text  # the parity section: report compares both engines' DFlash τ


def test_sampled_rows_in_both_engines_and_the_lossless_check_on_the_real_target(smoke_repo: Path) -> None:
    """experiment=smoke samples mt_bench at T = 1 (evaluate.sampled_datasets): both engines have its rows on the
    same prompts, the parity check runs at T = 1 too, and the PIT test of the real target's T = 1 tokens passes
    where there are enough of them (the tree method: both budgets and the calibration prompt pooled)."""
    exp = smoke_repo / "results" / "smoke"
    with open(exp / "report" / "summary.csv") as fh:
        sampled = [r for r in csv.DictReader(fh) if float(r["temperature"]) == 1.0 and r["status"] == "ok"]
    assert {(r["engine"], r["dataset"]) for r in sampled} == {("draftforge", "mt_bench"), ("vllm", "mt_bench")}
    assert {r["method"] for r in sampled if r["engine"] == "vllm"} >= {"ar", "dflash"}
    checks = {c["method"]: c for c in json.loads((exp / MARKERS["evaluate"]).read_text())["sampling_checks"]}
    assert set(checks) == {"ar", "dflash", "ddtree"} and all(c["temperature"] == 1.0 for c in checks.values())
    assert checks["ddtree"]["passed"] is True and checks["ddtree"]["n"] >= 100, checks["ddtree"]
    assert all(c["passed"] is not False for c in checks.values()), checks
    # every vLLM engine warmed up at both temperatures before its timed requests (a sampled request's one-time
    # cost would otherwise land in the T = 1 rows)
    records = {m: json.loads((exp / "baselines" / "dflash" / f"{m}.json").read_text()) for m in ("ar", "ngram", "dflash")}
    assert {m: r.get("warmup_temperatures") for m, r in records.items()} == {m: [0.0, 1.0] for m in records}
    parity = json.loads((exp / "report" / "parity.json").read_text())
    assert parity["dflash_T1"]["temperature"] == 1.0 and "mt_bench" in parity["dflash_T1"]["datasets"]
    text = (exp / "report" / "summary.md").read_text()
    assert "## Lossless at T > 0" in text and "T = 1 · `ddtree`" in text and "FAILED" not in text


def test_vllm_rows_are_rederived_from_the_engine_counters(smoke_repo: Path) -> None:
    """vLLM on the real target (ar / ngram / dflash): each row's τ and per-position acceptance re-derived from the raw
    counter snapshots the worker stored around its segment; greedy speculation reproduces AR's tokens; every prompt
    runs to max_new_tokens (special tokens silenced); the n-gram lookup gets drafts accepted on the code set; the
    MLflow runs carry the rows' τ."""
    from draftforge.baselines import metrics as M

    out = smoke_repo / "results" / "smoke" / "baselines" / "dflash"
    marker = json.loads((out / "baselines.json").read_text())
    rows = {(r["method"], r["dataset"], r["temperature"]): r for r in marker["rows"]}
    for method in ("ar", "ngram", "dflash"):
        rec = json.loads((out / f"{method}.json").read_text())
        k = rec["num_speculative_tokens"] or 0
        for seg in rec["segments"]:
            row = rows[(method, seg["dataset"], seg["temperature"])]
            d = M.delta(seg["metrics_before"], seg["metrics_after"])
            acc = M.acceptance(d)
            n_out = sum(p["n_output"] for p in seg["prompts"])
            assert all(p["n_output"] == marker["max_new_tokens"] for p in seg["prompts"]), (method, seg["dataset"])
            assert d["counters"][M.GENERATION_TOKENS] == n_out and M.check_consistency(acc) == []
            assert row["num_drafts"] == acc["num_drafts"]
            if acc["num_drafts"]:  # (no draft at all: τ is undefined, the row says None)
                assert row["tau"] == pytest.approx(acc["tau"])
            if seg["temperature"] == 0.0:
                assert row["lossless_mismatches"] == 0, f"{method}: greedy fp32 speculation changed the output"
            if method == "dflash":  # a model drafter verifies one draft of k tokens every decode step
                assert acc["num_draft_tokens"] == acc["num_drafts"] * k
                assert n_out <= len(seg["prompts"]) + acc["num_drafts"] + acc["num_accepted_tokens"] < n_out + len(seg["prompts"]) * (1 + k)
                assert row["acceptance_per_pos"] == pytest.approx(acc["acceptance_per_pos"]) and len(acc["accepted_per_pos"]) == k
    assert rows[("ngram", "humaneval", 0.0)]["tau"] > 1.0, "the code prompt repeats itself: n-gram drafts must get accepted"
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{smoke_repo / 'results' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["draftforge/smoke"], filter_string="tags.stage = 'baselines'")
    ngram = runs[(runs["tags.method"] == "ngram") & (runs["tags.dataset"] == "humaneval")]
    assert set(runs["tags.engine"]) == {"vllm"} and len(ngram) == 1
    assert ngram.iloc[0]["metrics.tau"] == pytest.approx(rows[("ngram", "humaneval", 0.0)]["tau"])


def planned(repo: Path, *config: str, extra: tuple[str, ...] = ()) -> set[str]:
    result = snakemake(repo, "-n", "--config", "experiment=smoke", *config, *extra, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    if "Nothing to be done" in out:
        return set()
    table = out.split("Job stats:", 1)[1]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+$", table, flags=re.M)} - {"total", "all"}


def test_reruns_follow_configs(smoke_repo: Path) -> None:
    """On a real finished run (the stage table's rerun rules on touched outputs: tests/unit/test_snakemake_dag.py):
    nothing to do with the same config, a budget change reruns evaluate and report only, a second branch plans
    its own jobs."""
    assert planned(smoke_repo) == set()
    assert planned(smoke_repo, "overrides=[\"evaluate.budgets=[2,4]\"]") == {"evaluate", "report"}
    # a second drafter branch: its own train/evaluate/baselines jobs; extract reruns because DSpark reads the
    # target's last layer (the derived `stores_last_layer` param)
    plan = snakemake(smoke_repo, "-n", "--config", "experiment=smoke", "overrides=[\"drafters=[dflash,dspark]\"]", timeout=600)
    assert plan.returncode == 0, plan.stderr
    assert "results/smoke/train/dspark/metrics.json" in plan.stdout and "extract" in plan.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium not installed (scripts/setup.sh --test installs it)")
def test_mlflow_ui_shows_the_smoke_runs(smoke_repo: Path) -> None:
    import mlflow

    db = smoke_repo / "results" / "mlflow.db"
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    exp = mlflow.get_experiment_by_name("draftforge/smoke")
    runs = mlflow.search_runs(experiment_ids=[exp.experiment_id])
    assert set(runs["tags.stage"]) >= set(STAGES)
    port = _free_port()
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{db}", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        shot = smoke_repo / "results" / "smoke" / "report" / "mlflow_ui.png"
        page = f"{url}/#/experiments/{exp.experiment_id}/runs"
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={smoke_repo / 'chromium-profile'}",
                 "--window-size=1600,1000", "--virtual-time-budget=20000"]  # fmt: skip
        dom = subprocess.run(["chromium", *flags, "--dump-dom", page], capture_output=True, text=True, timeout=180).stdout
        subprocess.run(["chromium", *flags, f"--screenshot={shot}", page], capture_output=True, timeout=180)
        assert shot.is_file() and shot.stat().st_size > 10_000
        assert "draftforge/smoke" in dom and "Training runs" in dom
        run_names = set(runs["tags.mlflow.runName"])
        shown = {name for name in run_names if name in dom}
        assert len(shown) >= 10, f"run names not on the page: {sorted(run_names - shown)[:10]}"
        assert any("humaneval/ddtree@" in n for n in shown) and any("/vllm-" in n for n in shown)  # <branch>/<dataset>/...
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_a_plugin_drafter_type_runs_through_the_dag(smoke_repo: Path) -> None:
    """A new drafter type is one module on PYTHONPATH plus one drafter file: tests/plugins/toy_drafter.py (the
    DFlash model under the name `toy`, measuring its dflash chain only, no vLLM method but AR) trains,
    evaluates, runs its baselines and joins the report without a draftforge module edited; the stages that
    serve every branch (target, curate, extract) do not rerun. Runs last: it adds a branch to the smoke repo."""
    text = (PLUGINS / "toy_drafter.py").read_text()
    toy_yaml = re.search(r'TOY_YAML = "(.*)"', text).group(1).encode().decode("unicode_escape")
    (smoke_repo / "conf" / "drafter" / "toy.yaml").write_text(toy_yaml)
    exp = smoke_repo / "results" / "smoke"
    shared = {s: (exp / MARKERS[s]).stat().st_mtime_ns for s in ("target", "curate", "extract")}
    result = snakemake(smoke_repo, "--config", "experiment=smoke", "overrides=[\"drafters=[dflash,toy]\"]",
                       pythonpath=str(PLUGINS))
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in (exp / "logs").glob("*toy*.log"))
        pytest.fail(f"toy branch failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{logs}")
    assert {s: (exp / MARKERS[s]).stat().st_mtime_ns for s in shared} == shared
    assert (exp / "train" / "toy" / "drafter" / "config.json").is_file()
    rows = json.loads((exp / "evaluate" / "toy" / "evaluate.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"ar", "dflash"} and {r["drafter"] for r in rows} == {"toy"}
    vllm = json.loads((exp / "baselines" / "toy" / "baselines.json").read_text())["rows"]
    assert {r["method"] for r in vllm} == {"ar"}
    with open(exp / "report" / "summary.csv") as fh:
        report = list(csv.DictReader(fh))
    assert {(r["engine"], r["method"]) for r in report if r["drafter"] == "toy"} >= {("draftforge", "dflash"), ("draftforge", "ar")}
    parity = json.loads((exp / "report" / "parity.json").read_text())
    assert parity["toy"]["method"] == "dflash" and set(parity) == {"dflash", "toy", "dflash_T1", "toy_T1"}
