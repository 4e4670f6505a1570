"""The `dflash` drafter type: the DFlash block-diffusion drafter (drafter/model.py), exported in the layout
vLLM's `dflash` method loads. Engine: the `dflash` chain and the `ddtree` / `ddtree_lookup` trees; vLLM:
`dflash`, plus the drafter-free n-gram / EAGLE-3 baselines, which ride with this branch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftforge.drafter.registry import BLOCK_DRAFTER, DrafterType, exported_type, register_drafter_type
from draftforge.drafter.types.keys import HEAD_KEYS, MTP_KEYS

NAME = "dflash"
ARCHITECTURE = "DFlashDraftModel"


@register_drafter_type
def dflash() -> DrafterType:
    return DrafterType(
        name=NAME, title="DFlash", chain_method="dflash", tree_methods=("ddtree", "ddtree_lookup"),
        vllm_methods=("dflash", "ngram", "eagle3"), vllm_planners={"dflash": f"{__name__}:plan_vllm"},
        default_loss_weights={"ce": 1.0}, artifact=BLOCK_DRAFTER,
        exports={ARCHITECTURE: "draftforge.drafter.config:DFlashConfig"},
        models={ARCHITECTURE: "draftforge.drafter.model:DFlashDrafter"},
        model_config="draftforge.drafter.config:DFlashConfig", ignores=MTP_KEYS + HEAD_KEYS, draft_vocab=True,
    )  # fmt: skip


def plan_vllm(mcfg: Any, target_info: dict[str, Any], drafter_dir: Path | None, device: str | None) -> Any:
    """vLLM `dflash` on the branch's exported drafter (or baselines.methods.dflash.model); a recorded skip when
    the export is another type's format (a DSpark drafter: vLLM serves it under its own method)."""
    from draftforge.baselines.spec import MethodPlan, read_drafter_config
    from draftforge.errors import StageError

    drafter_dir = Path(mcfg.model) if mcfg.model else drafter_dir
    if drafter_dir is None:
        raise StageError("baselines.methods.dflash.model: no drafter (train stage output missing and none configured)")
    info = read_drafter_config(drafter_dir.resolve(), target_info)
    if info["architecture"] != ARCHITECTURE:
        other = exported_type(info["architecture"])
        title, method = (other.title, other.chain_method) if other else (info["architecture"], "?")
        return MethodPlan("dflash", skip_reason=f"{drafter_dir.resolve()} is a {title} drafter: vLLM serves it as "
                                                f"'{method}' (its dflash loader would reject the Markov / confidence heads)")
    k = mcfg.num_speculative_tokens
    spec = {"method": "dflash", "model": str(drafter_dir.resolve()), "num_speculative_tokens": int(k or info["block_size"] - 1)}
    return MethodPlan("dflash", spec, draft_model=str(drafter_dir.resolve()))
