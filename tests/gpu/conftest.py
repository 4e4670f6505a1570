"""Shared by the CUDA tests: fp32 on the GPU must mean fp32 (TF32 matmuls would turn greedy ties into mismatches)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
