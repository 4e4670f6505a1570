"""The DAG builds for every experiment, and reruns follow the configs (Snakemake's own dry-run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftforge.config import compose
from draftforge.stages import PER_DRAFTER, STAGE_MARKERS, STAGE_TABLE, STAGES

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def dry_run(results_root: Path, *config: str, extra: tuple[str, ...] = ()) -> str:
    cmd = [SNAKEMAKE, "-n", "--cores", "2", "--config", f"results_root={results_root}", *config, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def planned_jobs(output: str) -> dict[str, int]:
    table = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, flags=re.M) if m.group(1) != "total"}


@pytest.mark.parametrize("experiment", ["default", "smoke"])
def test_dag_builds(tmp_path: Path, experiment: str) -> None:
    jobs = planned_jobs(dry_run(tmp_path, f"experiment={experiment}"))
    branches = len(compose(experiment).drafters)  # default: dflash_aw, dspark, mtp; smoke: dflash
    assert jobs == {**{stage: branches if stage in PER_DRAFTER else 1 for stage in STAGES}, "all": 1}


def test_stage_commands_carry_only_their_overrides(tmp_path: Path) -> None:
    output = dry_run(tmp_path, "experiment=smoke", 'overrides=["evaluate.num_prompts=3"]', extra=("-p",))
    commands = [line for line in output.splitlines() if "-m draftforge." in line]
    by_stage = {re.search(r"-m draftforge\.(\w+)", c).group(1): c for c in commands}
    assert set(by_stage) == set(STAGES)
    readers = {"evaluate", "baselines"}  # baselines runs on as many prompts of the same sets
    for stage in STAGES:
        assert ("evaluate.num_prompts=3" in by_stage[stage]) == (stage in readers), by_stage[stage]
        assert by_stage[stage].count("results_root=") == 1


BRANCHES = ("dflash", "mtp")  # the finished copy's drafter branches: a tree type and a chain-only type
BRANCHES_OVERRIDE = f"drafters=[{','.join(BRANCHES)}]"


@pytest.fixture(scope="module")
def finished_copy(tmp_path_factory) -> Path:
    """A copy of the workflow whose every stage is marked finished (`--touch --forceall` records each job's
    params as Snakemake's metadata), so dry-runs show exactly what a config change reruns."""
    repo = tmp_path_factory.mktemp("finished")
    for name in ("Snakefile", "conf", "workflow"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, repo / name)
    for stage, marker in STAGE_MARKERS.items():
        for branch in BRANCHES if stage in PER_DRAFTER else ("",):
            path = repo / "results" / "smoke" / stage / branch / marker
            path.parent.mkdir(parents=True)
            path.touch()
    run_snakemake(repo, "--touch", "--forceall", "--config", "experiment=smoke", f"results_root={repo / 'results'}",
                  f'overrides=["{BRANCHES_OVERRIDE}"]')
    return repo


def run_snakemake(repo: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([SNAKEMAKE, "--cores", "1", *args], capture_output=True, text=True, timeout=300, cwd=repo, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def rerun_jobs(repo: Path, *overrides: str) -> dict[str, int]:
    """Jobs per rule a dry-run plans after these overrides (on top of the finished copy's branches)."""
    overrides = (BRANCHES_OVERRIDE, *overrides)
    out = run_snakemake(repo, "-n", "--config", "experiment=smoke", f"results_root={repo / 'results'}", f"overrides={list(overrides)!r}".replace("'", '"'))
    return {} if "Nothing to be done" in out else {k: v for k, v in planned_jobs(out).items() if k != "all"}


def rerun(repo: Path, *overrides: str) -> set[str]:
    return set(rerun_jobs(repo, *overrides))


def test_reruns_touch_only_the_branches_whose_type_reads_the_key(finished_copy: Path) -> None:
    one_branch = {"train": 1, "evaluate": 1, "baselines": 1, "report": 1}
    assert rerun_jobs(finished_copy, "train.mtp_steps=5") == one_branch  # the mtp branch's head schedule
    assert rerun_jobs(finished_copy, "train.num_anchors=8") == one_branch  # the block drafter's loop only
    assert rerun_jobs(finished_copy, "drafter.markov_rank=64") == {}  # neither a dflash nor an mtp branch reads it
    assert rerun_jobs(finished_copy, "evaluate.mtp_drafts=2") == {"evaluate": 1, "report": 1}
    assert rerun_jobs(finished_copy, "evaluate.budgets=[2,4]") == {"evaluate": 1, "report": 1}  # mtp has no tree
    assert rerun_jobs(finished_copy, "train.seed=3") == {"train": 2, "evaluate": 2, "baselines": 2, "report": 1}


def test_reruns_follow_the_stage_table(finished_copy: Path) -> None:
    assert rerun(finished_copy) == set()
    # report computes the parity check from both engines' rows: an evaluate change reruns it
    assert rerun(finished_copy, "evaluate.budgets=[2,4]") == {"evaluate", "report"}
    assert rerun(finished_copy, "evaluate.num_prompts=2") == {"evaluate", "baselines", "report"}
    assert rerun(finished_copy, "evaluate.sampled_prompts=2") == {"evaluate", "baselines", "report"}  # vLLM's T > 0 prompts
    assert rerun(finished_copy, "evaluate.sampling_check.bins=20") == {"evaluate", "report"}
    assert rerun(finished_copy, "evaluate.chitchat.holdout_per_10k=200") == set(STAGES) - {"target"}
    assert rerun(finished_copy, "train.lr=0.001") == {"train", "evaluate", "baselines", "report"}
    assert rerun(finished_copy, "report.parity_tolerance=0.1") == {"report"}
    # the drafter's shape is its branch's: never curate or extract; the target's taps rerun everything after target
    assert rerun(finished_copy, "drafter.block_size=8") == {"train", "evaluate", "baselines", "report"}
    assert rerun(finished_copy, "target.drafter.n_taps=3") == set(STAGES)


def test_scheduler_resources_change_no_stage(finished_copy: Path) -> None:
    assert rerun(finished_copy, "resources.default.cpus=1", "resources.train.mem_mb=9000", "resources.report.runtime=5") == set()


def rule_blocks(output: str) -> dict[str, str]:
    """Each stage rule's block in a dry-run's output (its threads, resources, ...)."""
    return {stage: re.search(rf"^(?:local)?rule {stage}:\n((?:    .*\n)+)", output, flags=re.M).group(1) for stage in STAGES}


def test_rule_resources_come_from_the_config(tmp_path: Path) -> None:
    plain = rule_blocks(dry_run(tmp_path, "experiment=smoke", extra=("--forceall",)))
    for stage, block in plain.items():  # defaults: every core of the run (report: one), nothing else requested
        assert ("threads: 2" in block) == (stage != "report"), block
        assert not re.search(r"mem_mb=|runtime=|slurm_partition=", block), block
    overrides = ["resources.default.cpus=1", "resources.default.mem_mb=3000", "resources.extract.runtime=30",
                 "resources.train.cpus=2", "resources.train.partition=gpu", "resources.baselines.gpus=1"]  # fmt: skip
    output = dry_run(tmp_path, "experiment=smoke", f"overrides={overrides}".replace("'", '"'), extra=("--forceall", "-p"))
    set_ = rule_blocks(output)
    assert [s for s, b in set_.items() if "gpu=1" in b] == ["baselines"]
    baselines = next(line for line in output.splitlines() if "-m draftforge.baselines" in line)
    assert "torch.distributed" not in baselines  # a GPU for vLLM, not more processes
    assert "threads: 2" in set_["train"] and all("threads: 2" not in b for s, b in set_.items() if s != "train")
    assert all("mem_mb=3000" in b for b in set_.values())
    assert [s for s, b in set_.items() if "runtime=30" in b] == ["extract"]
    assert [s for s, b in set_.items() if "slurm_partition=gpu" in b] == ["train"]


def test_extract_fans_out_into_part_jobs_and_a_merge(tmp_path: Path) -> None:
    output = dry_run(tmp_path, "experiment=smoke", 'overrides=["extract.jobs=3","extract.gpus=2"]', extra=("-p",))
    jobs = planned_jobs(output)
    assert jobs["extract_part"] == 3 and jobs["extract"] == 1
    extract = stage_commands(output, "extract")
    parts = sorted(int(m.group(1)) for c in extract if (m := re.search(r"extract\.part=(\d+)", c)))
    assert parts == [0, 1, 2]
    assert all("launch --nodes 1 --procs 2 --gpus extract" in c for c in extract if "extract.part=" in c)  # its GPUs
    merge = [c for c in extract if "extract.part=" not in c]
    assert len(merge) == 1 and "draftforge.launch" not in merge[0]  # the merge: one process, no GPU
    train = stage_commands(output, "train")[0]
    assert "extract.jobs" not in train  # the shards train reads are the same for any number of parts


def stage_commands(output: str, stage: str) -> list[str]:
    """The dry-run's shell commands of `stage`: `-m draftforge.<stage>` or through `-m draftforge.launch`."""
    pattern = rf"-m draftforge\.(?:{stage}|launch --nodes \d+ --procs \d+(?: --gpus)? {stage}) "
    return [line for line in output.splitlines() if re.search(pattern, line)]


def test_multi_process_jobs_ask_slurm_for_one_task_per_process(tmp_path: Path) -> None:
    """train.nodes x cpu_procs processes: the rule asks for that many tasks (srun-started by draftforge.launch) of
    threads / procs CPUs each; one-process stages ask for no tasks (the profile's `srun -n1` runs them)."""
    overrides = '["train.cpu_procs=2","train.nodes=3","resources.default.cpus=1","resources.train.cpus=2"]'
    output = dry_run(tmp_path, "experiment=smoke", f"overrides={overrides}", extra=("--forceall", "-p"))
    blocks = rule_blocks(output)
    assert re.search(r"mpi=srun, tasks=6, cpus_per_task=1, nodes=3\b", blocks["train"]), blocks["train"]
    assert all("tasks=" not in b and "mpi=" not in b for s, b in blocks.items() if s != "train")
    (train,) = stage_commands(output, "train")
    assert "-m draftforge.launch --nodes 3 --procs 2 train experiment=smoke" in train
    assert "OMP_NUM_THREADS=$(( 2 > 2 ? 2 / 2 : 1 ))" in train  # each process: its share of the job's threads
    one_per_node = rule_blocks(dry_run(tmp_path, "experiment=smoke", 'overrides=["train.nodes=2"]', extra=("--forceall",)))
    assert re.search(r"mpi=srun, tasks=2, cpus_per_task=2, nodes=2\b", one_per_node["train"]), one_per_node["train"]


def test_a_cluster_run_without_cpus_fails_at_parse_naming_the_key(tmp_path: Path) -> None:
    """The slurm profile's runs have no --cores: a stage's threads must come from the config (nothing submitted)."""
    cmd = [SNAKEMAKE, "--workflow-profile", "profiles/slurm", "--config", "experiment=smoke", f"results_root={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ})
    assert result.returncode != 0
    assert "rule target: a cluster run has no --cores; set resources.default.cpus" in result.stdout + result.stderr
    assert "submitted" not in result.stdout + result.stderr


def test_every_stage_reads_what_the_table_declares() -> None:
    output = dry_run(Path("/nonexistent-results"), "experiment=smoke", extra=("--forceall",))
    for stage in STAGE_TABLE:
        block = re.search(rf"^(?:local)?rule {stage.name}:\n((?:    .*\n)+)", output, flags=re.M).group(1)
        inputs = re.search(r"input: (.*)", block)
        # results/smoke/<stage>[/<drafter>]/<marker>: the stage is the path part after the experiment
        declared = [Path(p).parts[Path(p).parts.index("smoke") + 1] for p in inputs.group(1).split(", ")] if inputs else []
        assert declared == list(stage.inputs), stage.name


@pytest.mark.parametrize(
    ("override", "named"),
    [("evaluate.budgets=[0]", "evaluate.budgets"), ("train.device=tpu", "train.device"),
     ("evaluate.chitchat.holdout_per_10k=-1", "evaluate.chitchat.holdout_per_10k")],
)  # fmt: skip
def test_a_bad_value_fails_the_dry_run_naming_the_key(tmp_path: Path, override: str, named: str) -> None:
    cmd = [SNAKEMAKE, "-n", "--cores", "1", "--config", f"results_root={tmp_path}", f'overrides=["{override}"]']
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ})
    assert result.returncode != 0
    assert f"{named}: " in result.stdout + result.stderr
    assert "Job stats" not in result.stdout  # nothing was planned, let alone run


def test_the_workflow_parse_imports_no_torch() -> None:
    """Every Snakemake run parses the Snakefile (a cluster job parses it again inside the job): what it imports
    from draftforge, and the config compose it runs, stay torch-free (torch alone is ~3 s of each parse)."""
    sources = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
    modules = sorted({m for p in sources for m in re.findall(r"^from (draftforge[\w.]*) import", p.read_text(), re.M)})
    assert "draftforge.config" in modules and "draftforge.paths" in modules, modules
    code = "\n".join([*(f"import {m}" for m in modules), "import sys",
                      "from draftforge.config import branch_overrides, compose",
                      "for exp in ('default', 'smoke'):",
                      "    for d in compose(exp).drafters: compose(exp, branch_overrides(str(d)))",
                      "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"])  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
