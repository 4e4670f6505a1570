"""Hold-out rules: which evaluation prompts training must never see (torch-free, import-light).

Curate (to drop held-out items from training data) and evaluate (to pick its prompts) both import
these functions, so one change moves both sides. The facts are in docs/architecture.md
("Held-out evaluation prompts").
"""

from __future__ import annotations

import hashlib
from typing import Any

# Keys of the evaluate section that choose the evaluation prompts: curate decontaminates against
# them and baselines runs on them, so both stages track these keys (not evaluate's methods/budgets).
PROMPT_KEYS: tuple[str, ...] = ("evaluate.datasets", "evaluate.dataset_files", "evaluate.gsm_symbolic", "evaluate.chitchat",
                                 "evaluate.long_context")


def chitchat_is_heldout(conversation_id: str, holdout_per_10k: int) -> bool:
    """Held out iff int(sha256(id)[:8], 16) % 10000 < holdout_per_10k (independent of order and other ids)."""
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % 10000
    return bucket < holdout_per_10k


def gsm_symbolic_seed_range(ev: Any) -> range:
    """Item seeds evaluation owns: [gsm_symbolic.seed, gsm_symbolic.seed + size) of the evaluate section `ev`.

    reasoning-gym draws item i of create_dataset(seed=s) from Random(s + i), so training must draw its
    gsm_symbolic items from seeds outside this range.
    """
    start = int(ev.gsm_symbolic.seed)
    return range(start, start + int(ev.gsm_symbolic.size))


def seed_ranges_overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
