# One rule per row of the stage table (draftforge.stages.STAGE_TABLE): inputs are the upstream stages'
# markers, the output is the stage's marker, params track the stage's resolved config sections.
# Per-drafter stages (train, evaluate, baselines) are one rule with a {drafter} wildcard over the
# experiment's `drafters`; their params, command and inputs are the branch's (composed with drafter=<name>).
# extract and train keep finished shards / checkpoints in results/<exp>/.work/<stage>[/<drafter>] (never a
# declared output), so a failed or interrupted job resumes. timing=1: evaluate and baselines measure
# speed, so they never share the machine with each other (nor with another branch's).
# Threads, memory, wall time and partition come from the config's `resources` section (draftforge.resources),
# GPUs from the stage's own `gpus`: the profile sets none of them per rule (docs/cluster.md).

wildcard_constraints:
    drafter="|".join(re.escape(d) for d in DRAFTERS),
    part=r"\d+",


def _branch(stage, fn):
    """fn(stage) for a once-stage; for a per-drafter stage a function of the {drafter} wildcard."""
    if stage in PER_DRAFTER:
        return lambda wc: fn(stage, wc.drafter)
    return fn(stage)


for _stage in STAGE_TABLE:

    rule:
        name:
            _stage.name
        input:
            _branch(_stage.name, rule_inputs),
        output:
            marker(_stage.name),
        params:
            cfg=_branch(_stage.name, params_of),
            cmd=_branch(_stage.name, stage_cmd),
            nproc=job_nprocs(_stage.name),
        log:
            stage_log(_stage.name, "{drafter}" if _stage.per_drafter else None),
        benchmark:
            stage_benchmark(_stage.name, "{drafter}" if _stage.per_drafter else None)
        threads: 1 if merges(_stage.name) else stage_threads(_stage)
        resources:
            gpu=job_gpus(_stage.name),
            timing=int(_stage.timing),
            **scheduler_resources(_stage.name),
            **task_resources(_stage.name),
        shell:
            STAGE_SHELL


# extract.jobs = K > 1: part k of the extraction (the k-th contiguous shard range), resumable like extract; the
# extract rule above then merges the parts (draftforge.extract.parts). Same config, threads and resources as extract.
if EXTRACT_JOBS > 1:

    rule extract_part:
        input:
            upstream_markers("extract"),
        output:
            str(part_marker(RESULTS, EXPERIMENT, "{part}")),
        params:
            cfg=params_of("extract"),
            cmd=lambda wc: stage_cmd("extract", part=int(wc.part)),
            nproc=nprocs("extract"),
        log:
            str(RESULTS / EXPERIMENT / "logs" / "extract-part{part}.log"),
        benchmark:
            str(RESULTS / EXPERIMENT / "benchmarks" / "extract-part{part}.tsv")
        threads: stage_threads(STAGE_BY_NAME["extract"])
        resources:
            gpu=gpus("extract"),
            timing=0,
            **scheduler_resources("extract"),
            **task_resources("extract"),
        shell:
            STAGE_SHELL
