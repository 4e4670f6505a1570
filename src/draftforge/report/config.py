"""Typed config of the `report` stage (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReportConfig:
    plots: bool = True
    # Where `mlflow ui` serves (links in summary.md point there).
    mlflow_ui_url: str = "http://127.0.0.1:5000"
