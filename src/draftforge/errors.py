"""Errors a user can act on: one line naming the file/field and what is wrong."""

from __future__ import annotations


class StageError(Exception):
    """Bad input or an unmet precondition. The stage CLI prints it as one line and exits 2."""


class ConfigError(StageError):
    """A config key or value is wrong (raised at compose time, naming the key)."""


def check(ok: bool, key: str, problem: str) -> None:
    """A config dataclass's value check (called from `__post_init__`, so it runs at compose time)."""
    if not ok:
        raise ConfigError(f"{key}: {problem}")
