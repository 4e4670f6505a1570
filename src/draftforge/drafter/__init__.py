"""DFlash block-diffusion drafter: model, config, vLLM-format export/load (docs/architecture.md, "Drafter and training objective")."""

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.model import DFlashDrafter, DraftCache

__all__ = ["DFlashConfig", "DFlashDrafter", "DraftCache", "export_drafter", "load_drafter"]


def __getattr__(name: str):  # export/load import safetensors lazily
    if name in ("export_drafter", "load_drafter"):
        from draftforge.drafter import export

        return getattr(export, name)
    raise AttributeError(name)
