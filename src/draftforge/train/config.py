"""Typed config of the `train` stage (torch-free). Owned by the train stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    gpus: int = 0
    cpu_procs: int = 1
    epochs: int = 6
    max_steps: int = -1  # -1: run all epochs
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_anchors: int = 512
    loss_gamma: float = 7.0
    max_seq_len: int = 3072
    batch_seqs: int = 1
    init_from_target: bool = True
    eval_every: int = 100
    seed: int = 0
