"""The `mtp` drafter type: the target's native MTP layer when its checkpoint has one (nothing to train), else
an MTP head in the MiMo form trained from the same features (drafter/mtp.py, docs/architecture.md "MTP head").
Engine and vLLM: `mtp` (the layer applied recursively); rows name whose layer ran in `mtp_source`. The report
compares the best tree method against it ("DDTree vs MTP")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftforge.drafter.registry import MTP_HEAD, DrafterType, register_drafter_type
from draftforge.drafter.types.keys import BLOCK_TRAIN_KEYS, HEAD_KEYS

NAME = "mtp"
SOURCE_KEY = "mtp_source"  # "native" (the target's own MTP layer) or "trained" (train/<branch>/mtp)


def reads_last_layer(drafter: Any, target: Any) -> bool:
    """A head is trained (on the target's final-normed last layer) when the target has no MTP layers."""
    return not int(target.mtp_layers or 0)


@register_drafter_type
def mtp() -> DrafterType:
    return DrafterType(
        name=NAME, title="MTP head", chain_method="mtp", vllm_methods=("mtp",),
        vllm_planners={"mtp": f"{__name__}:plan_vllm"}, default_loss_weights={"ce": 1.0},
        reads_last_layer=reads_last_layer, artifact=MTP_HEAD, train_branch="draftforge.train.mtp:mtp_branch", source_key=SOURCE_KEY, tree_reference=True,
        ignores=BLOCK_TRAIN_KEYS + HEAD_KEYS,
    )  # fmt: skip


def plan_vllm(mcfg: Any, target_info: dict[str, Any], trained_mtp_dir: Path | None, device: str | None) -> Any:
    """The target's own MTP layers when it has them; else a trained head in vLLM's MiMo MTP format
    (baselines.methods.mtp.model, or the mtp branch's train/mtp/mtp) served as a separate draft model,
    with the target's config told it has one MTP layer (vLLM sizes MTP drafts from the target config)."""
    from draftforge.baselines.spec import MethodPlan
    from draftforge.drafter.mtp_format import MTP_TARGET_OVERRIDES, TRAINED_DEFAULT_DRAFTS
    from draftforge.errors import StageError

    k = mcfg.num_speculative_tokens
    layers = int(target_info.get("mtp_layers") or 0)
    head = Path(mcfg.model).resolve() if mcfg.model else None
    if head is None and layers > 0:
        return MethodPlan(NAME, {"method": NAME, "num_speculative_tokens": int(k or layers)}, source="native")
    if head is None and trained_mtp_dir is not None and (trained_mtp_dir / "config.json").is_file():
        head = trained_mtp_dir.resolve()
    if head is None:
        return MethodPlan(NAME, skip_reason=f"target {target_info.get('name')!r} has no MTP layers (target.json "
                                            "mtp_layers=0) and no trained MTP head (its mtp train branch made none)")  # fmt: skip
    if not (head / "config.json").is_file():
        raise StageError(f"baselines.methods.mtp.model: {head} has no config.json")
    cfg = json.loads((head / "config.json").read_text())
    if int(cfg.get("hidden_size", -1)) != int(target_info["hidden_size"]) or "MiMoForCausalLM" not in (cfg.get("architectures") or []):
        raise StageError(f"baselines.methods.mtp.model: {head} is not a MiMo-format MTP head of width {target_info['hidden_size']}")
    spec = {"method": NAME, "model": str(head), "num_speculative_tokens": int(k or TRAINED_DEFAULT_DRAFTS)}
    return MethodPlan(NAME, spec, draft_model=str(head), source="trained", llm_overrides={"hf_overrides": dict(MTP_TARGET_OVERRIDES)})
