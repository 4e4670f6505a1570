"""Streaming selection: sources → filters → decontamination → dedup → mixture quota → split.

Memory: one record at a time, plus the dedup index of kept rows (bounded by the quotas) and the
eval-prompt index. Selected rows are streamed to a JSONL file, never held in a list.

Mixture: with curate.max_rows = M and weights w_s, source s keeps at most
quota_s = min(cap_s, floor(M * w_s / sum(w))) rows (no max_rows: quota_s = cap_s, or unlimited);
rows are taken in the source's own deterministic order, first come first kept. A source whose rows
run out leaves its unused share empty (documented; not redistributed).
Past its quota a source is normally not read further; with `read_past_quota` its remaining rows are
still checked (and counted as over_quota / duplicates / contaminated) without growing any index.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from draftforge.curate.config import CurateConfig, SourceConfig
from draftforge.curate.decontam import Decontaminator
from draftforge.curate.dedup import Deduper, words
from draftforge.curate.schema import Drop, Row, prompt_messages, prompt_text
from draftforge.errors import StageError

log = logging.getLogger(__name__)


def unit_hash(key: str) -> float:
    """Deterministic uniform [0, 1) from a string."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / float(1 << 48)


def split_of(row_id: str, val_fraction: float) -> str:
    """Deterministic: depends on the id only (not on order, source mix or run)."""
    return "val" if unit_hash(row_id) < val_fraction else "train"


def quotas(cfg: CurateConfig) -> dict[str, int | None]:
    total_w = sum(max(0.0, s.weight) for s in cfg.sources)
    out: dict[str, int | None] = {}
    for s in cfg.sources:
        q = s.cap
        if cfg.max_rows is not None:
            share = int(cfg.max_rows * max(0.0, s.weight) / total_w) if total_w > 0 else 0
            q = share if q is None else min(q, share)
        out[s.name] = q
    return out


@dataclass
class SourceStats:
    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"in": self.read, "selected": self.kept, "dropped": dict(sorted(self.dropped.items()))}


@dataclass
class Selection:
    n_rows: int = 0
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    decontam: dict[str, dict[str, int]] = field(default_factory=dict)
    splits: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def check_row(row: Row, cfg: CurateConfig, count_tokens: Callable[[list[dict[str, str]]], int] | None) -> list[dict[str, str]]:
    """The prompt messages of a row (ending on a user turn) or Drop."""
    if not any(m["role"] == "user" for m in row.messages):
        raise Drop("no_user_turn")
    msgs = prompt_messages(row.messages) if cfg.regenerate.enabled else row.messages
    if not cfg.regenerate.enabled and msgs[-1]["role"] != "assistant":
        raise Drop("no_assistant_turn", "regeneration is off and the row has no answer")
    body = msgs if cfg.regenerate.enabled else msgs[:-1]
    if sum(len(m["content"]) for m in body) > cfg.filters.max_prompt_chars:
        raise Drop("too_long_prompt_chars")
    if count_tokens is not None and count_tokens(prompt_messages(msgs)) > cfg.filters.max_prompt_tokens:
        raise Drop("too_long_prompt_tokens")
    return msgs


def select_rows(
    cfg: CurateConfig,
    items_of: Callable[[SourceConfig], Iterable[Row | Drop]],
    decontaminator: Decontaminator | None,
    sink: Callable[[dict[str, Any]], None],
    count_tokens: Callable[[list[dict[str, str]]], int] | None = None,
    read_past_quota: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Selection:
    """Stream every source through the checks; call `sink(record)` for each selected row, in order."""
    d = cfg.dedup
    dedup = Deduper(exact=d.exact, near=d.near, threshold=d.threshold, num_perm=d.num_perm, shingle=d.shingle)
    sel = Selection()
    q = quotas(cfg)
    t0 = time.perf_counter()
    for src in cfg.sources:
        st = sel.per_source.setdefault(src.name, SourceStats())
        quota = q[src.name]
        for item in items_of(src):
            if quota is not None and st.kept >= quota and not read_past_quota:
                break  # rows not read are not "in"
            st.read += 1
            if progress is not None:
                progress(1)
            try:
                if isinstance(item, Drop):
                    raise item
                if src.sample < 1.0 and unit_hash("sample:" + item.id) >= src.sample:
                    raise Drop("not_sampled")
                msgs = check_row(item, cfg, count_tokens)
                ws = words(prompt_text(msgs))  # normalized once for both checks
                if decontaminator is not None and (hit := decontaminator.match_words(ws)) is not None:
                    raise Drop(f"contaminated:{hit}")
                reason, state = dedup.check_words(ws)
                if reason is not None:
                    raise Drop(reason)
                if quota is not None and st.kept >= quota:
                    raise Drop("over_quota")
            except Drop as drop:
                st.dropped[drop.reason] += 1
                continue
            dedup.add(state)
            split = split_of(item.id, cfg.val_fraction)
            sink({"id": item.id, "source": item.source, "split": split, "messages": msgs})
            st.kept += 1
            sel.splits[split] += 1
            sel.n_rows += 1
        if st.kept == 0:
            message = f"curate.sources[{src.name}]: zero usable rows (read {st.read}, dropped {dict(st.dropped)})"
            if cfg.filters.on_empty_source == "error":
                raise StageError(message)
            log.warning(message)
        log.info("source %s: read %d, selected %d, dropped %s", src.name, st.read, st.kept, dict(st.dropped))
    sel.seconds = time.perf_counter() - t0
    if decontaminator is not None:
        sel.decontam = decontaminator.report()
    return sel

