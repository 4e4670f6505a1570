rule target:
    output:
        marker("target"),
    params:
        cfg=params_of("target"),
        cmd=stage_cmd("target"),
        nproc=nprocs(),
    log:
        stage_log("target"),
    benchmark:
        stage_benchmark("target")
    threads: workflow.cores
    resources:
        gpu=0,
    shell:
        STAGE_SHELL
