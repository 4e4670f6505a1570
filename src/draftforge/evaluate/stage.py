"""`evaluate` stage, one branch per listed drafter: AR and the methods of the branch's drafter (dflash: DFlash /
DDTree; dspark: DSpark / DDTree / DDTree-Markov; mtp: MTP) on the eval prompt sets → results/<exp>/evaluate/<name>/.

Outputs: `<dataset>.json` (rows + per-response records) per dataset, then the marker
`evaluate.json` (all rows; row keys shared with `baselines` so `report` merges them). A rerun after an
interruption reuses the datasets that finished with the same inputs (evaluate/resume.py).
One MLflow run per (dataset, method, budget, temperature), tagged method/dataset/budget/engine (tree
methods: auto_budget / best_budget). Timing: evaluate.repeats interleaved passes (runner.run_dataset), rows
report medians with min/max; calibration prompts choose the auto budget (evaluate/budget.py). Engine loading
and every timed pass hold the machine-wide timing lock (draftforge/timing_lock.py).
CPU by default; with evaluate.gpus = N under torchrun each rank holds one model copy on its GPU,
takes every N-th prompt, and rank 0 merges the records.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from draftforge.chat import RECORD_KEY, ChatMode, check_served
from draftforge.drafter.registry import (
    BLOCK_DRAFTER,
    MTP_HEAD,
    artifact_of_method,
    drafter_types,
    exported_type,
    tree_methods,
)
from draftforge.drafter.settings import branch_methods
from draftforge.errors import StageError
from draftforge.evaluate.aggregate import calibration_records, rows_of
from draftforge.evaluate.budget import mark_auto
from draftforge.evaluate.config import EvaluateConfig
from draftforge.evaluate.prompts import category_of, eval_and_calibration_sets, prompts_at
from draftforge.evaluate.resume import clear_finished, dataset_key, load_finished, save_finished
from draftforge.evaluate.runner import EngineSet, calibration_plan, method_plan, run_dataset
from draftforge.evaluate.sampling_check import check_line, pooled_checks
from draftforge.io import write_json
from draftforge.runtime import dtype_named, init_distributed, pick_device
from draftforge.stages import STAGE_MARKERS

log = logging.getLogger(__name__)
BEST_NOTE = ("best DDTree budget (oracle) = highest decode tokens/s, chosen on the evaluation data itself (as published "
             "numbers do); auto budget = highest τ/round cost on the calibration prompts, chosen without the evaluation data")


def evaluate_config(ctx) -> EvaluateConfig:
    cfg = OmegaConf.to_object(ctx.cfg.evaluate)  # the structured EvaluateConfig (validated at compose)
    if not isinstance(cfg, EvaluateConfig):
        cfg = EvaluateConfig(**OmegaConf.to_container(ctx.cfg.evaluate, resolve=True))
    return cfg


def pick_dtype(cfg: EvaluateConfig, target_dtype: str, device: torch.device) -> torch.dtype:
    name = cfg.dtype or (target_dtype if device.type == "cuda" else "float32")
    return dtype_named("evaluate.dtype", name)


def load_engines(ctx, cfg: EvaluateConfig, info: dict[str, Any], plan, device, dtype, mode: ChatMode) -> EngineSet:
    from draftforge.engine import wrap_target
    from draftforge.target.load import load_target_model, load_tokenizer

    drafter = None
    if uses(plan, BLOCK_DRAFTER):
        from draftforge.drafter import load_drafter

        ctx.input_marker("train")
        where = ctx.input_dir("train") / BLOCK_DRAFTER
        drafter = load_drafter(where, dtype=dtype, device=device, attn_impl="sdpa")
        check_drafter(drafter.cfg, info, where)
        check_methods(plan, drafter.cfg, where)
    model = load_target_model(info, dtype=dtype, device=str(device))
    taps = list(drafter.cfg.target_layer_ids) if drafter is not None else []
    try:
        tm = wrap_target(model, taps)
    except ValueError as exc:
        raise StageError(f"{info['hf_path']}: {exc}") from None
    eos = [int(e) for e in (info.get("eos_token_ids") or [])]
    head = load_mtp(ctx, cfg, info, device, dtype) if uses(plan, MTP_HEAD) else None
    return EngineSet(tm=tm, drafter=drafter, tokenizer=load_tokenizer(info), eos_ids=eos, max_new_tokens=cfg.max_new_tokens,
                     engine=captured_engine(cfg, tm, drafter, head, plan), mtp=head, chat_mode=mode)


def load_mtp(ctx, cfg: EvaluateConfig, info: dict[str, Any], device, dtype):
    """The `mtp` method's head: the target's own MTP layer when it has one, else the train stage's
    trained head (train/mtp); a clear error when neither exists."""
    from draftforge.drafter.mtp import load_mtp_head

    if int(info.get("mtp_layers") or 0) > 0:
        where, source = info["hf_path"], "native"
    else:
        where, source = ctx.input_dir("train") / MTP_HEAD, "trained"
        if not (where / "config.json").is_file():
            raise StageError(f"evaluate.methods: 'mtp' needs an MTP head: target {info.get('name')!r} has no MTP "
                             f"layers and {where} does not exist (list mtp in `drafters`: its train branch trains one)")
    try:
        head = load_mtp_head(where, source=source, dtype=dtype, device=device)
    except ValueError as exc:
        raise StageError(f"evaluate.methods: 'mtp': {exc}") from None
    if head.hidden_size != int(info["hidden_size"]):
        raise StageError(f"{where}: MTP head width {head.hidden_size} != target hidden_size {info['hidden_size']}")
    head.num_drafts = int(cfg.mtp_drafts)
    return head


def captured_engine(cfg: EvaluateConfig, tm, drafter, head, plan):
    """evaluate.engine: None for eager; a captured engine with one verify bucket per planned method, each the
    method's own verify size ("compiled": the same with fused projections and torch.compile'd layer blocks,
    docs/architecture.md)."""
    if cfg.engine == "eager":
        return None
    from draftforge.engine.graph import CapturedEngine, verify_buckets
    from draftforge.engine.methods import make_method

    sizes = [make_method(m, tm, head if artifact_of_method(m) == MTP_HEAD else drafter, b).verify_size
             for m, b in plan if m != "ar"]
    try:
        eng = CapturedEngine(tm, cfg.engine_capacity, verify_buckets(sizes), drafter=drafter,
                             compile=cfg.engine == "compiled")
    except ValueError as exc:
        raise StageError(f"evaluate.engine={cfg.engine}: {exc}") from None
    eng.capture()
    return eng


def serves_trained(plan, info: dict[str, Any]) -> bool:
    """Whether a planned method drafts with weights the branch's train stage made: the block drafter, or an MTP
    head on a target without MTP layers (a native head was not trained on curate's data)."""
    return uses(plan, BLOCK_DRAFTER) or (uses(plan, MTP_HEAD) and int(info.get("mtp_layers") or 0) == 0)


def uses(plan, artifact: str) -> bool:
    """Whether a planned method drafts with this artifact of the branch's train output (drafter.registry)."""
    return any(artifact_of_method(m) == artifact for m, _ in plan)


def check_methods(plan, dcfg, where) -> None:
    """Every planned block-drafter method runs on the exported drafter's format: a branch whose type needs
    another format (a dspark branch whose export is DFlash, e.g. rank 0) is refused before any generation."""
    owner = exported_type(dcfg.ARCHITECTURE)
    can = owner.engine_methods if owner is not None else ()
    bad = sorted({m for m, _ in plan if artifact_of_method(m) == BLOCK_DRAFTER and m not in can})
    if bad:
        need = next((t.title for t in drafter_types().values() if set(bad) <= set(t.engine_methods)), "another")
        title = owner.title if owner is not None else dcfg.ARCHITECTURE
        raise StageError(f"evaluate.methods: {bad} need a {need} drafter; {where} is a {title} drafter "
                         f"(it runs {' / '.join(can)})")


def check_drafter(dcfg, info: dict[str, Any], where) -> None:
    problems = []
    if dcfg.hidden_size != int(info["hidden_size"]):
        problems.append(f"hidden_size {dcfg.hidden_size} != target {info['hidden_size']}")
    if dcfg.vocab_size != int(info["vocab_size"]):
        problems.append(f"vocab_size {dcfg.vocab_size} != target {info['vocab_size']}")
    if any(not 0 <= t < int(info["num_layers"]) for t in dcfg.target_layer_ids):
        problems.append(f"target_layer_ids {dcfg.target_layer_ids} outside the target's {info['num_layers']} layers")
    if problems:
        raise StageError(f"{where}: drafter does not fit this target: " + "; ".join(problems))


def gather_records(ctx, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if ctx.world_size == 1:
        return records
    parts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(parts, records)
    return [r for part in parts for r in part]


def main(ctx) -> None:
    from draftforge.target.load import read_target_info

    cfg = evaluate_config(ctx)
    mode = ChatMode.of(ctx.cfg)  # the target's chat mode: every prompt is rendered in it
    info = read_target_info(ctx.input_marker("target"))
    positions = int(info.get("max_position_embeddings") or 0)
    if positions and cfg.max_new_tokens > positions:  # before any model loads
        raise StageError(f"evaluate.max_new_tokens: {cfg.max_new_tokens} is above the target's max_position_embeddings "
                         f"{positions}; set it below {positions} minus the prompt length")
    plan = method_plan(branch_methods(ctx.cfg.drafter.type, cfg.methods), cfg.budgets)
    if uses(plan, BLOCK_DRAFTER):  # a drafter trained for another target: refuse before any work
        from draftforge.drafter.config import check_drafter_target

        ctx.input_marker("train")
        check_drafter_target(ctx.input_dir("train") / BLOCK_DRAFTER, info)
    # A drafter trained in another chat mode: refused, or (allowed) every row says so. The block drafter needs the
    # train marker (above); a trained MTP head is checked when its marker is there (a missing head is load_mtp's error).
    mismatch = None
    train_marker = ctx.input_dir("train") / STAGE_MARKERS["train"]
    if serves_trained(plan, info) and train_marker.is_file():
        mismatch = check_served(mode, train_marker, "evaluate.allow_chat_mode_mismatch", cfg.allow_chat_mode_mismatch)
        if mismatch:
            log.warning("evaluate: chat mode mismatch (%s): evaluate.allow_chat_mode_mismatch=true, rows labelled", mismatch)
    if cfg.gpus > 0 and ctx.world_size != cfg.gpus:
        log.warning("evaluate.gpus=%d but WORLD_SIZE=%d: using %d rank(s)", cfg.gpus, ctx.world_size, ctx.world_size)
    device = pick_device("evaluate.gpus", "auto", cfg.gpus, ctx.local_rank)
    init_distributed(ctx.world_size, device, timeout_min=120)
    if device.type == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    dtype = pick_dtype(cfg, str(info.get("dtype", "float32")), device)
    sets, calib = eval_and_calibration_sets(cfg)
    unsampled = [d for d in cfg.sampled_datasets if d not in sets]
    if unsampled and any(t > 0 for t in cfg.temperatures):
        log.warning("evaluate.sampled_datasets: %s not in evaluate.datasets %s; the T > 0 rows cover %s", unsampled,
                    list(sets), [d for d in cfg.sampled_datasets if d in sets] or "no set")
    with machine_timing(ctx):  # engine capture runs GPU kernels too: the lock covers it
        es = load_engines(ctx, cfg, info, plan, device, dtype, mode)
        all_rows, files, responses = run_datasets(ctx, cfg, es, plan, info, sets, calib, device, dtype, mode, mismatch)
    if ctx.is_rank0:
        from draftforge.engine import cpu_linear

        write_json(ctx.out_dir / STAGE_MARKERS["evaluate"], {
            "engine": "draftforge", "target": info.get("name"), "target_fingerprint": info.get("fingerprint"),
            RECORD_KEY: mode.kwargs, "chat_mode_mismatch": mismatch,
            "device": str(device), "world_size": ctx.world_size, "datasets": list(sets), "files": files,
            "note": BEST_NOTE, "rows": all_rows,
            "sampling_checks": sampling_checks(cfg, responses),
            **({"cpu_routes": cpu_linear.tuned_routes()} if device.type == "cpu" else {}),  # engine/cpu_linear.py
        })  # fmt: skip
        clear_finished(ctx)
    if ctx.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_datasets(ctx, cfg: EvaluateConfig, es: EngineSet, plan, info: dict[str, Any], sets, calib, device,
                 dtype, mode: ChatMode, mismatch: str | None) -> tuple[list[dict[str, Any]], dict[str, str], list[dict[str, Any]]]:
    """Time every dataset (a dataset finished by an interrupted run with the same inputs is reused); rank 0
    writes each dataset's file as it finishes, then, with every set done, marks the auto budget over all of them
    (the round cost is pooled over the sets: evaluate/budget.py), rewrites the files and logs every row. Returns
    (all rows, dataset → file, all response records) on rank 0."""
    all_rows: list[dict[str, Any]] = []
    responses: list[dict[str, Any]] = []
    payloads: dict[str, dict[str, Any]] = {}
    upstream = [p for p in (ctx.input_marker("target"), ctx.input_dir("train") / STAGE_MARKERS["train"]) if p.is_file()]
    for dataset, prompts in sets.items():
        key = dataset_key(ctx, upstream, dataset, prompts, calib[dataset])
        done = load_finished(ctx, dataset, key)  # every rank reads the same record: all skip or none do
        if done is not None:
            log.info("%s: reusing the %d rows finished by an interrupted run with the same inputs", dataset, len(done["rows"]))
            if ctx.is_rank0:
                payloads[dataset] = done
                all_rows += done["rows"]
                responses += done.get("responses", [])
            continue
        records: list[dict[str, Any]] = []
        for temp in map(float, cfg.temperatures):
            n_at = prompts_at(cfg, dataset, temp, len(prompts))  # T > 0: the sampled subset (0: not run)
            if not n_at:
                continue
            mine = [(i, p) for i, p in enumerate(prompts[:n_at]) if i % ctx.world_size == ctx.rank]
            pit = cfg.sampling_check.enabled  # the runner takes PIT values at T > 0, first repeat only
            records += run_dataset(es, plan, dataset, mine, temp, cfg.seed, cfg.warmup, show=ctx.is_rank0,
                                   repeats=cfg.repeats, pit=pit)
            records += run_dataset(es, calibration_plan(plan), dataset, [(i, p) for i, p in calib[dataset] if i % ctx.world_size == ctx.rank],
                                   temp, cfg.seed, 0, show=ctx.is_rank0, repeats=cfg.repeats, split="calibration", pit=pit)  # fmt: skip
        records = gather_records(ctx, records)
        if not ctx.is_rank0:
            continue
        categories = category_of(dataset, cfg)  # by pool index (prompts.py), one per set or one per prompt
        for r in records:
            r["category"] = categories if isinstance(categories, str) else categories[r["prompt_index"]]
        rows = rows_of(records, check_bins=cfg.sampling_check.bins, check_alpha=cfg.sampling_check.alpha)
        for row in rows:  # the branch (AR included: its tokens/s is this branch's speedup reference)
            row["drafter"] = ctx.drafter
            if mismatch:
                row["chat_mode_mismatch"] = mismatch
        all_rows += rows
        responses += records
        payload = {"dataset": dataset, "engine": "draftforge", "target": info.get("name"), RECORD_KEY: mode.kwargs,
                   "chat_mode_mismatch": mismatch, "device": str(device),
                   "dtype": str(dtype).replace("torch.", ""), "note": BEST_NOTE, "rows": rows,
                   "responses": sorted(records, key=lambda r: (r["split"], r["repeat"], r["prompt_index"], r["turn"]))}
        write_json(ctx.out_dir / f"{dataset}.json", payload)  # its auto budget comes once every set is done
        payloads[dataset] = payload
        save_finished(ctx, dataset, key, payload)
    if not ctx.is_rank0:
        return all_rows, {}, responses
    mark_auto(all_rows, calibration_records(responses), cfg.calibration_prompts)  # marks the payloads' rows in place
    files = {}
    for dataset, payload in payloads.items():
        write_json(ctx.out_dir / f"{dataset}.json", payload)
        files[dataset] = f"{dataset}.json"
    log_rows(ctx, all_rows)
    for row in all_rows:
        flags = "".join(f" {f}" for f in ("auto_budget", "best_budget") if row.get(f))
        log.info("%s T=%s %-6s budget=%-5s tok/s=%.1f [%.1f..%.1f] tau=%.2f speedup=%.2f mismatches=%s%s", row["dataset"],
                 row["temperature"], row["method"], row["budget"], row["tokens_per_s"] or 0, row["tokens_per_s_min"] or 0,
                 row["tokens_per_s_max"] or 0, row["tau"] or 0, row["speedup_vs_ar"] or 0, row["lossless_mismatches"], flags)
        if row["repeat_mismatches"]:
            log.warning("%s %s@%s: %d responses of later repeats differ from the first repeat's tokens", row["dataset"],
                        row["method"], row["budget"], row["repeat_mismatches"])
    return all_rows, files, responses


def sampling_checks(cfg: EvaluateConfig, responses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The T > 0 lossless check per (temperature, method), all sets pooled (evaluate/sampling_check.py); a
    failed one is logged as an error and marked in the report."""
    checks = pooled_checks(responses, cfg.sampling_check.bins, cfg.sampling_check.alpha)
    for c in checks:
        if c["passed"] is False:
            log.error("sampling check %s: this method's tokens at T > 0 are not the target's distribution", check_line(c))
        else:
            log.info("sampling check %s", check_line(c))
    return checks


@contextlib.contextmanager
def machine_timing(ctx) -> Iterator[None]:
    """The machine-wide timing lock (draftforge/timing_lock.py) around evaluate's timed part: rank 0 holds it,
    the other ranks start at the barrier once it does (they wait there, within the process group's timeout)."""
    from draftforge.timing_lock import hold_timing_lock

    held = (hold_timing_lock(ctx.cfg.timing_lock, experiment=ctx.experiment, stage=ctx.stage, branch=ctx.drafter)
            if ctx.is_rank0 else contextlib.nullcontext())
    with held:
        if ctx.world_size > 1 and dist.is_initialized():
            dist.barrier()
        yield


def log_rows(ctx, rows: list[dict[str, Any]]) -> None:
    """One MLflow run per (dataset, method, budget, temperature)."""
    from draftforge.tracking import mlflow_run

    kw = ctx.tracking_kwargs()
    base_tags = kw.pop("tags")
    for row in rows:
        budget = row["budget"] if row["budget"] is not None else ""
        tags = {**base_tags, "method": row["method"], "dataset": row["dataset"], "budget": budget,
                "engine": "draftforge", "temperature": row["temperature"]}
        if row["method"] in tree_methods():
            tags["best_budget"] = row.get("best_budget", False)  # oracle: chosen on the evaluation data
            tags["auto_budget"] = row.get("auto_budget", False)  # calibrated: chosen before evaluation
        if row.get("mtp_source"):
            tags["mtp_source"] = row["mtp_source"]
        if row.get("chat_mode_mismatch"):
            tags["chat_mode_mismatch"] = row["chat_mode_mismatch"]
        check = row.get("sampling_check") or {}  # T > 0: the lossless check's verdict (None: too few tokens)
        if check.get("passed") is not None:
            tags["sampling_check"] = "passed" if check["passed"] else "failed"
        name = f"{ctx.drafter}/{row['dataset']}/{row['method']}{budget and f'@{budget}'}/T{row['temperature']}"
        with mlflow_run(**kw, run_name=name, tags=tags, params={"evaluate": ctx.params.get("evaluate", {})}) as run:
            metrics = {k: row[k] for k in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "tpot_ms", "ttft_ms",
                                           "tau", "speedup_vs_ar", "speedup_vs_ar_min", "speedup_vs_ar_max", "repeats",
                                           "repeat_mismatches", "lossless_mismatches", "round_ms", "overhead_pct",
                                           "draft_prefill_ms", "calibration_tau", "calibration_round_ms",
                                           "calibration_tokens_per_s", "auto_vs_best")
                       if isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool)}
            metrics.update({f"stage_ms_{s}": v for s, v in row["stage_ms"].items() if v is not None})
            metrics.update({f"sampling_{k}": check[k] for k in ("p_value", "tv", "detectable_tv", "n") if check.get(k) is not None})
            run.log_metrics(metrics)
            for k, count in row["tau_histogram"].items():
                run.log_metrics({"tau_hist": count}, step=int(k))
