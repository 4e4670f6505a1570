"""Decontamination: drop training prompts that overlap any evaluation prompt, counted per eval set.

Match rule (over normalized words, see dedup.words):
- exact: the normalized texts are equal (any length); or
- containment: with W = the word n-grams (n = `ngram`) and h = |W(T) ∩ W(E)| for a training text T
  and an eval prompt E: h ≥ min_shared_ngrams and (h / |W(E)| ≥ threshold (E, possibly edited,
  inside T) or h / |W(T)| ≥ threshold (T is a piece of E)). The absolute floor keeps short common
  phrases ("hello how are you doing today") from counting as evidence; texts shorter than n words
  match only exactly.
The index holds the eval prompts only (a few thousand), so memory does not depend on the training data.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from draftforge.curate.dedup import ngram_hashes, words
from draftforge.errors import StageError


def eval_item_text(item: Any) -> str:
    """Prompt text of one eval item: a str, or a dict with messages / prompt / question / text."""
    if isinstance(item, str):
        return item
    if isinstance(item, list):  # a chat prompt: [{"role", "content"}, ...]
        return "\n".join(str(m.get("content", "")) for m in item if isinstance(m, Mapping) and m.get("role") == "user")
    if isinstance(item, Mapping):
        msgs = item.get("messages")
        if isinstance(msgs, list):
            return "\n".join(str(m.get("content", "")) for m in msgs if m.get("role", "user") == "user")
        for key in ("prompt", "question", "text", "instruction", "problem"):
            if isinstance(item.get(key), str):
                return item[key]
    for attr in ("messages", "prompt", "text"):
        value = getattr(item, attr, None)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(str(m.get("content", "")) for m in value if m.get("role", "user") == "user")
    raise StageError(f"decontamination: cannot read a prompt from eval item of type {type(item).__name__}")


def read_prompt_file(path: str | Path) -> list[str]:
    """Extra eval prompts from a JSONL file (one item per line, as eval_item_text reads)."""
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: decontamination prompt file not found")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(eval_item_text(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise StageError(f"{path}:{n}: malformed JSON ({exc.msg})") from None
    return out


class Decontaminator:
    def __init__(self, eval_sets: Mapping[str, Iterable[Any]], *, ngram: int, threshold: float, min_shared_ngrams: int = 5) -> None:
        self.n, self.threshold, self.min_shared = ngram, threshold, min_shared_ngrams
        self.set_names: list[str] = []
        self.sizes: dict[str, int] = {}
        self._owner: list[int] = []  # eval prompt index → set index
        self._n_grams: list[int] = []  # eval prompt index → |W(E)|
        self._exact: dict[str, list[int]] = {}
        self._index: dict[int, list[int]] = {}  # n-gram hash → eval prompt indices
        self.removed: Counter[str] = Counter()
        for set_name, items in eval_sets.items():
            set_idx = len(self.set_names)
            self.set_names.append(set_name)
            self.sizes[set_name] = 0
            for item in items:
                ws = words(eval_item_text(item))
                if not ws:
                    continue
                pid = len(self._owner)
                self._owner.append(set_idx)
                self._exact.setdefault(" ".join(ws), []).append(pid)
                grams = self._grams(ws)
                self._n_grams.append(len(grams))
                for g in grams:
                    self._index.setdefault(g, []).append(pid)
                self.sizes[set_name] += 1

    def _grams(self, ws: list[str]) -> set[int]:
        """Distinct word n-gram hashes; empty for a text shorter than n words."""
        if len(ws) < self.n:
            return set()
        return set(ngram_hashes(ws, self.n))

    def match(self, text: str) -> str | None:
        return self.match_words(words(text))

    def match_words(self, ws: list[str]) -> str | None:
        """Name of the first eval set (in config order) this training text overlaps, else None."""
        hits_sets: set[int] = {self._owner[p] for p in self._exact.get(" ".join(ws), ())}
        grams = self._grams(ws)
        if grams:
            shared: Counter[int] = Counter()
            for g in grams:
                for pid in self._index.get(g, ()):
                    shared[pid] += 1
            for pid, h in shared.items():
                if h >= self.min_shared and (h / self._n_grams[pid] >= self.threshold or h / len(grams) >= self.threshold):
                    hits_sets.add(self._owner[pid])
        if not hits_sets:
            return None
        name = self.set_names[min(hits_sets)]
        self.removed[name] += 1
        return name

    def report(self) -> dict[str, dict[str, int]]:
        return {name: {"eval_prompts": self.sizes[name], "removed": self.removed[name]} for name in self.set_names}
