"""A drafter type registered from outside draftforge (tests of the plugin hook, docs/architecture.md "Drafter
types"): the DFlash model and objective under the name `toy`, measuring only the `dflash` chain (no tree
method) and no vLLM method besides AR. A drafter file selects it with `type: toy` and `module: toy_drafter`."""

from __future__ import annotations

from draftforge.drafter.registry import BLOCK_DRAFTER, DrafterType, register_drafter_type

TOY_YAML = "name: toy\ntype: toy\nmodule: toy_drafter\nnum_layers: 1\n"


@register_drafter_type
def toy() -> DrafterType:
    return DrafterType(name="toy", title="Toy", chain_method="dflash", vllm_methods=(), default_loss_weights={"ce": 1.0},
                       artifact=BLOCK_DRAFTER, model_config="draftforge.drafter.config:DFlashConfig")
