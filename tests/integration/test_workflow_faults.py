"""What a new user hits when driving the workflow, checked with the real Snakemake and real stages on
tiny inputs: a results_root with a space, the project profile found by a bare `snakemake`, evaluate
and baselines never measuring speed at the same time, the README's MLflow searches, and the
`--unlock` path after a killed snakemake."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baselines_fixtures import fake_vllm  # noqa: E402
from draftforge.io import write_json  # noqa: E402
from evaluate_fixtures import tiny_pipeline  # noqa: E402
from workflow_fixtures import BIN, REPO, snakemake, workflow_copy, workflow_env  # noqa: E402

pytestmark = pytest.mark.integration
PROFILE_LINE = "Using workflow specific profile profiles/default"
OVERRIDES = ["target=tiny-random", "evaluate.datasets=[humaneval]", "evaluate.num_prompts=1", "evaluate.max_new_tokens=4",
             "evaluate.methods=[ar,ddtree]", "evaluate.budgets=[4]", "evaluate.warmup=0"]  # fmt: skip


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """evaluate + baselines through a bare `snakemake --cores 8` (2 threads each, so only the profile's
    `timing` resource can keep them apart), under a results_root whose name has a space."""
    base = tmp_path_factory.mktemp("wf")
    wf = workflow_copy(base / "repo")
    stray = base / "my"  # what an unquoted `> my results/...` would write to
    stray.write_text("the user's file\n")
    root = base / "my results"
    tiny_pipeline(root)
    for stage, name in (("curate", "manifest.json"), ("extract", "index.json")):
        write_json(root / "smoke" / stage / name, {"note": "test fixture"})
    for i, rel in enumerate(("target/target.json", "curate/manifest.json", "extract/index.json", "train/dflash/metrics.json")):
        os.utime(root / "smoke" / rel, (1e9 + i, 1e9 + i))  # upstream finished in order: only evaluate/baselines run
    fake = fake_vllm(base / "novllm", "raise ImportError('no vLLM in this test')\n")  # baselines records skips, fast
    env = workflow_env(PYTHONPATH=str(fake))
    targets = [str(root / "smoke" / "evaluate" / "dflash" / "evaluate.json"),
               str(root / "smoke" / "baselines" / "dflash" / "baselines.json")]
    args = [*targets, "--cores", "8", "--set-threads", "evaluate=2", "baselines=2", "--rerun-triggers", "mtime",
            "--config", "experiment=smoke", f"results_root={root}", "overrides=" + json.dumps(OVERRIDES)]  # fmt: skip
    # First a run killed mid-job (a closed terminal): it leaves Snakemake's lock behind.
    proc = subprocess.Popen([str(BIN / "snakemake"), *args], cwd=wf, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((root / "smoke" / "logs").glob("*.log")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    had_lock = bool(list((wf / ".snakemake" / "locks").glob("*")))
    locked = snakemake(wf, *args, env=env)
    unlock = snakemake(wf, "--cores", "all", "--unlock")  # the README's command
    started = time.monotonic()
    result = snakemake(wf, *args, env=env)
    print(f"evaluate + baselines via snakemake: {time.monotonic() - started:.0f} s")
    return {"wf": wf, "root": root, "stray": stray, "result": result, "had_lock": had_lock, "locked": locked, "unlock": unlock}


def _ok(ran: dict) -> None:
    r = ran["result"]
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in (ran["root"] / "smoke" / "logs").glob("*.log"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs


def test_results_root_with_a_space_is_quoted(ran):
    _ok(ran)
    assert ran["stray"].read_text() == "the user's file\n"
    for stage in ("evaluate", "baselines"):
        log = (ran["root"] / "smoke" / "logs" / f"{stage}-dflash.log").read_text()
        assert f"draftforge.{stage}" in log, log[-2000:]  # the stage's own output went to its log
    assert (ran["root"] / "smoke" / "evaluate" / "dflash" / "evaluate.json").is_file()


def test_bare_snakemake_uses_the_project_profile(ran):
    assert PROFILE_LINE in ran["result"].stderr
    dry = snakemake(ran["wf"], "-n", "--cores", "1")
    assert dry.returncode == 0 and PROFILE_LINE in dry.stderr, dry.stderr[-2000:]


def _jobs_never_overlap(log: Path) -> set[str]:
    """Replay Snakemake's job log: at most one job running at any time; returns the rules started."""
    running: dict[str, str] = {}
    started: set[str] = set()
    rule = None
    for line in log.read_text().splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            rule = m.group(1)
        elif (m := re.match(r"^\s+jobid: (\d+)$", line)) and rule:
            running[m.group(1)] = rule
            started.add(rule)
            assert len(running) == 1, f"jobs running together: {sorted(running.values())}\n{log.read_text()}"
            rule = None
        elif m := re.match(r"^Finished jobid: (\d+)", line):
            running.pop(m.group(1), None)
    return started


def test_evaluate_and_baselines_never_overlap(ran):
    _ok(ran)
    logs = sorted((ran["wf"] / ".snakemake" / "log").glob("*.snakemake.log"))
    started = [_jobs_never_overlap(log) for log in logs]
    assert {"evaluate", "baselines"} in started, started


def test_readme_mlflow_searches_run_on_a_real_store(ran):
    import mlflow

    _ok(ran)
    readme = (REPO / "README.md").read_text()
    filters = re.findall(r"`((?:tags|metrics|params|attributes)\.\w+ (?:=|!=|LIKE|ILIKE|IN|<|>)[^`]*)`", readme)
    assert filters, "README has no MLflow search examples"
    mlflow.set_tracking_uri(f"sqlite:///{ran['root'] / 'mlflow.db'}")
    found = {}
    for query in filters:
        runs = mlflow.search_runs(experiment_names=["draftforge/smoke"], filter_string=query)  # raises if MLflow rejects it
        found[query] = set(runs["tags.stage"]) if len(runs) else set()
    side_by_side = next(q for q in filters if "humaneval" in q)
    assert found[side_by_side] == {"evaluate", "baselines"}, found
    assert found["tags.method = 'ddtree'"] == {"evaluate"}, found


def test_unlock_after_a_killed_snakemake(ran):
    """The README's path: a SIGKILLed snakemake leaves its lock; `--unlock`, then the same command runs."""
    assert ran["had_lock"], "the killed run left no lock (the test did not kill it mid-run)"
    locked = ran["locked"]
    assert locked.returncode != 0 and "--unlock" in locked.stderr + locked.stdout
    assert ran["unlock"].returncode == 0, ran["unlock"].stderr[-2000:]
    _ok(ran)  # the same command after --unlock: finishes (the profile's rerun-incomplete)
