"""draftforge.launch: how a multi-process stage starts (torchrun here, srun tasks in a SLURM job) and the rank
contract each srun task derives from SLURM's variables. The srun path itself runs against a real slurmctld in
tests/integration/test_pipeline_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftforge.launch import RANKS_FROM, first_host, launch_argv, ranks_from_slurm


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node3", "node3"), ("node3,node4", "node3"), ("gpu[07-09,12],cpu1", "gpu07"), ("a[1-2]-ib", "a1-ib"),
     ("x[5]", "x5")],
)
def test_first_host_of_a_slurm_hostlist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_ranks_come_from_the_srun_task() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "2(x2)"}  # fmt: skip
    got = ranks_from_slurm(env)
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123)}  # fmt: skip
    # every task of the job agrees on the rendezvous; another job gets another port
    assert ranks_from_slurm({**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})["MASTER_PORT"] == got["MASTER_PORT"]
    assert ranks_from_slurm({**env, "SLURM_JOB_ID": "124"})["MASTER_PORT"] != got["MASTER_PORT"]


def test_outside_an_srun_task_the_mapping_names_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="SLURM_PROCID, SLURM_LOCALID unset"):
        ranks_from_slurm({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})


def test_a_local_run_starts_torchrun_on_this_machine() -> None:
    argv = launch_argv(1, 2, False, "train", ["experiment=smoke"], {})
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                    "draftforge.train", "experiment=smoke"]  # fmt: skip


def test_inside_a_job_step_processes_share_that_step() -> None:
    """The profile's one-process jobs run in `srun -n1`: a step inside a step would wait for CPUs it holds."""
    argv = launch_argv(1, 2, True, "train", [], {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0"})
    assert argv[2] == "torch.distributed.run"


def test_several_nodes_outside_slurm_is_one_line_naming_the_key() -> None:
    with pytest.raises(SystemExit, match=r"train\.nodes=2: several nodes run only inside a SLURM job that holds 4"):
        launch_argv(2, 2, False, "train", [], {})


def test_srun_tasks_take_their_ranks_before_the_stage_reads_them(tmp_path) -> None:
    """cli (every stage's entry) maps the task's SLURM variables before it reads RANK / WORLD_SIZE."""
    env = {"PATH": "/usr/bin:/bin", **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}, RANKS_FROM: "slurm", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
           "SLURM_LOCALID": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}  # fmt: skip
    code = "import os, draftforge.cli; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "2", "n1"]


def test_bad_arguments_are_one_usage_line() -> None:
    result = subprocess.run([sys.executable, "-m", "draftforge.launch", "--nodes", "0", "--procs", "2", "train"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "--nodes 0 --procs 2: both must be >= 1" in result.stderr
