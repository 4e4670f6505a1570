rule curate:
    input:
        marker("target"),
    output:
        marker("curate"),
    params:
        cfg=params_of("curate"),
        cmd=stage_cmd("curate"),
    log:
        stage_log("curate"),
    benchmark:
        stage_benchmark("curate")
    threads: workflow.cores
    resources:
        gpu=0,
    shell:
        "OMP_NUM_THREADS={threads} {params.cmd} > {log} 2>&1"
