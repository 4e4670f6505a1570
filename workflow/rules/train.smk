# Checkpoints live in results/<exp>/.work/train (never a declared output): Ctrl-C, rerun, resume.
# train.features=online reads the curate shards and runs the target itself: no extract stage.
rule train:
    input:
        marker("target"),
        marker("curate") if CFG.train.features == "online" else marker("extract"),
    output:
        marker("train"),
    params:
        cfg=params_of("train"),
        cmd=stage_cmd("train", nproc=CFG.train.cpu_procs, gpus=CFG.train.gpus),
        nproc=nprocs(nproc=CFG.train.cpu_procs, gpus=CFG.train.gpus),
    log:
        stage_log("train"),
    benchmark:
        stage_benchmark("train")
    threads: workflow.cores
    resources:
        gpu=CFG.train.gpus,
    shell:
        STAGE_SHELL
