"""The smoke pipeline through `--workflow-profile profiles/slurm` on a one-node SLURM cluster (scripts/slurm_local.sh):
every stage runs as a SLURM job with the resources the config asks for, and what it computes (evaluate's tokens
and τ, extract's shard checksums) equals the local run's (the session's `smoke_repo`; both fixtures in tests/conftest.py).
Skipped, with the reason, where this machine cannot run slurmd (tests/slurm_fixtures.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from draftforge.stages import PER_DRAFTER, STAGE_MARKERS, STAGES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_fixtures import LocalSlurm  # noqa: E402
from workflow_fixtures import clean_copy, failure_report, pipeline_snakemake  # noqa: E402

# timeout: its first test may also run the session's local smoke pipeline (smoke_repo) before its own
# xdist_group: one pytest-xdist worker runs this module and its sibling (the local smoke and SLURM pipeline
# tests), so the session's smoke_repo and SLURM cluster are built once
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(7200),
              pytest.mark.xdist_group("smoke_pipeline")]

BRANCH = "dflash"  # experiment=smoke's one drafter branch
BUDGET = 8  # the one DDTree budget the SLURM run evaluates (experiment=smoke sweeps 4 and 8)
# Scheduler requests the test sets through the config (resources section), checked on the jobs SLURM ran.
MEM_MB, EXTRACT_RUNTIME_MIN = 3000, 30
# A row's computed values: what must match the local run (timings and the timing-chosen budgets never do).
ROW_KEY = ("dataset", "method", "budget", "temperature")
ROW_VALUES = ("status", "tau", "tau_histogram", "rounds", "decode_tokens", "n_responses", "lossless_mismatches")
RESPONSE_KEY = ("split", "repeat", "method", "budget", "temperature", "prompt_index", "turn")


def stage_dir(exp: Path, stage: str) -> Path:
    return exp / stage / BRANCH if stage in PER_DRAFTER else exp / stage


def job_comment(stage: str) -> str:
    """The comment snakemake-executor-plugin-slurm gives a rule's job (`rule_<name>[_wildcards_<values>]`)."""
    return f"rule_{stage}_wildcards_{BRANCH}" if stage in PER_DRAFTER else f"rule_{stage}"


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, slurm_cluster: LocalSlurm, smoke_repo: Path) -> dict[str, Any]:
    """The smoke experiment through the slurm profile, threads as the local run's (`--cores all` there)."""
    from snakemake.utils import available_cpu_count

    repo = clean_copy(tmp_path_factory.mktemp("slurm-clone"))
    results = repo / "slurm-results"  # results_root given on the command line
    cpus = min(available_cpu_count(), slurm_cluster.cpus)
    overrides = [f"resources.default.cpus={cpus}", "resources.report.cpus=1", f"resources.default.mem_mb={MEM_MB}",
                 f"resources.extract.runtime={EXTRACT_RUNTIME_MIN}",
                 # baselines runs as a SLURM job like every stage, its vLLM AR engine only (what it computes is not
                 # compared here, and each further engine costs ~40 s of CI): evaluate's rows are unaffected
                 "baselines.methods.ngram.enabled=false", "baselines.methods.dflash.enabled=false",
                 # CI time: T = 0, one tree budget, no calibration prompts. Each local row is computed apart from
                 # the others (a (temperature, method, budget) pass over the same prompts), and curate decontaminates
                 # against the whole evaluation sets whatever of them evaluate runs
                 "evaluate.temperatures=[0.0]", f"evaluate.budgets=[{BUDGET}]", "evaluate.calibration_prompts=0"]  # fmt: skip
    started = time.monotonic()
    result = pipeline_snakemake(
        repo, "--workflow-profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "2",
        "--slurm-no-account", "--config", "experiment=smoke", f"results_root={results}",
        f"overrides={json.dumps(overrides, separators=(',', ':'))}", cores=None, env=slurm_cluster.env,
    )  # fmt: skip
    wall = time.monotonic() - started
    if result.returncode != 0:
        pytest.fail(f"SLURM smoke pipeline failed:\n{failure_report(result, results / 'smoke' / 'logs')}")
    print(f"SLURM smoke pipeline wall time: {wall:.0f} s")
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", result.stdout + result.stderr)
    return {"exp": results / "smoke", "local": smoke_repo / "results" / "smoke", "jobs": submitted,
            "output": result.stdout + result.stderr}  # fmt: skip


