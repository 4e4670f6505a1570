# Shards and their progress live in results/<exp>/.work/extract (never a declared output), so a failed
# or interrupted job resumes without recomputing finished shards.
rule extract:
    input:
        marker("target"),
        marker("curate"),
    output:
        marker("extract"),
    params:
        cfg=params_of("extract"),
        cmd=stage_cmd("extract", nproc=CFG.extract.cpu_procs, gpus=CFG.extract.gpus),
        nproc=nprocs(nproc=CFG.extract.cpu_procs, gpus=CFG.extract.gpus),
    log:
        stage_log("extract"),
    benchmark:
        stage_benchmark("extract")
    threads: workflow.cores
    resources:
        gpu=CFG.extract.gpus,
    shell:
        STAGE_SHELL
