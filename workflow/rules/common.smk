# Shared by every rule: the composed config, paths, and the command that launches a stage.
import shlex
from snakemake.exceptions import WorkflowError
from draftforge.config import branch_overrides, stage_overrides
from draftforge.drafter.registry import ignored_keys
from draftforge.paths import part_marker, stage_dir, stage_marker
from draftforge.resources import stage_resources
from draftforge.stages import PER_DRAFTER, STAGE_BY_NAME, STAGE_TABLE, stage_inputs

EXPERIMENT = str(config.get("experiment", "default"))
_raw_overrides = config.get("overrides") or []
OVERRIDES = [str(o) for o in (_raw_overrides if isinstance(_raw_overrides, list) else shlex.split(str(_raw_overrides)))]
_root_override = [f"results_root={Path(config['results_root']).resolve()}"] if config.get("results_root") else []
CFG = compose(EXPERIMENT, OVERRIDES + _root_override)
RESULTS = Path(CFG.results_root)
PYTHON = sys.executable
# The drafter branches (conf/drafter/<name>.yaml): train / evaluate / baselines run once per name, each
# composed with drafter=<name> on top of the same overrides.
DRAFTERS = [str(d) for d in CFG.drafters]
BRANCH_CFG = {d: compose(EXPERIMENT, OVERRIDES + _root_override + branch_overrides(d)) for d in DRAFTERS}


def cfg_of(drafter=None):
    return BRANCH_CFG[drafter] if drafter else CFG


def marker(stage, drafter=None):
    """The stage's marker; a per-drafter stage's with drafter=None is the wildcard pattern."""
    return str(stage_marker(RESULTS, EXPERIMENT, stage, (drafter or "{drafter}") if stage in PER_DRAFTER else None))


# extract.jobs = K > 1: K extract_part jobs (part k: the k-th contiguous range of the plan's shards), then the
# `extract` job merges their done shards into index.json, as one CPU process (draftforge.extract.parts).
EXTRACT_JOBS = int(CFG.extract.jobs)


def merges(stage):
    """The stage's own job only merges what its part jobs computed (extract with extract.jobs > 1)."""
    return stage == "extract" and EXTRACT_JOBS > 1


def rule_inputs(stage, drafter=None):
    """Upstream markers, and for a merging extract its parts' markers."""
    parts = [str(part_marker(RESULTS, EXPERIMENT, k)) for k in range(EXTRACT_JOBS)] if merges(stage) else []
    return upstream_markers(stage, drafter) + parts


def upstream_markers(stage, drafter=None):
    """Markers a stage reads: a branch reads its own branch upstream, a once-stage reads every branch."""
    out = []
    for up in stage_inputs(stage, cfg_of(drafter)):
        if up not in PER_DRAFTER:
            out.append(marker(up))
        elif drafter:
            out.append(marker(up, drafter))
        else:
            out += [marker(up, d) for d in DRAFTERS]
    return out


def stage_log(stage, drafter=None):
    return str(RESULTS / EXPERIMENT / "logs" / (f"{stage}-{drafter}.log" if drafter else f"{stage}.log"))


def stage_benchmark(stage, drafter=None):
    return str(RESULTS / EXPERIMENT / "benchmarks" / (f"{stage}-{drafter}.tsv" if drafter else f"{stage}.tsv"))


def params_of(stage, drafter=None):
    """The stage's resolved config as a plain dict: Snakemake reruns the stage when it changes."""
    return stage_params(cfg_of(drafter), stage)


def gpus(stage):
    """GPUs the stage's config asks for (its `gpus` key; stages without one run on CPU)."""
    return int(CFG[stage].get("gpus", 0)) if stage in CFG else 0


def stage_threads(stage):
    """The stage's threads: `resources.<stage>.cpus` (or `resources.default.cpus`) when set, else every core the
    run offers (`--cores`; report: 1). A cluster run has no `--cores`, so there a stage without cpus fails here,
    at parse time, naming the key (docs/cluster.md)."""
    cpus = stage_resources(CFG.resources, stage.name).cpus
    if cpus > 0:
        return cpus
    if not stage.all_cores:
        return 1
    try:
        return workflow.cores
    except WorkflowError:
        raise WorkflowError(f"rule {stage.name}: a cluster run has no --cores; set resources.default.cpus or "
                            f"resources.{stage.name}.cpus (docs/cluster.md)") from None


