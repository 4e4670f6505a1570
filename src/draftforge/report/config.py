"""Typed config of the `report` stage (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReportConfig:
    plots: bool = True
    # Where `mlflow ui` serves (links in summary.md point there).
    mlflow_ui_url: str = "http://127.0.0.1:5000"
    # Parity of vLLM-DFlash τ with the standalone DFlash τ (same prompts, T = 0): relative tolerance.
    parity_tolerance: float = 0.05
