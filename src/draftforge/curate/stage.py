"""`python -m draftforge.curate`: select → regenerate → tokenize → shards + manifest (marker, last).

Work state (survives Snakemake deleting a failed job's outputs) lives in ctx.work_dir:
  selection-<key>/selected.jsonl + selection.json   the selected prompts (key: selection config,
                                                    eval sets, target fingerprint)
  regen-<key>/chunk-NNNNN.jsonl                     regenerated answers per chunk (resume unit)
Outputs in ctx.out_dir: {train,val}-NNNNN.parquet, preview.jsonl, token_hist.png, manifest.json.
Accounting (checked before the manifest is written): per source, in = kept + dropped + failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from tqdm import tqdm

from draftforge.chat import RECORD_KEY, ChatMode, prompt_ids
from draftforge.curate.config import CurateConfig, RegenerateConfig
from draftforge.curate.decontam import Decontaminator, read_prompt_file
from draftforge.curate.queries import synthesize
from draftforge.curate.regenerate import (
    HFBackend,
    RegenStats,
    VLLMBackend,
    choose_backend,
    iter_chunks,
    read_chunk,
    run_regeneration,
)  # fmt: skip
from draftforge.curate.schema import Drop
from draftforge.curate.select import select_rows
from draftforge.curate.sources import iter_source
from draftforge.curate.tokenize import end_of_turn_ids, special_strings, tokenize_conversation
from draftforge.curate.writer import ShardWriter, TokenStats
from draftforge.errors import StageError
from draftforge.io import atomic_path, read_json, sha256_json, write_json

log = logging.getLogger(__name__)


def curate_config(cfg: Any) -> CurateConfig:
    """The structured section (its values were checked by the dataclasses at compose time)."""
    return OmegaConf.to_object(cfg.curate) if not isinstance(cfg.curate, CurateConfig) else cfg.curate


def load_eval_sets(cfg: Any, ccfg: CurateConfig) -> dict[str, list[Any]]:
    """Every prompt set the evaluate stage uses, plus curate.decontam.extra_sets (JSONL files)."""
    sets: dict[str, list[Any]] = {}
    if ccfg.decontam.eval_sets:
        try:
            from draftforge.evaluate.prompts import eval_prompt_sets
        except ImportError as exc:
            raise StageError(f"decontamination: draftforge.evaluate.prompts unavailable ({exc})") from None
        sets.update(eval_prompt_sets(cfg))
    for name, path in ccfg.decontam.extra_sets.items():
        sets[name] = read_prompt_file(path)
    return sets


def _drop_stale_outputs(out_dir: Path) -> None:
    """Remove a previous run's marker first, then its shards: a half-written set never looks finished."""
    for name in ("manifest.json",):
        (out_dir / name).unlink(missing_ok=True)
    for pattern in ("train-*.parquet", "val-*.parquet"):
        for p in out_dir.glob(pattern):
            p.unlink()


