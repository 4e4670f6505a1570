"""How a stage runs as several processes: torchrun on one machine, or one SLURM task per process across nodes.

`python -m draftforge.launch --nodes N --procs P [--gpus] STAGE [hydra overrides...]` is the command of every multi-process
stage job (workflow/rules/common.smk `stage_cmd`). The command is the same for a local and a cluster run (so
Snakemake never reruns a stage for where it ran); what it starts is decided here, at run time:

- Inside a SLURM allocation that holds N x P tasks (the slurm profile's job of a multi-process stage asks for
  them): `srun` starts one task per process (P per node, OMP_NUM_THREADS CPUs and, with --gpus, one GPU each),
  and each task takes its rank, world size and rendezvous address from SLURM's environment
  (`ranks_from_slurm`): no torchrun, no agent, rank 0 hosts the store.
- Otherwise, with N = 1: `torchrun --standalone --nproc_per_node P`, as a local run always did.
- Otherwise (several nodes, no allocation holding them): one line saying so, exit status 2.

Invariant: whichever way they start, the processes see the same RANK / WORLD_SIZE / LOCAL_RANK contract
(draftforge.cli reads it), so the stage computes the same thing; a CPU test runs 2 SLURM tasks on one node
in place of 2 nodes (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

# Set by `launch` on the srun tasks it starts: each task maps SLURM's variables to torch's before the stage runs.
RANKS_FROM = "DRAFTFORGE_RANKS_FROM"
_PORT_BASE, _PORT_SPAN = 20000, 20000  # rendezvous port = base + job id mod span (distinct for concurrent jobs)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[07-09,12],cpu1' → 'gpu07'; 'node3,node4' → 'node3'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"SLURM nodelist {nodelist!r}: cannot read its first host")
    prefix, ranges, suffix = match.groups()
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]  # zero padding kept as written ('07')
    return prefix + first + suffix


def ranks_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's env:// contract from one srun task's SLURM variables."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID") if k not in env]
    if missing:
        raise RuntimeError(f"{RANKS_FROM}=slurm but {', '.join(missing)} unset: not an srun task")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    port = env.get("MASTER_PORT") or str(_PORT_BASE + int(env["SLURM_JOB_ID"]) % _PORT_SPAN)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist), "MASTER_PORT": port}


def apply_slurm_ranks() -> None:
    """In an srun task that `launch` started: set RANK etc. from SLURM's variables (cli.py calls this first)."""
    if os.environ.get(RANKS_FROM) == "slurm":
        os.environ.update(ranks_from_slurm(os.environ))


def slurm_tasks_available(env: Mapping[str, str]) -> int:
    """Tasks the enclosing SLURM job holds for new steps; 0 outside one, inside a job step already (the slurm
    profile's one-process jobs run in `srun -n1`: their processes share that step, as on one machine), or where
    srun / scontrol are missing. Read from `scontrol show job`: the Snakemake SLURM job step drops SLURM_NTASKS
    from the environment it gives a job."""
    job = env.get("SLURM_JOB_ID")
    if not job or "SLURM_STEP_ID" in env or shutil.which("srun") is None or shutil.which("scontrol") is None:
        return 0
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=dict(env))
    found = re.search(r"\bNumTasks=(\d+)", shown.stdout) if shown.returncode == 0 else None
    return int(found.group(1)) if found else 0


def launch_argv(nodes: int, procs: int, gpus: bool, stage: str, args: Sequence[str],
                env: Mapping[str, str]) -> list[str]:
    """The command that starts `stage` as nodes x procs processes here (see the module docstring)."""
    module = f"draftforge.{stage}"
    world = nodes * procs
    if slurm_tasks_available(env) >= world:
        threads = env.get("OMP_NUM_THREADS", "1")
        # --kill-on-bad-exit: one failed rank ends the others (no rank waits on a dead peer until its timeout)
        return ["srun", f"--nodes={nodes}", f"--ntasks={world}", f"--ntasks-per-node={procs}",
                f"--cpus-per-task={threads}", *(["--gpus-per-task=1"] if gpus else []), "--kill-on-bad-exit=1",
                f"--export=ALL,{RANKS_FROM}=slurm", sys.executable, "-m", module, *args]
    if nodes > 1:
        raise SystemExit(f"[draftforge.launch] {stage}.nodes={nodes}: several nodes run only inside a SLURM job that "
                         f"holds {world} tasks (snakemake --workflow-profile profiles/slurm, docs/cluster.md); "
                         f"a local run has one node: set {stage}.nodes=1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m", module,
            *args]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draftforge.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--procs", type=int, required=True, help="processes per node")
    parser.add_argument("--gpus", action="store_true", help="one GPU per process")
    parser.add_argument("stage")
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nodes < 1 or ns.procs < 1:
        parser.error(f"--nodes {ns.nodes} --procs {ns.procs}: both must be >= 1")
    return ns


def main(argv: Sequence[str]) -> None:
    ns = parse(argv)
    command = launch_argv(ns.nodes, ns.procs, ns.gpus, ns.stage, ns.overrides, os.environ)
    print(f"[draftforge.launch] {' '.join(command[:-len(ns.overrides) or None])} ...", file=sys.stderr, flush=True)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
