"""What each stage's job asks the scheduler for: the `resources` config section (torch-free).

`resources.default` applies to every stage; `resources.<stage>` overrides it field by field (a field at 0 / ""
inherits the default's). The Snakemake rules read `stage_resources` (workflow/rules/stages.smk): `cpus` is the
rule's threads (SLURM --cpus-per-task), `mem_mb` / `runtime` / `partition` become the rule's `mem_mb`, `runtime`
and `slurm_partition` resources. GPUs are not here: a stage's `<stage>.gpus` decides its processes (torchrun
ranks), so it is part of what the stage computes, and the rule requests `gpu=<stage>.gpus` from it.

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
            for name in ("cpus", "mem_mb", "runtime"):
                value = getattr(getattr(self, section.name), name)
                check(value >= 0, f"resources.{section.name}.{name}", f"{value} must be >= 0 (0 = not set)")


# One field per stage of the stage table (plus `default`): a new stage needs its field here.
assert [f.name for f in fields(ResourcesConfig)] == ["default", *STAGES], "ResourcesConfig must list every stage"


def stage_resources(resources: Any, stage: str) -> StageResources:
    """`resources.<stage>` with each unset field (0 / "") taken from `resources.default`.

    `resources` is the ResourcesConfig or the composed DictConfig node (attribute access either way).
    """
    own, default = getattr(resources, stage), resources.default
    merged = {f.name: getattr(own, f.name) or getattr(default, f.name) for f in fields(StageResources)}
    return StageResources(**merged)
