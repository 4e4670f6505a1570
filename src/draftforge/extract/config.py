"""Typed config of the `extract` stage (torch-free). Owned by the extract stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExtractConfig:
    gpus: int = 0  # 0 = CPU (gloo); N = torchrun over N GPUs (NCCL)
    cpu_procs: int = 1  # processes on CPU when gpus == 0
    storage_dtype: str = "bfloat16"  # bfloat16 | float32 | float8_e4m3fn
    tokens_per_batch: int = 16384
    seqs_per_shard: int = 1024
    max_seq_len: int = 3072
