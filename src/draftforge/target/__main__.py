from draftforge.cli import run_stage
from draftforge.target.stage import main

if __name__ == "__main__":
    run_stage("target", main)
