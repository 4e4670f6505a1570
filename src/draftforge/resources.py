"""What each stage's job asks the scheduler for: the `resources` config section (torch-free).

`resources.default` applies to every stage; `resources.<stage>` overrides it field by field (a field at 0 / ""
inherits the default's). The Snakemake rules read `stage_resources` (workflow/rules/stages.smk): `cpus` is the
rule's threads (SLURM --cpus-per-task), `mem_mb` / `runtime` / `partition` become the rule's `mem_mb`, `runtime`
and `slurm_partition` resources. GPUs: a stage with its own `<stage>.gpus` (extract, train, evaluate: their torchrun
ranks, part of what they compute) requests those; `resources.<stage>.gpus` is only for the stages without one
(curate's and baselines' vLLM on CUDA), set per stage, and leaves their command as it is.

Invariant: no stage reads this section (it is in no stage's `sections`), so changing it never reruns a stage
and never enters a stage's command line; at its defaults a local run's DAG and jobs are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from draftforge.errors import check
from draftforge.stages import STAGES


@dataclass
class StageResources:
    # Threads of the stage's job (= SLURM --cpus-per-task, OMP_NUM_THREADS split over its processes).
    # 0 = every core the run offers (`--cores`; report: 1). A cluster run has no `--cores`: set it there.
    cpus: int = 0
    mem_mb: int = 0  # memory of the job in MB; 0 = not requested (Snakemake's default resources / the partition's)
    runtime: int = 0  # wall-time limit in minutes; 0 = not requested (the partition's limit)
    partition: str = ""  # SLURM partition; "" = the profile's `slurm_partition` / the cluster's default partition
    gpus: int = 0  # GPUs of a stage without its own `<stage>.gpus` key (per stage only; 0 = none)


@dataclass
class ResourcesConfig:
    default: StageResources = field(default_factory=StageResources)
    target: StageResources = field(default_factory=StageResources)
    curate: StageResources = field(default_factory=StageResources)
    extract: StageResources = field(default_factory=StageResources)
    train: StageResources = field(default_factory=StageResources)
    evaluate: StageResources = field(default_factory=StageResources)
    baselines: StageResources = field(default_factory=StageResources)
    report: StageResources = field(default_factory=StageResources)

    def __post_init__(self) -> None:
        for section in fields(self):
            for name in ("cpus", "mem_mb", "runtime", "gpus"):
                value = getattr(getattr(self, section.name), name)
                check(value >= 0, f"resources.{section.name}.{name}", f"{value} must be >= 0 (0 = not set)")
        check(self.default.gpus == 0, "resources.default.gpus", "GPUs are set per stage (resources.<stage>.gpus)")
        for stage in OWN_GPUS:
            gpus = getattr(self, stage).gpus
            check(gpus == 0, f"resources.{stage}.gpus", f"{gpus}: {stage}.gpus sets this stage's GPUs (its processes)")


# Stages whose own config has `gpus` (their processes): their job's GPUs come from there, never from here.
OWN_GPUS: tuple[str, ...] = ("extract", "train", "evaluate")

# One field per stage of the stage table (plus `default`): a new stage needs its field here.
assert [f.name for f in fields(ResourcesConfig)] == ["default", *STAGES], "ResourcesConfig must list every stage"


def stage_resources(resources: Any, stage: str) -> StageResources:
    """`resources.<stage>` with each unset field (0 / "") taken from `resources.default`.

    `resources` is the ResourcesConfig or the composed DictConfig node (attribute access either way).
    """
    own, default = getattr(resources, stage), resources.default
    merged = {f.name: getattr(own, f.name) or getattr(default, f.name) for f in fields(StageResources)}
    return StageResources(**merged)
