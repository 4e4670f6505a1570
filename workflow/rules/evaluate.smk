# timing=1: evaluate and baselines measure speed, so they never share the machine with each other.
rule evaluate:
    input:
        marker("target"),
        marker("train"),
    output:
        marker("evaluate"),
    params:
        cfg=params_of("evaluate"),
        cmd=stage_cmd("evaluate", gpus=CFG.evaluate.gpus),
        nproc=nprocs(gpus=CFG.evaluate.gpus),
    log:
        stage_log("evaluate"),
    benchmark:
        stage_benchmark("evaluate")
    threads: workflow.cores
    resources:
        gpu=CFG.evaluate.gpus,
        timing=1,
    shell:
        STAGE_SHELL
