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


STAGE_TABLE: tuple[Stage, ...] = (
    Stage("target", "target.json", (), ("target",)),
    # curate decontaminates training data against the evaluation prompt sets
    Stage("curate", "manifest.json", ("target",), ("target", "curate", *PROMPT_KEYS)),
    # extract also stores the target's last layer when the train objective or the MTP head needs it
    # (train.config.needs_last_layer)
    Stage("extract", "index.json", ("target", "curate"),
          ("target", "extract", "train.drafter_type", "train.loss_kl", "train.loss_tv", "train.mtp")),  # fmt: skip
    # train.features=online plans the curate shards as extract does: extract's plan keys are train's too
    Stage("train", "metrics.json", ("target", "extract"),
          ("target", "train", "extract.max_seq_len", "extract.tokens_per_shard", "extract.seqs_per_shard",
           "extract.sort_window")),  # fmt: skip
    Stage("evaluate", "evaluate.json", ("target", "train"), ("target", "evaluate"), timing=True),
    # baselines runs vLLM on the same prompts as evaluate (same sets, count and length)
    Stage("baselines", "baselines.json", ("target", "train"),
          ("target", "baselines", *PROMPT_KEYS, "evaluate.num_prompts", "evaluate.max_new_tokens"),
          timing=True),  # fmt: skip
    # report joins both engines' rows and computes the train/serve parity check
    Stage("report", "summary.md", ("target", "curate", "extract", "train", "evaluate", "baselines"), ("report",),
          all_cores=False),  # fmt: skip
)

STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE)
STAGE_BY_NAME: dict[str, Stage] = {s.name: s for s in STAGE_TABLE}
STAGE_MARKERS: dict[str, str] = {s.name: s.marker for s in STAGE_TABLE}
STAGE_INPUTS: dict[str, tuple[str, ...]] = {s.name: s.inputs for s in STAGE_TABLE}
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {s.name: s.sections for s in STAGE_TABLE}

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