def test_every_stage_ran_as_a_slurm_job(slurm_run: dict[str, Any], slurm_cluster: LocalSlurm) -> None:
    ours = {row["job"]: row for row in slurm_cluster.squeue() if row["job"] in set(slurm_run["jobs"])}
    by_stage = {stage: [r for r in ours.values() if r["comment"] == job_comment(stage)] for stage in STAGES}
    assert {s: len(rows) for s, rows in by_stage.items()} == {s: 1 for s in STAGES}, slurm_run["output"][-3000:]
    finished = slurm_cluster.jobcomp()  # slurmctld's own record of each finished job
    for stage, (row,) in by_stage.items():
        assert row["state"] == "COMPLETED", row
        assert finished[row["job"]]["JobState"] == "COMPLETED", finished.get(row["job"])
        assert (stage_dir(slurm_run["exp"], stage) / STAGE_MARKERS[stage]).is_file()
    # the config's resources section reached sbatch: memory everywhere, extract's wall time, report's own cpus
    assert {r["min_memory"] for (r,) in by_stage.values()} == {f"{MEM_MB}M"}
    assert by_stage["extract"][0]["time_limit"] == f"{EXTRACT_RUNTIME_MIN}:00"
    assert by_stage["report"][0]["cpus"] == "1"
    assert len(set(slurm_run["jobs"])) == len(STAGES)  # nothing ran outside SLURM, nothing twice


def _rows(evaluate_dir: Path) -> dict[tuple, dict[str, Any]]:
    rows = json.loads((evaluate_dir / "evaluate.json").read_text())["rows"]
    return {tuple(r[k] for k in ROW_KEY): {k: r.get(k) for k in ROW_VALUES} for r in rows}


def _responses(evaluate_dir: Path) -> dict[tuple, list[int]]:
    """Every response's token ids, from the per-dataset files (`<dataset>.json`) beside evaluate.json."""
    out: dict[tuple, list[int]] = {}
    for path in sorted(evaluate_dir.glob("*.json")):
        payload = json.loads(path.read_text())
        if path.name == "evaluate.json" or "responses" not in payload:
            continue
        for r in payload["responses"]:
            out[(path.stem, *(r.get(k) for k in RESPONSE_KEY))] = r["tokens"]
    return out


def _same_pass(key: tuple, fields: tuple[str, ...]) -> bool:
    """A local row or response of a pass the SLURM run also ran: T = 0, AR / chain (no budget) or BUDGET."""
    at = dict(zip(fields, key))
    return at["temperature"] == 0.0 and at["budget"] in (None, BUDGET) and at.get("split", "eval") == "eval"


def test_evaluate_tokens_and_tau_equal_the_local_run(slurm_run: dict[str, Any]) -> None:
    """Every row and response the SLURM run computed equals the local run's of the same pass."""
    ours, local = stage_dir(slurm_run["exp"], "evaluate"), stage_dir(slurm_run["local"], "evaluate")
    rows = _rows(ours)
    assert {k[ROW_KEY.index("method")] for k in rows} == {"ar", "dflash", "ddtree"}
    assert rows == {k: v for k, v in _rows(local).items() if _same_pass(k, ROW_KEY)}
    responses = _responses(ours)
    assert responses and responses == {k: v for k, v in _responses(local).items() if _same_pass(k, ("dataset", *RESPONSE_KEY))}


