"""Where a benchmark's JSON record goes: $OUT/<name>.json when $OUT is set (the device tool's folder)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_record(name: str, record: Any) -> Path | None:
    if not os.environ.get("OUT"):
        return None
    path = Path(os.environ["OUT"]) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
