"""Where a stage's process computes: device choice, dtype names, and torch.distributed set-up.

One behaviour for every stage: CUDA requested (device=cuda, or device=auto with gpus > 0) and none
visible is a StageError naming the config key, never a silent fallback to the CPU.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from draftforge.errors import StageError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


def device_kind(key: str, device: str, gpus: int) -> str:
    """'cuda' or 'cpu' for the setting `key` (= device); auto → cuda iff gpus > 0."""
    if device not in DEVICES:
        raise StageError(f"{key}={device!r}: use one of {', '.join(DEVICES)}")
    if device == "cpu" or (device == "auto" and gpus <= 0):
        return "cpu"
    if not torch.cuda.is_available():
        raise StageError(f"{key}={device!r} (gpus={gpus}): no CUDA device visible; run on the CPU with gpus=0")
    return "cuda"


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(key: str, device: str, gpus: int, local_rank: int = 0) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (made current) or cpu, per `device_kind`. A process that sees fewer
    GPUs than its node's ranks (an srun task bound to its own GPU) takes LOCAL_RANK modulo those it sees."""
    if device_kind(key, device, gpus) == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def dtype_named(key: str, name: str) -> torch.dtype:
    if name not in DTYPES:
        raise StageError(f"{key}={name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def init_distributed(world_size: int, device: torch.device, timeout_min: int) -> bool:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU) when there are several ranks."""
    if world_size <= 1:
        return False
    if not dist.is_initialized():
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=timeout_min), **kw)
    return True
