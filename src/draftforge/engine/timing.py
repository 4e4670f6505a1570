"""Clocks for the decoding loop: wall time for a generation, per-round stage times without extra syncs.

On CUDA, stage boundaries are CUDA events recorded on the stream (no synchronisation in the round);
they are resolved once, when the generation ends. On CPU they are perf_counter readings.
"""

from __future__ import annotations

import time

import torch


class Clock:
    """Wall clock that first waits for queued device work (generation start/end, TTFT)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class StageTimer:
    """Marks between stages of a round; `stage_s()` → {stage: [seconds per round]} once decoding ends."""

    def __init__(self, device: torch.device | str, stages: tuple[str, ...]) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.stages = stages
        self._marks: list[tuple[str | None, object]] = []  # (stage that ends here | None = round start, mark)

    def _mark(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks.append((None, self._mark()))

    def lap(self, stage: str) -> None:
        self._marks.append((stage, self._mark()))

    def stage_s(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {s: [] for s in self.stages}
        if self.cuda and self._marks:
            torch.cuda.synchronize()
        prev = None
        for stage, mark in self._marks:
            if stage is not None and prev is not None:
                dt = prev.elapsed_time(mark) / 1e3 if self.cuda else mark - prev  # type: ignore[union-attr,operator]
                out[stage].append(dt)
            prev = mark
        return out
