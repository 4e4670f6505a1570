"""One vLLM engine, one method, in its own process: JSON spec in, JSON result out.

    python -m draftforge.baselines.worker SPEC.json RESULT.json

Spec keys: method, model, llm_kwargs (passed to vllm.LLM), speculative_config (null for AR),
segments [{dataset, temperature, prompts: [{id, token_ids}]}], max_new_tokens, ignore_eos, seed,
warmup, warmup_tokens (warm-up generations at each segment temperature); optional concurrency (list of c: c simultaneous requests after the batch-size-1
segments; needs llm_kwargs.max_num_seqs >= c) with concurrency_pool (its prompts; default: segments').
The result always gets written when the process survives:
    status "ok"      → per segment: metrics snapshots before/after + per-prompt tokens and timings
    status "skipped" → vLLM is not importable (reason says why); no numbers
    status "failed"  → exception text and traceback; no numbers
A crash that kills the interpreter leaves no result: the parent records it with the stderr tail.
Engine invariants: prefix caching off; batch-size-1 segments send one prompt per generate call
(max_num_seqs=1 except in a concurrency-sweep engine).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from draftforge.baselines.metrics import snapshot


def _write(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def _sampling(vllm: Any, spec: dict[str, Any], temperature: float, max_tokens: int, index: int = 0) -> Any:
    """Greedy at T=0; at T>0 one seeded draw per prompt (seed + prompt index, as evaluate does)."""
    kwargs: dict[str, Any] = dict(temperature=float(temperature), max_tokens=int(max_tokens), ignore_eos=bool(spec["ignore_eos"]))
    if temperature > 0:
        kwargs["seed"] = int(spec["seed"]) + index
    return vllm.SamplingParams(**kwargs)


def _run_prompt(llm: Any, token_ids: list[int], params: Any) -> dict[str, Any]:
    """Generate for one prompt; wall time by us, TTFT/decode from the engine's own timestamps."""
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out = outputs[0]
    completion = out.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    record: dict[str, Any] = {
        "n_prompt": len(token_ids),
        "n_output": len(ids),
        "token_ids": ids,
        "finish_reason": completion.finish_reason,
        "wall_s": wall,
        "ttft_s": None,
        "decode_s": None,
    }
    stats = getattr(out, "metrics", None)
    # RequestStateStats: first/last token timestamps are engine-core monotonic times (same clock
    # for every process of one host); first_token_latency is measured from arrival.
    if stats is not None and getattr(stats, "first_token_ts", 0) and getattr(stats, "last_token_ts", 0):
        record["ttft_s"] = float(stats.first_token_latency) if stats.first_token_latency else None
        record["decode_s"] = max(0.0, float(stats.last_token_ts) - float(stats.first_token_ts))
    return record


def _prompt_pool(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("concurrency_pool") or [p for seg in spec["segments"] for p in seg["prompts"]])


def _run_concurrent(vllm: Any, llm: Any, spec: dict[str, Any], c: int) -> dict[str, Any]:
    """c requests submitted at once (greedy; prompts taken round-robin over every segment's prompts):
    aggregate output tokens/s over the wall time, counters delta around the batch."""
    pool = _prompt_pool(spec)
    batch = [{"prompt_token_ids": list(pool[i % len(pool)]["token_ids"])} for i in range(c)]
    params = _sampling(vllm, spec, 0.0, int(spec["max_new_tokens"]))
    before = snapshot(llm.get_metrics())
    t0 = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = snapshot(llm.get_metrics())
    n_out = [len(o.outputs[0].token_ids) for o in outputs]
    return {"concurrency": c, "n_requests": len(batch), "output_tokens": sum(n_out), "wall_s": wall,
            "metrics_before": before, "metrics_after": after}  # fmt: skip


def run(spec: dict[str, Any], result_path: Path) -> dict[str, Any]:
    """Measure; the result file is written before engine teardown (a hang there loses nothing)."""
    result: dict[str, Any] = {"method": spec["method"], "status": "failed", "pid": os.getpid()}
    t0 = time.perf_counter()
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        result.update(status="skipped", reason=f"vLLM not importable: {type(exc).__name__}: {exc}")
        _write(result_path, result)
        return result
    result["vllm_version"] = getattr(vllm, "__version__", "unknown")
    result["import_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], tokenizer=spec.get("tokenizer") or spec["model"],
                   speculative_config=spec.get("speculative_config"), **spec["llm_kwargs"])  # fmt: skip
    result["engine_start_s"] = time.perf_counter() - t1
    first = next(iter(_prompt_pool(spec)), None)
    t2 = time.perf_counter()
    # at every temperature the segments use: the first sampled request pays a one-time cost of its own
    # (measured: vLLM-CPU AR at T = 1 ran 0.8 tok/s after a greedy warm-up only, against 14 at T = 0)
    warm_at = sorted({float(seg["temperature"]) for seg in spec["segments"]}) if first else []
    for temperature in warm_at:
        for _ in range(int(spec.get("warmup", 1))):
            _run_prompt(llm, first["token_ids"], _sampling(vllm, spec, temperature, int(spec.get("warmup_tokens", 16))))
    result["warmup_temperatures"] = warm_at
    result["warmup_s"] = time.perf_counter() - t2
    segments = []
    for seg in spec["segments"]:
        before = snapshot(llm.get_metrics())
        prompts = []
        for i, prompt in enumerate(seg["prompts"]):
            params = _sampling(vllm, spec, float(seg["temperature"]), int(spec["max_new_tokens"]), i)
            record = _run_prompt(llm, prompt["token_ids"], params)
            record["id"] = prompt["id"]
            prompts.append(record)
        after = snapshot(llm.get_metrics())
        segments.append({"dataset": seg["dataset"], "temperature": seg["temperature"], "metrics_before": before, "metrics_after": after, "prompts": prompts})  # fmt: skip
    result["segments"] = segments
    result["concurrency"] = [_run_concurrent(vllm, llm, spec, int(c)) for c in spec.get("concurrency") or []]
    result["status"] = "ok"
    _write(result_path, result)
    del llm  # engine teardown happens here and at exit; the numbers are already on disk
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m draftforge.baselines.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    try:
        result = run(spec, result_path)
    except Exception as exc:
        traceback.print_exc()
        result = {"method": spec.get("method"), "status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        _write(result_path, result)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if result["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":  # vLLM may spawn processes that re-import the main module
    # The result is on disk: skip the engine's slow teardown (the parent reaps the process group).
    os._exit(main(sys.argv[1:]))
