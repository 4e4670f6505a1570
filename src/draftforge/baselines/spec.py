"""Per-method engine specs: what `vllm.LLM(...)` gets for ar / ngram / eagle3 and each drafter type's methods
(planned by the type's module: drafter/types/, `DrafterType.vllm_planners`).

A method either yields a spec (JSON for the worker) or a recorded skip with its reason; nothing here
imports vLLM. Invariants: batch size 1 (max_num_seqs=1), prefix caching off, stats on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftforge.baselines.config import known_methods
from draftforge.drafter.registry import MTP_HEAD, artifact_of_vllm_method, vllm_planner
from draftforge.drafter.types.dspark import DSPARK_CPU_REASON  # noqa: F401  (where tests and callers look)
from draftforge.errors import StageError

MODEL_LEN_MARGIN = 64  # room for draft tokens beyond prompt + max_new_tokens


@dataclass
class EngineSettings:
    device: str  # cpu | cuda
    dtype: str
    enforce_eager: bool
    kv_cache_bytes: int
    max_model_len: int
    in_process_engine: bool
    seed: int
    async_scheduling: bool | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            max_num_seqs=1,
            enable_prefix_caching=False,
            disable_log_stats=False,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            max_model_len=self.max_model_len,
            seed=self.seed,
            trust_remote_code=False,
        )
        if self.in_process_engine:  # tensor parallel 1: no separate executor worker process
            kwargs["distributed_executor_backend"] = "uni"
        if self.async_scheduling is not None:
            kwargs["async_scheduling"] = self.async_scheduling
        return kwargs


@dataclass
class MethodPlan:
    name: str
    speculative_config: dict[str, Any] | None = None
    skip_reason: str | None = None
    draft_model: str | None = None
    source: str | None = None  # mtp: "native" (the target's MTP layers) | "trained" (train/mtp)
    llm_overrides: dict[str, Any] | None = None  # extra vllm.LLM kwargs this method needs

    @property
    def num_speculative_tokens(self) -> int | None:
        return None if self.speculative_config is None else int(self.speculative_config["num_speculative_tokens"])


def resolve_settings(bcfg: Any, target_info: dict[str, Any], device: str, longest_prompt: int, max_new_tokens: int) -> EngineSettings:
    dtype = bcfg.dtype or ("float32" if device == "cpu" else str(target_info.get("dtype") or "bfloat16"))
    eager = bool(device == "cpu") if bcfg.enforce_eager is None else bool(bcfg.enforce_eager)
    need = longest_prompt + max_new_tokens + MODEL_LEN_MARGIN
    limit = int(target_info.get("max_position_embeddings") or need)
    max_len = int(bcfg.max_model_len) if bcfg.max_model_len else min(need, limit)
    if longest_prompt + max_new_tokens > max_len:
        raise StageError(
            f"baselines.max_model_len: {max_len} < longest prompt {longest_prompt} + max_new_tokens {max_new_tokens}"
        )
    in_process = (device == "cpu") if bcfg.in_process_engine is None else bool(bcfg.in_process_engine)
    async_sched = (False if in_process else None) if bcfg.async_scheduling is None else bool(bcfg.async_scheduling)
    return EngineSettings(device, dtype, eager, int(bcfg.kv_cache_gib * 2**30), max_len, in_process, int(bcfg.seed), async_sched)


def read_drafter_config(drafter_dir: Path, target_info: dict[str, Any]) -> dict[str, Any]:
    """The exported drafter's config.json, checked against the target (layer ids, width, vocab)."""
    from draftforge.drafter.config import check_drafter_target, read_exported_config

    dcfg = read_exported_config(drafter_dir)
    check_drafter_target(drafter_dir, target_info)
    problems = []
    n_layers = int(target_info["num_layers"])
    if dcfg.target_num_layers and dcfg.target_num_layers != n_layers:
        problems.append(f"drafter was built for a {dcfg.target_num_layers}-layer target, target has {n_layers}")
    if any(not 0 <= t < n_layers for t in dcfg.target_layer_ids):
        problems.append(f"target_layer_ids {dcfg.target_layer_ids} outside [0, {n_layers - 1}]")
    if dcfg.target_hidden_size != int(target_info["hidden_size"]):
        problems.append(f"target_hidden_size {dcfg.target_hidden_size} != target hidden_size {target_info['hidden_size']}")
    if dcfg.vocab_size != int(target_info["vocab_size"]):
        problems.append(f"vocab_size {dcfg.vocab_size} != target vocab_size {target_info['vocab_size']}")
    if problems:
        raise StageError(f"{drafter_dir / 'config.json'}: drafter does not match the target: " + "; ".join(problems))
    return {"block_size": dcfg.block_size, "target_layer_ids": dcfg.target_layer_ids, "mask_token_id": dcfg.mask_token_id,
            "architecture": dcfg.ARCHITECTURE, "n_draft": dcfg.n_draft}


def plan_method(name: str, mcfg: Any, target_info: dict[str, Any], default_drafter_dir: Path | None,
                device: str | None = None, trained_mtp_dir: Path | None = None) -> MethodPlan:
    """speculative_config for one method, or a skip with its reason."""
    known = known_methods()
    if name not in known:
        raise StageError(f"baselines.methods.{name}: unknown method; known: {', '.join(known)}")
    k = mcfg.num_speculative_tokens
    if k is not None and int(k) < 1:
        raise StageError(f"baselines.methods.{name}.num_speculative_tokens: {k} must be >= 1")
    if name == "ar":
        return MethodPlan(name)
    if name == "ngram":
        lo, hi = mcfg.prompt_lookup_min or 2, mcfg.prompt_lookup_max or 4
        if not 1 <= lo <= hi:
            raise StageError(f"baselines.methods.ngram: prompt_lookup_min {lo} / max {hi} must satisfy 1 <= min <= max")
        spec = {"method": "ngram", "num_speculative_tokens": int(k or 4), "prompt_lookup_min": int(lo), "prompt_lookup_max": int(hi)}
        return MethodPlan(name, spec)
    planner = vllm_planner(name)  # a drafter type's method: planned by its type module from the branch's artifact
    if planner is not None:
        artifact_dir = trained_mtp_dir if artifact_of_vllm_method(name) == MTP_HEAD else default_drafter_dir
        return planner(mcfg, target_info, artifact_dir, device)
    # eagle3
    if not mcfg.model:
        return MethodPlan(name, skip_reason="no EAGLE-3 drafter configured (baselines.methods.eagle3.model)")
    model = Path(mcfg.model).resolve()
    if not (model / "config.json").is_file():
        raise StageError(f"baselines.methods.eagle3.model: {model} has no config.json")
    return MethodPlan(name, {"method": "eagle3", "model": str(model), "num_speculative_tokens": int(k or 3)}, draft_model=str(model))


def worker_spec(plan: MethodPlan, target_info: dict[str, Any], settings: EngineSettings, segments: list[dict[str, Any]],
                max_new_tokens: int, bcfg: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "method": plan.name,
        "model": str(target_info["hf_path"]),
        "tokenizer": str(target_info["hf_path"]),
        "llm_kwargs": {**settings.llm_kwargs(), **(plan.llm_overrides or {})},
        "speculative_config": plan.speculative_config,
        "segments": segments,
        "max_new_tokens": int(max_new_tokens),
        "ignore_eos": bool(bcfg.ignore_eos),
        "seed": int(bcfg.seed),
        "warmup": int(bcfg.warmup),
        "warmup_tokens": int(bcfg.warmup_tokens),
    }
