"""Typed config of the `curate` stage (torch-free). Owned by the curate stage.

Order of work (each step streams): sources → normalize → filters → decontaminate → exact/near dedup →
mixture quota per source → train/val split → regenerate the last assistant turn with the target →
tokenize with the target's chat template + loss mask → parquet shards + manifest (marker, last).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from draftforge.errors import check

SOURCE_KINDS = (
    "jsonl", "parquet", "hf_disk",  # generic files; records in ShareGPT, OpenAI or prompt/response form
    "chitchat", "chatterbot", "gsm_symbolic", "stdlib_code", "reasoning_gym",  # packaged default-world corpora
    "target_queries",  # user queries sampled from the target's own chat template (curate/queries.py)
)  # fmt: skip


@dataclass
class SourceConfig:
    name: str = "?"
    kind: str = "?"  # one of SOURCE_KINDS
    path: Optional[str] = None  # jsonl / parquet / hf_disk: a file or folder
    weight: float = 1.0  # share of curate.max_rows (when set) this source may fill
    cap: Optional[int] = None  # max rows kept from this source (after filters and dedup)
    # Deterministic streaming subsample: a record is considered iff hash(id) < sample (spreads a
    # quota over a whole ordered source, e.g. all stdlib modules rather than the first few).
    sample: float = 1.0
    # Kind-specific: gsm_symbolic {seed, size}; reasoning_gym {tasks (task or family names), seed, size per task};
    # chitchat {max_turns}; chatterbot {categories};
    # stdlib_code {tasks, tasks_per_function, max_function_lines, min_function_lines}; jsonl/parquet {format: auto|sharegpt|openai|prompt};
    # target_queries {size, temperature, top_p, max_new_tokens, seed} (curate/queries.py QueryOptions)
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FilterConfig:
    min_chars: int = 2  # every message's stripped content must be at least this long
    max_prompt_chars: int = 3000  # the prompt (all turns before the final assistant turn)
    max_prompt_tokens: int = 384  # prompt in target tokens (checked before regeneration)
    min_tokens: int = 8  # whole rendered conversation, after regeneration
    max_tokens: int = 768  # whole rendered conversation, after regeneration
    # What a source yielding zero usable rows does: "error" (StageError naming it) or "warn".
    on_empty_source: str = "error"
    # What a malformed record (bad JSON line, missing fields) does: "drop" (counted) or "error".
    on_malformed: str = "drop"

    def __post_init__(self) -> None:
        check(self.on_empty_source in ("error", "warn"), "curate.filters.on_empty_source", f"{self.on_empty_source!r}: use error or warn")
        check(self.on_malformed in ("drop", "error"), "curate.filters.on_malformed", f"{self.on_malformed!r}: use drop or error")


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    threshold: float = 0.8  # MinHash Jaccard over word shingles of the prompt
    num_perm: int = 64
    shingle: int = 3  # words per shingle


@dataclass
class DecontamConfig:
    enabled: bool = True
    eval_sets: bool = True  # every set of draftforge.evaluate.prompts.eval_prompt_sets(cfg)
    ngram: int = 6  # words per n-gram
    # A training prompt is contaminated when this fraction of an eval prompt's n-grams occur in it
    # (eval text inside training text) or of its n-grams occur in one eval prompt (training text is
    # a piece of an eval prompt). Texts shorter than `ngram` words match on their whole text.
    threshold: float = 0.5
    min_shared_ngrams: int = 5  # containment needs at least this many shared n-grams (exact copies always match)
    extra_sets: Dict[str, str] = field(default_factory=dict)  # name → JSONL path of extra eval prompts


@dataclass
class RegenerateConfig:
    enabled: bool = True
    backend: str = "auto"  # auto (vllm if importable, else hf) | vllm | hf
    temperature: float = 0.0
    top_p: float = 1.0
    # Sized to the measured CPU decode rate (~75-130 new tok/s, 135M fp32, 2 cores); raise on a faster machine.
    max_new_tokens: int = 64
    chunk_rows: int = 128  # rows per persisted chunk (unit of resume)
    batch_size: int = 16  # HF generate batch
    # A reply cut at max_new_tokens: keep (still the target's own text; trained without the end-of-turn
    # token, counted in manifest.truncated_kept) | drop (counted as a failure).
    truncated: str = "keep"
    seed: int = 0
    vllm_kv_cache_bytes: int = 1 << 30  # 1 GiB ≈ 23K tokens of SmolLM2 KV (46 KB/token): ~48 concurrent rows
    vllm_max_model_len: int = 1024
    vllm_max_num_seqs: int = 64

    def __post_init__(self) -> None:
        check(self.backend in ("auto", "vllm", "hf"), "curate.regenerate.backend", f"{self.backend!r}: use auto, vllm or hf")
        check(self.truncated in ("drop", "keep"), "curate.regenerate.truncated", f"{self.truncated!r}: use drop or keep")


def default_world_sources() -> list[SourceConfig]:
    """Four packaged real sources: 2.3K selected prompts → ≥ 2K regenerated training rows on 2 CPU cores."""
    return [
        # chitchat-dataset (MIT): real multi-turn chats; evaluate's held-out ids skipped
        SourceConfig(name="chitchat", kind="chitchat", weight=0.35, options={"max_turns": 3}),
        # chatterbot-corpus (BSD): English Q→A, incl. coding/computers
        SourceConfig(name="chatterbot", kind="chatterbot", weight=0.15),
        # reasoning-gym (Apache-2.0): item seeds [0, 3000), disjoint from evaluation's
        SourceConfig(name="gsm_symbolic", kind="gsm_symbolic", weight=0.2, options={"seed": 0, "size": 3000}),
        # Python stdlib functions → explain / docstring / complete / review prompts; sample spreads the
        # quota over all modules (file order is alphabetical)
        SourceConfig(name="stdlib_code", kind="stdlib_code", weight=0.3, sample=0.2,
                     options={"min_function_lines": 4, "max_function_lines": 24}),  # fmt: skip
    ]


@dataclass
class CurateConfig:
    sources: List[SourceConfig] = field(default_factory=default_world_sources)
    max_rows: Optional[int] = 2300  # cap on the kept mixture (split by source weight); null = no cap
    val_fraction: float = 0.05  # row in val iff hash(id) falls below it (deterministic)
    seed: int = 0
    shard_rows: int = 2048  # rows per parquet shard
    preview_rows: int = 20
    # "last": loss on the final (regenerated) assistant turn only; "all": every assistant turn.
    mask_turns: str = "last"
    filters: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(bool(self.sources), "curate.sources", "empty; list at least one source")
        names = [s.name for s in self.sources]
        check(len(set(names)) == len(names), "curate.sources", f"names must be unique, got {names}")
        check(0 <= self.val_fraction < 1, "curate.val_fraction", f"{self.val_fraction} must be in [0, 1)")
        check(self.mask_turns in ("last", "all"), "curate.mask_turns", f"{self.mask_turns!r}: use last or all")
