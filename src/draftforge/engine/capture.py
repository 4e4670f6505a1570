"""Static capacities and CUDA-graph capture shared by the captured engine's target and drafter steps."""

from __future__ import annotations

from collections.abc import Callable

import torch

CAPACITY_ALIGN = 64  # KV rows rounded up so attention kernels see aligned mask/key lengths


def align(n: int) -> int:
    return -(-n // CAPACITY_ALIGN) * CAPACITY_ALIGN


def capture_graph(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """Warm `fn` up twice on a side stream, then capture one call into a graph sharing `pool`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    return g
