rule report:
    input:
        marker("target"),
        marker("curate"),
        [] if CFG.train.features == "online" else marker("extract"),  # online training: no extract stage
        marker("train"),
        marker("evaluate"),
        marker("baselines"),
    output:
        marker("report"),
    params:
        cfg=params_of("report"),
        cmd=stage_cmd("report"),
        nproc=nprocs(),
    log:
        stage_log("report"),
    benchmark:
        stage_benchmark("report")
    threads: 1
    resources:
        gpu=0,
    shell:
        STAGE_SHELL
