"""Source kind `target_queries`: user queries sampled from the target itself (docs/architecture.md, "Queries
sampled from the target").

An instruction-tuned target continues its chat template's opening of a user turn with a plausible user message:
the template renders [system…] + user header, the target samples until its end-of-turn token, and that text is a
query from the distribution the target was aligned on. The queries then go through the same selection
(filters, dedup, decontamination against every evaluation set) and answer regeneration as any other source, so
a drafter learns the target's answers to the requests its users are likely to make, with no dataset at all.

Work state: `<work_dir>/queries-<name>-<key>/` holds the sampled chunks (the regeneration's resume unit) and
`queries.jsonl` (one `{"id", "prompt"}` per kept query, written last). The key covers the options, the sampling
settings, the target's fingerprint and the chat mode, so a rerun with the same settings reuses the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftforge.chat import ChatMode, render_text
from draftforge.curate.config import RegenerateConfig, SourceConfig
from draftforge.curate.regenerate import Backend, iter_chunks, read_chunk, run_regeneration
from draftforge.errors import StageError
from draftforge.io import atomic_path, sha256_json

log = logging.getLogger(__name__)

SENTINEL = "\u2063draftforge-query\u2063"  # never in a template: marks where the user's text would start


@dataclass(frozen=True)
class QueryOptions:
    """`curate.sources[i].options` of a `target_queries` source."""

    size: int = 400  # queries sampled (before the finished / length / dedup / decontamination filters)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 96  # a query still running here is dropped (it would be cut mid-sentence)
    seed: int = 0

    @classmethod
    def of(cls, src: SourceConfig) -> QueryOptions:
        where = f"curate.sources[{src.name}].options"
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(src.options) - known)
        if bad:
            raise StageError(f"{where}: unknown option(s) {bad} for kind target_queries; known: {sorted(known)}")
        try:
            opts = cls(**{k: type(getattr(cls, k))(v) for k, v in src.options.items()})
        except (TypeError, ValueError) as exc:
            raise StageError(f"{where}: {exc}") from None
        if opts.size < 1 or opts.max_new_tokens < 1:
            raise StageError(f"{where}: size and max_new_tokens must be >= 1, got {opts.size}, {opts.max_new_tokens}")
        if opts.temperature <= 0 or not 0 < opts.top_p <= 1:
            raise StageError(f"{where}: temperature must be > 0 (greedy samples one query) and top_p in (0, 1], "
                             f"got {opts.temperature}, {opts.top_p}")  # fmt: skip
        return opts


def user_turn_prefix(tokenizer: Any, mode: ChatMode) -> list[int]:
    """Token ids of the chat template up to where a first user message's text begins (system turn included when
    the template adds one). Checked: the whole rendered turn starts with exactly these ids."""
    text = render_text(tokenizer, [{"role": "user", "content": SENTINEL}], mode)
    cut = text.find(SENTINEL)
    if cut <= 0:
        raise StageError("curate target_queries: the target's chat template does not render a user message's text "
                         "after a header; this source needs an instruction-tuned template")  # fmt: skip
    prefix = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not prefix or whole[: len(prefix)] != prefix:
        raise StageError("curate target_queries: the template's user header does not tokenize as a prefix of the "
                         "rendered turn; cannot sample queries from it")  # fmt: skip
    return [int(t) for t in prefix]


def sampling_config(base: RegenerateConfig, opts: QueryOptions) -> RegenerateConfig:
    """The regeneration settings with the query sampler's temperature, top-p, length and seed."""
    return dataclasses.replace(base, temperature=opts.temperature, top_p=opts.top_p,
                               max_new_tokens=opts.max_new_tokens, seed=opts.seed)  # fmt: skip


def synthesize(work_dir: Path, src: SourceConfig, rcfg: RegenerateConfig, tokenizer: Any, mode: ChatMode,
               fingerprint: str, make_backend: Callable[[RegenerateConfig], Backend], progress: bool) -> Path:
    """Sample `size` queries from the target (resumable per chunk) → the JSONL file a `prompt`-format source reads.
    Kept: queries the target closed with its end-of-turn token, non-empty after stripping."""
    opts = QueryOptions.of(src)
    prefix = user_turn_prefix(tokenizer, mode)
    qcfg = sampling_config(rcfg, opts)
    key = sha256_json({"opts": dataclasses.asdict(opts), "regen": dataclasses.asdict(qcfg), "prefix": prefix,
                       "target": fingerprint, **({"chat": mode.kwargs} if mode.kwargs else {})})[:16]  # fmt: skip
    qdir = work_dir / f"queries-{src.name}-{key}"
    out = qdir / "queries.jsonl"
    if out.is_file():
        log.info("target_queries %s: reusing %s", src.name, out)
        return out
    qdir.mkdir(parents=True, exist_ok=True)
    slots = qdir / "slots.jsonl"  # one row per query to sample; the prompt of every row is the user-turn prefix
    if not slots.is_file():
        with atomic_path(slots) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for i in range(opts.size):
                fh.write(json.dumps({"id": f"{src.name}-{i:06d}"}) + "\n")
    chunks = qdir / "chunks"
    stats = run_regeneration(slots, opts.size, chunks, qcfg, lambda: make_backend(qcfg), lambda row: prefix,
                             progress=progress)  # fmt: skip
    kept = unfinished = empty = 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for k, chunk in enumerate(iter_chunks(slots, qcfg.chunk_rows)):
            for row, gen in zip(chunk, read_chunk(chunks, k), strict=True):
                if gen["id"] != row["id"]:
                    raise StageError(f"{chunks}: chunk {k} does not match {slots} (delete {qdir} to sample again)")
                text = gen["text"].strip()
                if not gen["finished"]:
                    unfinished += 1
                elif not text:
                    empty += 1
                else:
                    fh.write(json.dumps({"id": row["id"], "prompt": text}, ensure_ascii=False) + "\n")
                    kept += 1
    log.info("target_queries %s: %d of %d sampled queries kept (%d unfinished at %d tokens, %d empty; %.0f s sampling)",
             src.name, kept, opts.size, unfinished, opts.max_new_tokens, empty, stats.seconds)  # fmt: skip
    if kept == 0:
        raise StageError(f"curate.sources[{src.name}]: none of {opts.size} sampled queries ended with the target's "
                         f"end-of-turn token within max_new_tokens={opts.max_new_tokens}")  # fmt: skip
    return out