def scheduler_resources(stage):
    """The rule's `mem_mb`, `runtime` (minutes) and `slurm_partition` from `resources.<stage>`; each only when set,
    so an unset one leaves the profile's default-resources (and a local run) as they were."""
    res = stage_resources(CFG.resources, stage)
    out = {"mem_mb": res.mem_mb, "runtime": res.runtime, "slurm_partition": res.partition}
    return {key: value for key, value in out.items() if value}


def nprocs(stage):
    """Processes the stage runs as: one per GPU, else its `cpu_procs` (default 1)."""
    n_gpus = gpus(stage)
    return n_gpus if n_gpus > 0 else max(1, int(CFG[stage].get("cpu_procs", 1)) if stage in CFG else 1)


def nodes(stage):
    """Nodes a stage's processes span: `train.nodes` (a SLURM run only, draftforge.launch); every other stage one."""
    return int(CFG[stage].get("nodes", 1)) if stage in CFG else 1


def task_resources(stage):
    """A job of several processes asks SLURM for one task each (draftforge.launch starts them with srun): nodes x
    procs tasks of threads / procs CPUs (as OMP_NUM_THREADS splits them locally), one GPU each where the stage
    has GPUs. Nothing for a one-process job (the slurm profile's job step runs it with `srun -n1`). A local run
    reads none of these keys."""
    procs, n_nodes = job_nprocs(stage), 1 if merges(stage) else nodes(stage)
    if procs * n_nodes <= 1:
        return {}
    out = {"mpi": "srun", "tasks": procs * n_nodes, "cpus_per_task": lambda wildcards, threads: max(1, threads // procs)}
    if n_nodes > 1:
        out["nodes"] = n_nodes
    if gpus(stage):
        out["tasks_per_gpu"] = 1
    return out


def job_gpus(stage):
    """GPUs the stage's job requests: its own `gpus` (its processes) or else `resources.<stage>.gpus` (curate's or
    baselines' vLLM on CUDA; never more processes); none for a merge."""
    return 0 if merges(stage) else gpus(stage) * nodes(stage) or stage_resources(CFG.resources, stage).gpus


def job_nprocs(stage):
    return 1 if merges(stage) else nprocs(stage)


def stage_cmd(stage, drafter=None, part=None):
    """Shell command running one stage (one branch of a per-drafter stage, or one extract part); draftforge.launch
    (torchrun here, srun tasks in a SLURM job) when it spans several processes, nodes or GPUs. Holds only what
    the config decides (no core counts, nothing of where it runs), so it is safe to track in params.
    """
    ignored = ignored_keys(cfg_of(drafter).drafter) if drafter else ()  # keys the branch's type never reads
    args = [f"experiment={EXPERIMENT}", f"results_root={RESULTS}", *stage_overrides(stage, OVERRIDES, ignored),
            *branch_overrides(drafter), *([f"extract.part={part}"] if part is not None else [])]
    quoted = " ".join(shlex.quote(a) for a in args)
    n_procs, n_gpus = (job_nprocs(stage), 0 if merges(stage) else gpus(stage)) if part is None else (nprocs(stage), gpus(stage))
    n_nodes = 1 if merges(stage) and part is None else nodes(stage)
    if n_procs * n_nodes > 1 or n_gpus > 0:  # the stage's own GPUs: one process each
        gpu_flag = " --gpus" if n_gpus > 0 else ""
        launch = f"{shlex.quote(PYTHON)} -m draftforge.launch --nodes {n_nodes} --procs {n_procs}{gpu_flag}"
        return f"{launch} {stage} {quoted}"
    return f"{shlex.quote(PYTHON)} -m draftforge.{stage} {quoted}"


# The job's cores split over its processes (unset, Snakemake would leave each process 1 thread).
STAGE_SHELL = (
    "OMP_NUM_THREADS=$(( {threads} > {params.nproc} ? {threads} / {params.nproc} : 1 )) "
    "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind {params.cmd} > {log:q} 2>&1"
)
