"""Typed config of the `evaluate` stage (torch-free). Owned by the evaluate stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class GsmSymbolicEvalConfig:
    """Held-out reasoning-gym `gsm_symbolic` problems.

    reasoning-gym draws item i of `create_dataset(seed=s)` from Random(s + i): evaluation uses item
    seeds [seed, seed + size). Training (curate) must draw its items from seeds outside that range.
    """

    seed: int = 1_000_000_000
    size: int = 200  # reserved pool (>= num_prompts); the whole pool is decontaminated


@dataclass
class ChitchatEvalConfig:
    """Held-out `chitchat-dataset` conversations: id is held out iff
    int(sha256(id)[:8], 16) % 10000 < holdout_per_10k (deterministic, order-independent)."""

    holdout_per_10k: int = 300  # ~3% of the 7.2K conversations (~210) never go to training
    max_turns: int = 3  # prompt = first turns up to the last user turn among the first max_turns


@dataclass
class EvaluateConfig:
    # Packaged default-world sets: humaneval, gsm_symbolic, chitchat.
    # Local-file sets (path in dataset_files): gsm8k, math500, humaneval_file, mbpp, mtbench, alpaca.
    datasets: List[str] = field(default_factory=lambda: ["humaneval", "gsm_symbolic", "chitchat"])
    dataset_files: Dict[str, str] = field(default_factory=dict)
    num_prompts: int = 10  # per dataset (0 = all)
    max_new_tokens: int = 128
    temperatures: List[float] = field(default_factory=lambda: [0.0])
    methods: List[str] = field(default_factory=lambda: ["ar", "dflash", "ddtree"])
    budgets: List[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])
    mtp_drafts: int = 3  # draft tokens per round of the `mtp` method (the MTP layer applied recursively)
    gpus: int = 0  # 0 = CPU; N = one model copy per GPU rank (torchrun --nproc_per_node N)
    warmup: int = 1  # prompts run (and discarded) per method before measuring
    seed: int = 0  # sampling seed at T > 0 (per prompt: seed + prompt index)
    dtype: str = ""  # "" → float32 on CPU, target.dtype on GPU
    gsm_symbolic: GsmSymbolicEvalConfig = field(default_factory=GsmSymbolicEvalConfig)
    chitchat: ChitchatEvalConfig = field(default_factory=ChitchatEvalConfig)
