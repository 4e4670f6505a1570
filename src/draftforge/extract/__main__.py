from draftforge.cli import run_stage
from draftforge.extract.stage import main

run_stage("extract", main)
