"""Runs experiment=gpu's stage commands in DAG order on the device, sized to a wall-clock budget.

    python3 orch.py BUDGET_S        (started detached; state in /tmp/df/state.json, logs in /tmp/df/logs)

Sizing (recorded in state.json): curate.max_rows from the regeneration probe (probe.json) and the time
left, train.max_steps from the time left when train starts (one restart if the measured step rate
overshoots), evaluate with the captured engine (eager fallback on failure), then baselines, report and,
when enough time is left, benchmarks/tau_vs_data.py. Finishes by packing the small outputs.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DF = Path(os.environ.get("ORCH_DF", "/tmp/df"))
EXP = os.environ.get("ORCH_EXP", "gpu")
TEST = os.environ.get("ORCH_TEST") == "1"  # local dry run: tiny sizes
APP, RES, LOGS, PACK = DF / "app", DF / "res", DF / "logs", DF / "pack"
BUDGET = float(sys.argv[1])
T0 = time.time()
DEADLINE = T0 + BUDGET
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{APP}/src:{DF}/site", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONUNBUFFERED": "1", "TQDM_MININTERVAL": "10", "OMP_NUM_THREADS": "16", "OUT": str(DF / "bench_out")}
if TEST:  # no vLLM run locally: a stand-in that fails to import (baselines records a skip)
    (DF / "novllm" / "vllm").mkdir(parents=True, exist_ok=True)
    (DF / "novllm" / "vllm" / "__init__.py").write_text("raise ImportError('vllm hidden for the dry run')\n")
    ENV["PYTHONPATH"] = f"{DF}/novllm:" + ENV["PYTHONPATH"]
    ENV["OMP_NUM_THREADS"] = "2"
COMMON = ([] if (DF / "tracking_ok").is_file() else ["tracking.enabled=false"]) + (["train.features=online", "evaluate.budgets=[8,32]", "curate.regenerate.backend=hf", "curate.regenerate.max_new_tokens=8"] if TEST else [])

# Time estimates (s) for the fixed parts; the two variable parts (regeneration rows, train steps) share the rest.
EVAL_S, BASELINES_S, REPORT_S, PACK_S, MARGIN_S = 240.0, 15.0, 25.0, 15.0, 30.0
CURATE_FIXED_S, TRAIN_FIXED_S = 60.0, 70.0
SEL_PER_ROW_S, WRITE_PER_ROW_S = 0.0040, 0.0010  # host work per selected row (selection, tokenize + write)
STEP_S_GUESS = 0.20
EVAL_EACH_S = 8.0  # one val evaluation (train.eval_every)
CURATE_SHARE = 0.5

state = {"t0": T0, "budget_s": BUDGET, "common": COMMON, "stages": {}, "sizing": {}, "events": [], "done": False}


def now() -> float:
    return time.time() - T0


def left() -> float:
    return DEADLINE - time.time()


def save() -> None:
    tmp = DF / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(DF / "state.json")


def event(msg: str) -> None:
    state["events"].append(f"{now():7.1f}s {msg}")
    print(state["events"][-1], flush=True)
    save()


def start(stage: str, overrides: list[str], module: str | None = None, argv: list[str] | None = None):
    cmd = argv or [PY, "-m", module or f"draftforge.{stage}", f"experiment={EXP}", f"results_root={RES}", *COMMON, *overrides]
    rec = {"cmd": " ".join(cmd), "start_s": round(now(), 1)}
    state["stages"].setdefault(stage, []).append(rec)
    save()
    log = open(LOGS / f"{stage}.log", "a")
    log.write(f"\n===== {time.strftime('%FT%TZ', time.gmtime())} $ {rec['cmd']}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=str(APP), start_new_session=True)
    return proc, rec


def finish(proc, rec) -> int:
    rc = proc.wait()
    rec["end_s"] = round(now(), 1)
    rec["wall_s"] = round(rec["end_s"] - rec["start_s"], 1)
    rec["rc"] = rc
    save()
    return rc


def run(stage: str, overrides: list[str], **kw) -> int:
    proc, rec = start(stage, overrides, **kw)
    rc = finish(proc, rec)
    event(f"{stage} rc={rc} wall={rec['wall_s']}s")
    return rc


def regen_rate(batch: int, prompt_len: float = 250.0, new: int = 512) -> float:
    """Rows/s of HF batched generate at this batch size from the probe: step(B, K) = a(B) + c * B/1024 * K
    (K = KV rows; c from the two B=1024 points), prefill scaled by prompt length; every batch runs `new`
    steps (one row of the batch that never stops keeps it going)."""
    pts = json.loads((DF / "probe.json").read_text())["points"]
    p1024 = sorted([p for p in pts if p["B"] == 1024], key=lambda p: p["L"])
    c = max(0.0, (p1024[-1]["step_s"] - p1024[0]["step_s"]) / max(1.0, p1024[-1]["kv_mid"] - p1024[0]["kv_mid"]))
    near = min(pts, key=lambda p: (abs(p["B"] - batch), -p["L"]))
    k = c * batch / 1024
    a = max(0.0, near["step_s"] * batch / near["B"] - k * near["kv_mid"]) if near["B"] != batch else \
        max(0.0, near["step_s"] - k * near["kv_mid"])
    pre = near["prefill_s"] * (batch / near["B"]) * prompt_len / near["L"]
    total = pre + new * a + k * sum(prompt_len + t for t in range(new))
    return batch / total


def pick_batch() -> tuple[int, float]:
    rates = {b: regen_rate(b) for b in (512, 1024, 2048)}
    state["sizing"]["probe_rows_per_s"] = {str(b): round(r, 1) for b, r in rates.items()}
    best = max(rates, key=rates.get)
    return best, rates[best]


def pack(extra: list[Path] = ()) -> None:
    """Small outputs (no shards, weights, checkpoints, caches) → /tmp/df/pack/results.tgz."""
    PACK.mkdir(exist_ok=True)
    skip_ext = (".parquet", ".safetensors", ".pt", ".bin", ".db", ".gguf")
    tmp = PACK / "results.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for root in [RES / EXP, *extra]:
            if not root.exists():
                continue
            for p in sorted(root.rglob("*")):
                rel = p.relative_to(root.parent)
                if p.is_file() and not p.name.endswith(skip_ext) and ".work" not in rel.parts and "cache" not in rel.parts \
                        and p.stat().st_size < 8 << 20 and "regen-" not in str(rel) and "selection-" not in str(rel):
                    tar.add(p, arcname=str(rel))
        for p in sorted(LOGS.glob("*.log")):
            tar.add(p, arcname=f"logs/{p.name}")
        tar.add(DF / "state.json", arcname="state.json")
        if (DF / "probe.json").is_file():
            tar.add(DF / "probe.json", arcname="probe.json")
        if (RES / "mlflow.db").is_file() and (RES / "mlflow.db").stat().st_size < 12 << 20:
            tar.add(RES / "mlflow.db", arcname="mlflow.db")
    tmp.replace(PACK / "results.tgz")


def tqdm_progress(log: Path, desc: str):
    """Last 'desc: ... N/M [elapsed<remaining' of a tqdm bar in a log: (N, M, elapsed_s) or None."""
    try:
        text = log.read_text(errors="replace")[-20000:]
    except OSError:
        return None
    hits = re.findall(desc + r":\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[(\d+):(\d+)(?::(\d+))?<", text)
    if not hits:
        return None
    n, m, a, b, c = hits[-1]
    el = int(a) * 60 + int(b) if not c else int(a) * 3600 + int(b) * 60 + int(c)
    return int(n), int(m), el


def train_stage() -> int:
    fixed_after = EVAL_S + BASELINES_S + REPORT_S + PACK_S + MARGIN_S
    train_deadline = DEADLINE - fixed_after
    steps = max(300, int((train_deadline - time.time() - TRAIN_FIXED_S) / STEP_S_GUESS)) if not TEST else 12
    state["sizing"]["train_first_max_steps"] = steps
    overrides = [f"train.max_steps={steps}"]
    proc, rec = start("train", overrides)
    restarted = False
    t_launch = time.time()
    base = None  # (n, elapsed) once past the first (compiling) steps
    min_n, min_dn = (150, 120) if not TEST else (4, 2)
    while proc.poll() is None:
        time.sleep(5)
        prog = tqdm_progress(LOGS / "train.log", "train")
        if restarted or prog is None:
            continue
        n, m, el = prog
        if m != steps:
            continue
        if base is None:
            if n >= min(20, min_n):
                base = (n, el)
            continue
        if n >= min_n and n - base[0] >= min_dn and el - base[1] >= (15 if not TEST else 1):
            rate = (el - base[1]) / (n - base[0])
            t_first = time.time() - t_launch - el + base[1] - base[0] * rate  # startup + compile overhead
            evals_left = (m // 500) - (n // 500) + 1
            projected = time.time() + (m - n) * rate + evals_left * EVAL_EACH_S + 20
            state["sizing"]["train_rate_s_per_step"] = round(rate, 4)
            state["sizing"]["train_startup_s"] = round(t_first, 1)
            save()
            if projected > train_deadline + 30:
                new_steps = max(300, int((train_deadline - time.time() - t_first - 20 - (m // 500) * EVAL_EACH_S) / rate))
                event(f"train: {rate*1e3:.0f} ms/step projects {projected - train_deadline:+.0f}s past its deadline; "
                      f"restart with max_steps={new_steps}")
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rec["rc"] = "terminated (resized)"
                rec["end_s"] = round(now(), 1)
                shutil.rmtree(RES / EXP / ".work" / "train", ignore_errors=True)
                state["sizing"]["train_max_steps"] = new_steps
                proc, rec = start("train", [f"train.max_steps={new_steps}"])
                restarted = True
            else:
                event(f"train: {rate*1e3:.0f} ms/step, projected end {projected - train_deadline:+.0f}s vs its deadline")
                state["sizing"]["train_max_steps"] = steps
                restarted = True  # sized right: stop checking
    rc = finish(proc, rec)
    event(f"train rc={rc} wall={rec['wall_s']}s")
    return rc


def main() -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    event(f"start: budget {BUDGET:.0f}s, tracking {'on' if not COMMON else 'off'}")
    if run("target", []) != 0:
        return
    batch, rate = pick_batch()
    target_s = state["stages"]["target"][-1]["wall_s"]
    fixed = CURATE_FIXED_S + TRAIN_FIXED_S + EVAL_S + BASELINES_S + REPORT_S + PACK_S + MARGIN_S
    variable = left() - fixed
    per_row = SEL_PER_ROW_S + WRITE_PER_ROW_S + 1.0 / rate
    rows = int(CURATE_SHARE * variable / per_row / 256) * 256
    rows = max(2048, min(56000, rows)) if not TEST else 64
    chunk = batch * max(1, 4096 // batch)
    if TEST:
        batch, chunk = 16, 32
    state["sizing"].update({"regen_batch": batch, "regen_rows_per_s_est": round(rate, 1), "curate_max_rows": rows,
                            "variable_s": round(variable, 1), "target_s": target_s, "chunk_rows": chunk})
    event(f"curate: batch {batch} (~{rate:.0f} rows/s est.), max_rows {rows}")
    cur = [f"curate.max_rows={rows}", f"curate.regenerate.batch_size={batch}", f"curate.regenerate.chunk_rows={chunk}"]
    if run("curate", cur) != 0:
        event("curate failed; retry once (resumes finished chunks)")
        if run("curate", cur) != 0:
            return
    if train_stage() != 0:
        return
    ev = ["evaluate.engine=captured"]
    tail = BASELINES_S + REPORT_S + PACK_S + 10
    if left() < EVAL_S + tail:  # late: fewer prompts per set rather than no report
        n = max(2, int(8 * (left() - tail) / EVAL_S))
        ev.append(f"evaluate.num_prompts={n}")
        event(f"evaluate: {left():.0f}s left, num_prompts={n}")
    if run("evaluate", ev) != 0:
        n = 8 if left() > 700 else (4 if left() > 350 else 2)
        event(f"captured evaluate failed: eager fallback with num_prompts={n}")
        state["sizing"]["evaluate_fallback"] = f"eager, num_prompts={n}"
        if run("evaluate", ["evaluate.engine=eager", f"evaluate.num_prompts={n}"]) != 0:
            return
    run("baselines", [])
    run("report", [])
    pack()
    event(f"packed main run; {left():.0f}s left")
    # τ vs data when time is left: sizes that fit, the main run reused as the largest point
    ev_s = state["stages"]["evaluate"][-1]["wall_s"]
    rate_step = state["sizing"].get("train_rate_s_per_step", STEP_S_GUESS)
    n_main = json.loads((RES / EXP / "train" / "metrics.json").read_text())["n_train_seqs"]
    steps_main = json.loads((RES / EXP / "train" / "metrics.json").read_text())["steps"]
    n_eval = 4
    sizes = []
    spend = 0.0
    for n in ((1000, 5000) if not TEST else (8,)):
        if n >= n_main:
            break
        steps_n = max(1, round(steps_main * n / n_main))
        cost = TRAIN_FIXED_S + steps_n * rate_step + ev_s * n_eval / 8 + 30
        if spend + cost + PACK_S + 20 < left():
            sizes.append((n, steps_n))
            spend += cost
    state["sizing"]["tau_vs_data_sizes"] = sizes
    if sizes:
        # same recipe as the main run: equal epochs (steps scaled with data), same schedule shape
        epochs = steps_main / max(1, math.ceil(n_main / 16))
        for n, steps_n in sizes:
            argv = [PY, str(APP / "benchmarks" / "tau_vs_data.py"), "--experiment", EXP, "--curate", str(RES / EXP / "curate"),
                    "--target-json", str(RES / EXP / "target" / "target.json"), "--out", str(DF / "tau"), "--sizes", str(n),
                    "--reuse", f"{n_main}={RES}", "--", *COMMON, f"train.max_steps={steps_n}", "evaluate.engine=captured",
                    f"evaluate.num_prompts={n_eval}"]
            state["sizing"]["tau_vs_data_epochs"] = round(epochs, 3)
            run(f"tau_vs_data_n{n}", [], argv=argv)
        # one table over every finished size (finished sizes are not rerun)
        argv = argv[:argv.index("--sizes") + 1] + [",".join(str(n) for n, _ in sizes)] + argv[argv.index("--sizes") + 2:]
        run("tau_vs_data_table", [], argv=argv)
        pack([DF / "tau", DF / "bench_out"])
        event(f"packed with tau_vs_data; {left():.0f}s left")


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001
        import traceback

        event(f"orchestrator error: {type(exc).__name__}: {exc}")
        (LOGS / "orch_traceback.log").write_text(traceback.format_exc())
    finally:
        try:
            pack([DF / "tau", DF / "bench_out"])
        except Exception as exc:  # noqa: BLE001
            event(f"pack error: {exc}")
        state["done"] = True
        save()