def test_extract_shard_checksums_equal_the_local_run(slurm_run: dict[str, Any]) -> None:
    def shards(exp: Path) -> dict[str, str]:
        index = json.loads((exp / "extract" / STAGE_MARKERS["extract"]).read_text())
        return {s["file"]: s["sha256"] for s in index["shards"]}

    assert shards(slurm_run["exp"]) and shards(slurm_run["exp"]) == shards(slurm_run["local"])


def _running_job(cluster: LocalSlurm, comment: str, seen: set[str]) -> str | None:
    return next((r["job"] for r in cluster.squeue() if r["comment"] == comment and r["state"] == "RUNNING"
                 and r["job"] not in seen), None)  # fmt: skip


def test_training_over_two_srun_tasks_resumes_after_scancel_and_follows_one_process(
    slurm_run: dict[str, Any], slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    """Training across nodes, with 2 SLURM tasks on this one node standing in for 2 nodes: draftforge.launch starts
    them with srun, each takes its rank and the rendezvous from SLURM's environment (gloo). The job is scancel'd
    mid-run; the rerun resumes from the checkpoint the kill left and ends on the loss curve of the 1-process run
    with the same global batch (slurm_run's train: 1 process x 2 sequences = 2 tasks x 1)."""
    exp = slurm_run["exp"]
    reference = json.loads((stage_dir(exp, "train") / STAGE_MARKERS["train"]).read_text())
    assert reference["world_size"] == 1 and reference["global_batch"] == 2
    repo = exp.parents[1]
    overrides = ["resources.default.cpus=2", "resources.report.cpus=1", f"resources.default.mem_mb={MEM_MB}",
                 "resources.train.cpus=2", "train.cpu_procs=2", "train.batch_seqs=1"]  # 2 tasks x 1 CPU
    cmd = [str(stage_dir(exp, "train") / STAGE_MARKERS["train"]),  # the target first: --config takes what follows it
           "--workflow-profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "2",
           "--slurm-no-account", "--config", "experiment=smoke", f"results_root={exp.parent}",
           f"overrides={json.dumps(overrides, separators=(',', ':'))}"]  # fmt: skip
    checkpoints = exp / ".work" / "train" / BRANCH / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # slurm_run's own (another resume key) would only be skipped
    seen = {r["job"] for r in slurm_cluster.squeue()}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(pipeline_snakemake, repo, *cmd, cores=None, env=slurm_cluster.env, timeout=1800)
        job, deadline = None, time.monotonic() + 1200
        while time.monotonic() < deadline and not first.done():  # scancel once the first checkpoint is on disk
            job = job or _running_job(slurm_cluster, job_comment("train"), seen)
            if job and list(checkpoints.glob("step-*.pt")):
                subprocess.run(["scancel", job], env=slurm_cluster.env, check=True, timeout=60)
                break
            time.sleep(0.2)
        killed = first.result()
    assert job is not None, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert killed.returncode != 0, "the train job finished before scancel reached it"
    assert not (stage_dir(exp, "train") / STAGE_MARKERS["train"]).exists()
    resumed = pipeline_snakemake(repo, *cmd, cores=None, env=slurm_cluster.env, timeout=1800)
    if resumed.returncode != 0:
        pytest.fail(f"rerun after scancel failed:\n{failure_report(resumed, exp / 'logs', 'train-*.log')}")
    log = (exp / "logs" / f"train-{BRANCH}.log").read_text()
    assert "[draftforge.launch] srun --nodes=1 --ntasks=2 --ntasks-per-node=2" in log
    step = re.search(r"resuming from \S+ \(step (\d+)\)", log)
    assert step and 0 < int(step.group(1)) < reference["steps"], log[-3000:]
    ours = json.loads((stage_dir(exp, "train") / STAGE_MARKERS["train"]).read_text())
    assert ours["world_size"] == 2 and ours["global_batch"] == 2 and ours["steps"] == reference["steps"]
    assert [h["step"] for h in ours["train_curve"]] == [h["step"] for h in reference["train_curve"]]
    losses = [(h["loss"], r["loss"]) for h, r in zip(ours["train_curve"], reference["train_curve"])]
    assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in losses), losses
