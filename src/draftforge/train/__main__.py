from draftforge.cli import run_stage
from draftforge.train.stage import main

run_stage("train", main)
