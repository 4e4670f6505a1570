rule curate:
    input:
        marker("target"),
    output:
        marker("curate"),
    params:
        cfg=params_of("curate"),
        cmd=stage_cmd("curate"),
        nproc=nprocs(),
    log:
        stage_log("curate"),
    benchmark:
        stage_benchmark("curate")
    threads: workflow.cores
    resources:
        gpu=0,
    shell:
        STAGE_SHELL
