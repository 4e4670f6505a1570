rule baselines:
    input:
        marker("target"),
        marker("train"),
    output:
        marker("baselines"),
    params:
        cfg=params_of("baselines"),
        cmd=stage_cmd("baselines"),
    log:
        stage_log("baselines"),
    benchmark:
        stage_benchmark("baselines")
    threads: workflow.cores
    resources:
        gpu=0,
        timing=1,
    shell:
        "OMP_NUM_THREADS={threads} VLLM_CPU_OMP_THREADS_BIND=nobind {params.cmd} > {log} 2>&1"
