"""Typed config of the `report` stage (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReportConfig:
    plots: bool = True
