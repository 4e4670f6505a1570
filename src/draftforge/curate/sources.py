"""Source adapters: each yields, lazily and in a deterministic order, a `Row` or a `Drop` per record.

Generic: `jsonl`, `parquet`, `hf_disk` (records in OpenAI `messages`, ShareGPT `conversations` or
`prompt`/`response` form). Packaged default-world corpora: `chitchat`, `chatterbot`, `gsm_symbolic`,
`stdlib_code` (see `packaged.py`). `target_queries`: queries the stage sampled from the target (`queries.py`). Nothing here holds more than one file's worth of one record batch,
except the packaged chitchat JSON (a fixed 40 MB file).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftforge.curate.config import SOURCE_KINDS, SourceConfig
from draftforge.curate.schema import Drop, Row, messages_from_record, normalize_messages
from draftforge.errors import StageError

Item = Row | Drop


def _record_id(rec: Any, fallback: str) -> str:
    if isinstance(rec, dict):
        for key in ("id", "uuid", "conversation_id", "task_id"):
            if isinstance(rec.get(key), (str, int)):
                return str(rec[key])
    return fallback


def record_to_row(rec: Any, source: str, fallback_id: str, fmt: str = "auto", min_chars: int = 1) -> Item:
    """Normalize one raw record; a broken record comes back as a Drop (with its reason)."""
    try:
        msgs = normalize_messages(messages_from_record(rec, fmt), min_chars=min_chars)
    except Drop as drop:
        return drop
    return Row(id=f"{source}:{_record_id(rec, fallback_id)}", source=source, messages=msgs)


def _need_path(src: SourceConfig) -> Path:
    if not src.path:
        raise StageError(f"curate.sources[{src.name}].path: required for kind {src.kind!r}")
    path = Path(src.path).expanduser()
    if not path.exists():
        raise StageError(f"{path}: source {src.name!r} not found")
    return path


def checked_row(rec: Any, source: str, fallback_id: str, fmt: str, min_chars: int, on_malformed: str, where: str) -> Item:
    """record_to_row, except that a malformed record is one StageError naming `where` when so configured."""
    item = record_to_row(rec, source, fallback_id, fmt, min_chars)
    if isinstance(item, Drop) and item.reason == "malformed" and on_malformed == "error":
        raise StageError(f"{where}: {item}")
    return item


def iter_jsonl(src: SourceConfig, min_chars: int, on_malformed: str) -> Iterator[Item]:
    path = _need_path(src)
    fmt = src.options.get("format", "auto")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if on_malformed == "error":
                        raise StageError(f"{file}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start}); fix or remove "
                                         "the line, or set curate.on_malformed=drop to skip it") from None  # fmt: skip
                    yield Drop("malformed", f"{file.name}:{lineno}")
                    continue
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    if on_malformed == "error":
                        raise StageError(f"{file}:{lineno}: malformed JSON ({exc.msg})") from None
                    yield Drop("malformed", f"{file.name}:{lineno}")
                    continue
                yield checked_row(rec, src.name, f"{file.stem}-{lineno}", fmt, min_chars, on_malformed, f"{file}:{lineno}")


def iter_parquet(src: SourceConfig, min_chars: int, on_malformed: str) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = _need_path(src)
    fmt = src.options.get("format", "auto")
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    for file in files:
        try:
            pf = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as exc:
            raise StageError(f"{file}: not a readable parquet file ({exc})") from None
        n = 0
        for batch in pf.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                n += 1
                yield checked_row(rec, src.name, f"{file.stem}-{n}", fmt, min_chars, on_malformed, f"{file}: row {n}")


def iter_hf_disk(src: SourceConfig, min_chars: int, on_malformed: str) -> Iterator[Item]:
    path = _need_path(src)
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise StageError(
            f"curate.sources[{src.name}]: kind hf_disk needs the `datasets` package (pip install datasets); "
            "or export the data to JSONL/parquet"
        ) from None
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        split = src.options.get("split", "train")
        if split not in ds:
            raise StageError(f"{path}: split {split!r} not in {list(ds)}")
        ds = ds[split]
    fmt = src.options.get("format", "auto")
    for n, rec in enumerate(ds):
        yield checked_row(rec, src.name, str(n), fmt, min_chars, on_malformed, f"{path}: row {n}")


def iter_source(src: SourceConfig, *, min_chars: int, on_malformed: str, eval_cfg: Any = None) -> Iterator[Item]:
    """Dispatch on `src.kind`; errors about the source itself (missing file, bad option) are StageErrors."""
    from draftforge.curate import packaged

    if src.kind not in SOURCE_KINDS:
        raise StageError(f"curate.sources[{src.name}].kind: {src.kind!r} is not one of {SOURCE_KINDS}")
    if src.kind == "target_queries":  # the stage sampled them into a prompt-form JSONL (curate/queries.py)
        if src.path is None:
            raise StageError(f"curate.sources[{src.name}]: kind target_queries is sampled by the curate stage "
                             "(resolve_query_sources) before it can be read")  # fmt: skip
        return iter_jsonl(dataclasses.replace(src, options={"format": "prompt"}), min_chars, on_malformed)
    generic = {"jsonl": iter_jsonl, "parquet": iter_parquet, "hf_disk": iter_hf_disk}
    if src.kind in generic:
        return generic[src.kind](src, min_chars, on_malformed)
    return packaged.iter_packaged(src, min_chars=min_chars, eval_cfg=eval_cfg)
