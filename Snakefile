# draftforge: curate → extract → train → evaluate / baselines → report.
#   snakemake --cores all                                   # default experiment
#   snakemake --cores all --config experiment=smoke         # CI-sized run
#   snakemake --cores all --config 'overrides=["evaluate.budgets=[16,64]"]'
# Snakemake owns paths, scheduling and resources; Hydra (conf/) owns what each stage computes.
# Import-light: no torch here.

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from draftforge.config import compose, stage_params  # noqa: E402


configfile: "workflow/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/stages.smk"


rule all:
    input:
        marker("report"),
    default_target: True
