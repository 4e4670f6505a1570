from draftforge.baselines.stage import main
from draftforge.cli import run_stage

if __name__ == "__main__":
    run_stage("baselines", main)
