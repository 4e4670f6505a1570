from draftforge.cli import run_stage
from draftforge.evaluate.stage import main

if __name__ == "__main__":  # spawn-safe: a child process re-importing __main__ must not rerun the stage
    run_stage("evaluate", main)
