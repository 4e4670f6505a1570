"""DFlash block-diffusion drafter: model, config, vLLM-format export/load (docs/architecture.md, "Drafter and training objective").

Names resolve lazily, so torch-free modules (`drafter.settings`, the config group read by the Snakefile)
import without torch.
"""

__all__ = ["DFlashConfig", "DFlashDrafter", "export_drafter", "load_drafter"]

_HOME = {"DFlashConfig": "config", "DFlashDrafter": "model",
         "export_drafter": "export", "load_drafter": "export"}


def __getattr__(name: str):
    if name in _HOME:
        from importlib import import_module

        return getattr(import_module(f"draftforge.drafter.{_HOME[name]}"), name)
    raise AttributeError(name)
