"""One device rule for every stage: CUDA asked for and absent is a clear error naming the key."""

from __future__ import annotations

import pytest
import torch

from draftforge.errors import StageError
from draftforge.runtime import device_kind, dtype_named, init_distributed, pick_device


def test_cpu_unless_cuda_is_asked_for() -> None:
    assert pick_device("train.device", "auto", 0) == torch.device("cpu")
    assert pick_device("train.device", "cpu", 4) == torch.device("cpu")
    assert init_distributed(1, torch.device("cpu"), 1) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("key", "device", "gpus"), [("extract.device", "auto", 2), ("train.device", "cuda", 0),
                                                     ("evaluate.gpus", "auto", 1)])  # fmt: skip
def test_missing_cuda_is_an_error_naming_the_key(key: str, device: str, gpus: int) -> None:
    with pytest.raises(StageError, match=key.replace(".", r"\.") + ".*no CUDA device visible"):
        device_kind(key, device, gpus)


def test_bad_names_fail_naming_the_key() -> None:
    with pytest.raises(StageError, match="extract.device='tpu'"):
        device_kind("extract.device", "tpu", 0)
    with pytest.raises(StageError, match="evaluate.dtype='fp8'"):
        dtype_named("evaluate.dtype", "fp8")
