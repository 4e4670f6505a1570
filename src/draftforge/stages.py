"""The stage table: every stage's marker, upstream stages and config sections, declared once.

`paths` (markers), `cli` (provenance inputs), `config` (what each stage's `params` track) and the
Snakemake rules (`workflow/rules/stages.smk` builds one rule per row) all read it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftforge.holdout import PROMPT_KEYS


@dataclass(frozen=True)
class Stage:
    name: str
    marker: str  # file in results/<exp>/<name>/ written last: present = finished (Snakemake's declared output)
    inputs: tuple[str, ...]  # upstream stages whose outputs it reads (their markers are its declared inputs)
    sections: tuple[str, ...]  # config keys its computation depends on; "a.b" = one subsection of a
    timing: bool = False  # measures speed: never shares the machine with another timing stage
    all_cores: bool = True  # the job takes every core Snakemake offers (report: one)
    # Runs once per listed drafter (results/<exp>/<name>/<drafter>/, composed with drafter=<drafter>); its
    # per-drafter inputs are the same drafter's branch.
    per_drafter: bool = False
    derived: tuple[str, ...] = ()  # values derived from several sections (config.DERIVED_PARAMS), tracked too


STAGE_TABLE: tuple[Stage, ...] = (
    Stage("target", "target.json", (), ("target",)),
    # curate decontaminates training data against the evaluation prompt sets
    Stage("curate", "manifest.json", ("target",), ("target", "curate", *PROMPT_KEYS)),
    # extract also stores the target's last layer when a listed drafter reads it (drafter.settings.needs_last_layer)
    Stage("extract", "index.json", ("target", "curate"), ("target", "extract"), derived=("stores_last_layer",)),
    # train.features=online plans the curate shards as extract does: extract's plan keys are train's too
    Stage("train", "metrics.json", ("target", "extract"),
          ("target", "drafter", "train", "extract.max_seq_len", "extract.tokens_per_shard", "extract.seqs_per_shard",
           "extract.sort_window"), per_drafter=True),  # fmt: skip
    Stage("evaluate", "evaluate.json", ("target", "train"), ("target", "drafter", "evaluate"), timing=True,
          per_drafter=True),  # fmt: skip
    # baselines runs vLLM on the same prompts as evaluate (same sets, count and length, and temperatures with
    # their T > 0 subset: evaluate/prompts.prompts_at)
    Stage("baselines", "baselines.json", ("target", "train"),
          ("target", "drafter", "baselines", *PROMPT_KEYS, "evaluate.num_prompts", "evaluate.max_new_tokens",
           "evaluate.temperatures", "evaluate.sampled_datasets", "evaluate.sampled_prompts"),
          timing=True, per_drafter=True),  # fmt: skip
    # report joins every branch's rows from both engines and computes the train/serve parity check
    Stage("report", "summary.md", ("target", "curate", "extract", "train", "evaluate", "baselines"),
          ("report", "drafters"), all_cores=False),  # fmt: skip
)

STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE)
STAGE_BY_NAME: dict[str, Stage] = {s.name: s for s in STAGE_TABLE}
STAGE_MARKERS: dict[str, str] = {s.name: s.marker for s in STAGE_TABLE}
STAGE_INPUTS: dict[str, tuple[str, ...]] = {s.name: s.inputs for s in STAGE_TABLE}
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {s.name: s.sections for s in STAGE_TABLE}
PER_DRAFTER: frozenset[str] = frozenset(s.name for s in STAGE_TABLE if s.per_drafter)

def stage_inputs(name: str, cfg: Any) -> tuple[str, ...]:
    """Upstream stages of `name` under this config: online training (train.features=online) reads the
    curate shards and runs the target itself, so neither train nor report waits for extract."""
    ups = STAGE_BY_NAME[name].inputs
    train = getattr(cfg, "train", None)
    if getattr(train, "features", "offline") == "online":
        if name == "train":
            return tuple("curate" if up == "extract" else up for up in ups)
        return tuple(up for up in ups if up != "extract")
    return ups


for _s in STAGE_TABLE:  # inputs name earlier stages only: the table is in DAG order
    assert all(STAGES.index(up) < STAGES.index(_s.name) for up in _s.inputs), _s
