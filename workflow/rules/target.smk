rule target:
    output:
        marker("target"),
    params:
        cfg=params_of("target"),
        cmd=stage_cmd("target"),
    log:
        stage_log("target"),
    benchmark:
        stage_benchmark("target")
    threads: workflow.cores
    resources:
        gpu=0,
    shell:
        "OMP_NUM_THREADS={threads} {params.cmd} > {log} 2>&1"
