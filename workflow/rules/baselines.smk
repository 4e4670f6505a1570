rule baselines:
    input:
        marker("target"),
        marker("train"),
    output:
        marker("baselines"),
    params:
        cfg=params_of("baselines"),
        cmd=stage_cmd("baselines"),
        nproc=nprocs(),
    log:
        stage_log("baselines"),
    benchmark:
        stage_benchmark("baselines")
    threads: workflow.cores
    resources:
        gpu=0,
        timing=1,
    shell:
        STAGE_SHELL
