"""Standalone batch-1 decoding engine: AR, DFlash / DSpark chains, DDTree and Markov-conditioned DDTree (docs/architecture.md, "Engine").

gpt-fast-style plain functions: a target wrapper over the engine's own state (`target.py`, `state.py`,
`gdn.py` for hybrid Gated-DeltaNet layers), spans (`span.py`: what one forward appends), one sampling
rule (`sampling.py`), tree construction and walk (`tree.py`), the methods that draft a round's tree
(`methods.py`) and one decoding loop (`loops.py`) returning a `GenResult` with tokens, TTFT, decode time
and per-round acceptance and stage times (`timing.py`). `graph.py`: the same steps at static shapes,
replayed as CUDA graphs (`generate(..., engine=CapturedEngine(...))`).
"""

from draftforge.engine import dspark as _dspark  # noqa: F401  (registers dspark, ddtree_markov)
from draftforge.engine import lookup as _lookup  # noqa: F401  (registers ddtree_lookup)
from draftforge.engine.graph import BucketError, CapturedEngine, verify_buckets
from draftforge.engine.loops import GenResult, generate, generate_ar, generate_ddtree, generate_dflash
from draftforge.engine.methods import METHODS, Features, Method, make_method
from draftforge.engine.sampling import sample
from draftforge.engine.state import CapacityError, TargetState
from draftforge.engine.target import TargetModel, wrap_target

__all__ = [
    "METHODS",
    "BucketError",
    "CapturedEngine",
    "CapacityError",
    "Features",
    "GenResult",
    "Method",
    "TargetModel",
    "TargetState",
    "generate",
    "generate_ar",
    "generate_ddtree",
    "generate_dflash",
    "make_method",
    "sample",
    "verify_buckets",
    "wrap_target",
]
