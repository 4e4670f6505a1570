"""Standalone batch-1 decoding engine: AR, DFlash chain and DDTree tree decoding (DESIGN.md §5).

gpt-fast-style plain functions over one target wrapper (`target.py`: own KV cache, own layer loop,
tapped-layer capture), one sampling rule (`sampling.py`), tree construction/verification helpers
(`tree.py`) and the three decoding loops (`loops.py`). Every loop returns a `GenResult` with tokens,
TTFT, decode time and per-round acceptance and stage times (`timing.py`).
"""

from draftforge.engine.loops import GenResult, generate_ar, generate_ddtree, generate_dflash
from draftforge.engine.sampling import sample
from draftforge.engine.target import KVCache, TargetModel, wrap_target

__all__ = [
    "GenResult",
    "KVCache",
    "TargetModel",
    "generate_ar",
    "generate_ddtree",
    "generate_dflash",
    "sample",
    "wrap_target",
]