def build_selection(ctx_work: Path, cfg: Any, ccfg: CurateConfig, tokenizer: Any, fingerprint: str, progress: bool,
                    mode: ChatMode) -> tuple[Path, dict[str, Any]]:
    """Selected rows (JSONL) + their stats; reused when the same selection was finished before. Prompt lengths
    are counted in the target's chat mode, so the mode is part of the key (when set: {} keeps earlier keys)."""
    eval_sets = load_eval_sets(cfg, ccfg) if ccfg.decontam.enabled else {}
    sel_cfg = {k: v for k, v in dataclasses.asdict(ccfg).items() if k not in ("regenerate", "shard_rows", "preview_rows")}
    sel_cfg["regenerate_enabled"] = ccfg.regenerate.enabled
    key = sha256_json({"cfg": sel_cfg, "eval": eval_sets, "target": fingerprint,
                       **({"chat": mode.kwargs} if mode.kwargs else {})})[:16]
    sel_dir = ctx_work / f"selection-{key}"
    rows_path, stats_path = sel_dir / "selected.jsonl", sel_dir / "selection.json"
    if rows_path.is_file() and stats_path.is_file():
        log.info("selection %s: reusing %s", key, rows_path)
        return rows_path, read_json(stats_path, "selection stats")
    decon = None
    if ccfg.decontam.enabled:
        decon = Decontaminator(
            eval_sets, ngram=ccfg.decontam.ngram, threshold=ccfg.decontam.threshold,
            min_shared_ngrams=ccfg.decontam.min_shared_ngrams,
        )  # fmt: skip
        log.info("decontamination against %s", {k: len(v) for k, v in eval_sets.items()})

    def count_tokens(msgs: list[dict[str, str]]) -> int:
        return len(prompt_ids(tokenizer, msgs, mode))

    def items_of(src):  # noqa: ANN001
        return iter_source(src, min_chars=ccfg.filters.min_chars, on_malformed=ccfg.filters.on_malformed, eval_cfg=cfg.get("evaluate"))

    bar = tqdm(desc="select", unit="row", disable=not progress)
    with atomic_path(rows_path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        sel = select_rows(
            ccfg, items_of, decon, lambda rec: fh.write(json.dumps(rec, ensure_ascii=False) + "\n"),
            count_tokens=count_tokens, progress=bar.update,
        )  # fmt: skip
    bar.close()
    stats = {
        "key": key,
        "n_rows": sel.n_rows,
        "per_source": {k: v.to_dict() for k, v in sel.per_source.items()},
        "decontamination": sel.decontam,
        "splits": dict(sel.splits),
        "seconds": round(sel.seconds, 2),
    }
    write_json(stats_path, stats)
    return rows_path, stats


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def target_backend(info: dict[str, Any], tokenizer: Any, rcfg: RegenerateConfig, eot: set[int]) -> Any:
    """The target as a generation backend: vLLM when chosen, else HF generate (on the GPU when one is visible)."""
    if choose_backend(rcfg) == "vllm":
        return VLLMBackend(info["hf_path"], tokenizer, rcfg, eot)
    from draftforge.target.load import load_target_model

    if _cuda_available():
        import torch

        return HFBackend(load_target_model(info, dtype=getattr(torch, info.get("dtype") or "bfloat16"), device="cuda"),
                         tokenizer, rcfg, eot)  # fmt: skip
    return HFBackend(load_target_model(info), tokenizer, rcfg, eot)


def regenerate_all(ctx_work: Path, ccfg: CurateConfig, info: dict[str, Any], tokenizer: Any, eot: set[int], rows_path: Path,
                   sel: dict[str, Any], progress: bool, mode: ChatMode,
                   make_backend: Callable[[], Any] | None = None) -> tuple[Path, RegenStats]:
    """Answer every selected row with the target. Both backends (HF generate, vLLM `generate` on TokensPrompt)
    take the prompt ids `chat.prompt_ids` renders in `mode`; vLLM never applies a chat template itself."""
    rcfg = ccfg.regenerate
    backend_name = choose_backend(rcfg)
    # HF generate runs on the GPU when one is visible (the target's dtype there); a GPU run never
    # resumes a CPU run's chunks (different numerics), while CPU keys stay what they were.
    hf_cuda = backend_name == "hf" and _cuda_available()
    backend_key = backend_name + ("-cuda" if hf_cuda else "")
    key = sha256_json({"sel": sel["key"], "regen": dataclasses.asdict(rcfg), "backend": backend_key, "target": info["fingerprint"],
                       **({"chat": mode.kwargs} if mode.kwargs else {})})[:16]
    chunk_dir = ctx_work / f"regen-{key}"
    stats = run_regeneration(
        rows_path, sel["n_rows"], chunk_dir, rcfg, make_backend or (lambda: target_backend(info, tokenizer, rcfg, eot)),
        lambda row: prompt_ids(tokenizer, row["messages"], mode), progress=progress,
    )  # fmt: skip
    return chunk_dir, stats


def resolve_query_sources(ctx_work: Path, ccfg: CurateConfig, info: dict[str, Any], tokenizer: Any, eot: set[int],
                          progress: bool, mode: ChatMode,
                          make_backend: Callable[[RegenerateConfig], Any] | None = None) -> CurateConfig:
    """Sample every `target_queries` source's queries (or reuse them) → the config with each such source reading
    its sampled file as prompt-form JSONL."""
    if not any(s.kind == "target_queries" for s in ccfg.sources):
        return ccfg
    factory = make_backend or (lambda rcfg: target_backend(info, tokenizer, rcfg, eot))
    sources = []
    for src in ccfg.sources:
        if src.kind == "target_queries":
            path = synthesize(ctx_work, src, ccfg.regenerate, tokenizer, mode, info["fingerprint"], factory, progress)
            src = dataclasses.replace(src, path=str(path))
        sources.append(src)
    return dataclasses.replace(ccfg, sources=sources)


def write_outputs(out_dir: Path, ccfg: CurateConfig, tokenizer: Any, eot: set[int], rows_path: Path, sel: dict[str, Any],
                  chunk_dir: Path | None, mode: ChatMode) -> dict[str, Any]:
    """Tokenize every selected row (+ its regenerated answer) into shards; returns the accounting."""
    f = ccfg.filters
    _drop_stale_outputs(out_dir)
    writers = {s: ShardWriter(out_dir, s, ccfg.shard_rows) for s in ("train", "val")}
    tstats = TokenStats()
    dropped: dict[str, Counter[str]] = {s: Counter() for s in sel["per_source"]}
    failed: dict[str, Counter[str]] = {s: Counter() for s in sel["per_source"]}
    kept: Counter[str] = Counter()
    truncated_kept = 0
    answers: Counter[str] = Counter()  # regenerated answers per source
    cut: Counter[str] = Counter()  # of which hit max_new_tokens without an end of turn
    preview: list[dict[str, Any]] = []
    chunk_rows = ccfg.regenerate.chunk_rows
    specials = special_strings(tokenizer)
    for k, chunk in enumerate(iter_chunks(rows_path, chunk_rows) if sel["n_rows"] else []):
        gens = read_chunk(chunk_dir, k) if chunk_dir is not None else [None] * len(chunk)
        for row, gen in zip(chunk, gens, strict=True):
            src, msgs, eot_in_mask = row["source"], row["messages"], True
            if gen is not None:
                if gen["id"] != row["id"]:
                    raise StageError(f"{chunk_dir}: chunk {k} does not match the selection (delete it to regenerate)")
                text = gen["text"].strip()
                if not text:
                    failed[src]["empty_generation"] += 1
                    continue
                answers[src] += 1
                if not gen["finished"]:
                    cut[src] += 1
                    if ccfg.regenerate.truncated == "drop":
                        failed[src]["truncated"] += 1
                        continue
                    eot_in_mask, truncated_kept = False, truncated_kept + 1
                msgs = msgs + [{"role": "assistant", "content": text}]
            try:
                tok = tokenize_conversation(tokenizer, msgs, eot, ccfg.mask_turns, eot_in_mask, specials, mode=mode)
                n = len(tok.input_ids)
                if n > f.max_tokens:
                    raise Drop("too_long_tokens")
                if n < f.min_tokens:
                    raise Drop("too_short_tokens")
            except Drop as drop:
                dropped[src][drop.reason] += 1
                continue
            writers[row["split"]].add(row["id"], src, tok.input_ids, tok.loss_mask)
            kept[src] += 1
            n_masked = sum(tok.loss_mask)
            tstats.add(n, n_masked)
            if len(preview) < ccfg.preview_rows:
                masked = tokenizer.decode([t for t, m in zip(tok.input_ids, tok.loss_mask) if m])
                preview.append({"id": row["id"], "source": src, "split": row["split"], "messages": msgs,
                                "n_tokens": n, "n_masked": n_masked, "masked_text": masked})  # fmt: skip
    for w in writers.values():
        w.flush()
    with atomic_path(out_dir / "preview.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in preview))
    per_source = {}
    for name, st in sel["per_source"].items():
        drops = Counter(st["dropped"]) + dropped[name]
        entry = {"in": st["in"], "kept": kept[name], "dropped": dict(sorted(drops.items())),
                 "failed": dict(sorted(failed[name].items()))}  # fmt: skip
        total = entry["kept"] + sum(entry["dropped"].values()) + sum(entry["failed"].values())
        if total != entry["in"]:
            raise AssertionError(f"curate accounting broken for {name}: in {entry['in']} != {total}")
        per_source[name] = entry
    if tstats.n_tokens:
        tstats.plot(out_dir / "token_hist.png", f"curate: {len(tstats.n_tokens)} rows")
    return {
        "per_source": per_source,
        "shards": {s: w.files for s, w in writers.items()},
        "rows": {s: w.n_rows for s, w in writers.items()},
        "token_stats": tstats.summary(),
        "truncated_kept": truncated_kept,
        "truncation": truncation_report(answers, cut, ccfg.regenerate.max_new_tokens),
    }


def truncation_report(answers: Counter[str], cut: Counter[str], max_new_tokens: int) -> dict[str, Any]:
    """Share of regenerated answers that hit max_new_tokens without an end of turn (overall, per source):
    such rows train the drafter on cut answers that never show the end of a turn."""
    n, t = sum(answers.values()), sum(cut.values())
    return {"max_new_tokens": max_new_tokens, "answers": n, "truncated": t, "rate": round(t / n, 4) if n else 0.0,
            "per_source": {k: {"answers": answers[k], "truncated": cut[k], "rate": round(cut[k] / answers[k], 4)}
                           for k in sorted(answers)}}  # fmt: skip


def totals(per_source: dict[str, Any]) -> dict[str, Any]:
    drops: Counter[str] = Counter()
    fails: Counter[str] = Counter()
    for e in per_source.values():
        drops.update(e["dropped"])
        fails.update(e["failed"])
    return {
        "in": sum(e["in"] for e in per_source.values()),
        "kept": sum(e["kept"] for e in per_source.values()),
        "dropped": sum(drops.values()),
        "failed": sum(fails.values()),
        "drops_by_reason": dict(sorted(drops.items())),
        "failures_by_reason": dict(sorted(fails.items())),
    }


def main(ctx: Any, make_backend: Callable[[], Any] | None = None,
         make_query_backend: Callable[[RegenerateConfig], Any] | None = None) -> None:
    from draftforge.target.load import load_tokenizer, read_target_info

    t0 = time.perf_counter()
    ccfg = curate_config(ctx.cfg)
    mode = ChatMode.of(ctx.cfg)  # the target's chat mode: every prompt, answer and mask below is rendered in it
    info = read_target_info(ctx.input_marker("target"))
    tokenizer = load_tokenizer(info)
    eot = end_of_turn_ids(tokenizer, info.get("eos_token_ids") or ())
    progress = ctx.is_rank0
    ccfg = resolve_query_sources(ctx.work_dir, ccfg, info, tokenizer, eot, progress, mode, make_query_backend)
    rows_path, sel = build_selection(ctx.work_dir, ctx.cfg, ccfg, tokenizer, info["fingerprint"], progress, mode)
    regen: RegenStats | None = None
    chunk_dir = None
    if ccfg.regenerate.enabled and sel["n_rows"]:
        chunk_dir, regen = regenerate_all(ctx.work_dir, ccfg, info, tokenizer, eot, rows_path, sel, progress, mode,
                                          make_backend)
    out = write_outputs(ctx.out_dir, ccfg, tokenizer, eot, rows_path, sel, chunk_dir, mode)
    if out["rows"]["train"] == 0:
        raise StageError(f"curate: no training rows survived (per source: {out['per_source']})")
    seconds = time.perf_counter() - t0
    tot = totals(out["per_source"])
    regen_info = dataclasses.asdict(regen) if regen else {"enabled": False}
    if regen and regen.seconds > 0:
        regen_info["rows_per_s"] = round(regen.rows_generated / regen.seconds, 3)
        regen_info["new_tokens_per_s"] = round(regen.new_tokens / regen.seconds, 1)
    manifest = {
        "format": "draftforge.curate/1",
        "target_fingerprint": info["fingerprint"],
        "target_name": info["name"],
        RECORD_KEY: mode.kwargs,  # the chat mode the data was rendered in: extract and train carry it forward
        "shards": out["shards"],
        "rows": out["rows"],
        "counts": tot,
        "per_source": out["per_source"],
        "decontamination": sel["decontamination"],
        "token_stats": out["token_stats"],
        "truncated_kept": out["truncated_kept"],
        "truncation": out["truncation"],
        "regeneration": regen_info,
        "selection_seconds": sel["seconds"],
        "seconds": round(seconds, 2),
        "mask": {"turns": ccfg.mask_turns, "end_of_turn_ids": sorted(eot)},
        "config_hash": ctx.config_hash,
    }
    if ctx.is_rank0:
        log_mlflow(ctx, manifest)
    write_json(ctx.out_dir / "manifest.json", manifest)  # marker: last
    log.info("curate: kept %d (train %d, val %d) of %d in %.0fs", tot["kept"], out["rows"]["train"], out["rows"]["val"], tot["in"], seconds)


def log_mlflow(ctx: Any, manifest: dict[str, Any]) -> None:
    from draftforge.tracking import mlflow_run

    metrics: dict[str, float] = {f"count_{k}": v for k, v in manifest["counts"].items() if isinstance(v, int)}
    metrics.update({f"drop_{k.replace(':', '_')}": v for k, v in manifest["counts"]["drops_by_reason"].items()})
    metrics.update({f"fail_{k}": v for k, v in manifest["counts"]["failures_by_reason"].items()})
    for name, e in manifest["per_source"].items():
        metrics[f"kept_{name}"] = e["kept"]
    for name, d in manifest["decontamination"].items():
        metrics[f"decontam_{name}"] = d["removed"]
    metrics.update({f"tokens_{k}": v for k, v in manifest["token_stats"].items()})
    regen = manifest["regeneration"]
    for k in ("rows_per_s", "new_tokens_per_s", "rows_generated", "chunks_resumed"):
        if k in regen:
            metrics[f"regen_{k}"] = regen[k]
    metrics["regen_truncation_rate"] = manifest["truncation"]["rate"]
    metrics["seconds"] = manifest["seconds"]
    with mlflow_run(**ctx.tracking_kwargs(), run_name="curate", params=ctx.params) as run:
        run.log_metrics(metrics)
        for name in ("token_hist.png", "preview.jsonl"):
            if (ctx.out_dir / name).is_file():
                run.log_artifact(ctx.out_dir / name)
