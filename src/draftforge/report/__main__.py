from draftforge.cli import run_stage
from draftforge.report.stage import main

if __name__ == "__main__":
    run_stage("report", main)
