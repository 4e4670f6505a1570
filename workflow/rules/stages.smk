# One rule per row of the stage table (draftforge.stages.STAGE_TABLE): inputs are the upstream stages'
# markers, the output is the stage's marker, params track the stage's resolved config sections.
# extract and train keep finished shards / checkpoints in results/<exp>/.work/<stage> (never a declared
# output), so a failed or interrupted job resumes. timing=1: evaluate and baselines measure speed, so
# they never share the machine with each other.
for _stage in STAGE_TABLE:

    rule:
        name:
            _stage.name
        input:
            [marker(up) for up in stage_inputs(_stage.name, CFG)],
        output:
            marker(_stage.name),
        params:
            cfg=params_of(_stage.name),
            cmd=stage_cmd(_stage.name),
            nproc=nprocs(_stage.name),
        log:
            stage_log(_stage.name),
        benchmark:
            stage_benchmark(_stage.name)
        threads: workflow.cores if _stage.all_cores else 1
        resources:
            gpu=gpus(_stage.name),
            timing=int(_stage.timing),
        shell:
            STAGE_SHELL
