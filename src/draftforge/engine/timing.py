"""Wall clock that first waits for queued device work, so stage times are real on CUDA."""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
