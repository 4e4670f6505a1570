"""baselines harness: worker subprocess failure paths with fake `vllm` packages (no engine needed).

A missing/broken vLLM is a recorded skip; a crash or hang becomes a recorded failure carrying the
tail of the worker's stderr; never numbers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baselines_fixtures import fake_vllm  # noqa: E402
from draftforge.baselines.harness import run_worker, worker_env  # noqa: E402

SPEC = {"method": "ar", "model": "/nonexistent", "llm_kwargs": {}, "speculative_config": None, "max_new_tokens": 4,
        "ignore_eos": False, "seed": 0, "warmup": 0, "warmup_tokens": 4,
        "segments": [{"dataset": "d", "temperature": 0.0, "prompts": [{"id": "d/0", "token_ids": [1, 2, 3]}]}]}  # fmt: skip


def _env(fake_root: Path) -> dict[str, str]:
    env = worker_env("cpu", True)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_root), env.get("PYTHONPATH", "")])
    return env


def test_worker_env_cpu():
    env = worker_env("cpu", True)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_unimportable_vllm_is_a_recorded_skip(tmp_path):
    root = fake_vllm(tmp_path / "fake", "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    res = run_worker(SPEC, tmp_path / "run", tmp_path / "logs" / "ar.log", 60, _env(root))
    assert res["status"] == "skipped"
    assert "vLLM not importable" in res["reason"] and "libcuda" in res["reason"]
    assert "segments" not in res


def test_crash_is_a_failure_with_stderr_tail(tmp_path):
    body = "import sys, os\nprint('engine core died: SIGSEGV in attention kernel', file=sys.stderr, flush=True)\nos._exit(139)\n"
    root = fake_vllm(tmp_path / "fake", body)
    res = run_worker(SPEC, tmp_path / "run", tmp_path / "logs" / "ar.log", 60, _env(root))
    assert res["status"] == "failed" and res["returncode"] == 139
    assert "without a result" in res["reason"]
    assert "SIGSEGV in attention kernel" in res["stderr_tail"]
    assert "SIGSEGV" in (tmp_path / "logs" / "ar.log").read_text()  # full stderr kept in the log


def test_exception_in_engine_is_a_failure_with_traceback(tmp_path):
    body = """
    class LLM:
        def __init__(self, **kw):
            raise ValueError("head size 24 is not supported")
    """
    root = fake_vllm(tmp_path / "fake", body)
    res = run_worker(SPEC, tmp_path / "run", tmp_path / "logs" / "ar.log", 60, _env(root))
    assert res["status"] == "failed" and "head size 24" in res["reason"]
    assert "ValueError" in res["traceback"] and "head size 24" in res["stderr_tail"]


def test_hang_is_killed_and_recorded(tmp_path):
    root = fake_vllm(tmp_path / "fake", "import time\ntime.sleep(600)\n")
    res = run_worker(SPEC, tmp_path / "run", tmp_path / "logs" / "ar.log", 3, _env(root))
    assert res["status"] == "failed" and res["reason"].startswith("timed out after 3s")
    assert res["process_s"] < 30


def test_fake_engine_results_round_trip(tmp_path):
    """The worker's own measuring loop (warm-up, snapshots, per-prompt records) against a scripted engine."""
    body = """
    from dataclasses import dataclass
    __version__ = "fake"

    @dataclass
    class Counter:
        name: str
        labels: dict
        value: int

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class _Stats:
        first_token_latency = 0.01
        first_token_ts = 10.0
        last_token_ts = 10.5

    class _Completion:
        def __init__(self, ids):
            self.token_ids = ids
            self.finish_reason = "length"

    class _Out:
        def __init__(self, ids):
            self.outputs = [_Completion(ids)]
            self.metrics = _Stats()

    class LLM:
        def __init__(self, **kw):
            self.generated = 0
        def generate(self, prompts, params, use_tqdm=False):
            n = params.kw["max_tokens"]
            self.generated += n * len(prompts)
            return [_Out(list(range(100, 100 + n))) for _ in prompts]
        def get_metrics(self):
            return [Counter("vllm:generation_tokens", {"engine": "0"}, self.generated)]
    """
    root = fake_vllm(tmp_path / "fake", body)
    spec = {**SPEC, "warmup": 2, "warmup_tokens": 3, "concurrency": [3]}
    res = run_worker(spec, tmp_path / "run", tmp_path / "logs" / "ar.log", 60, _env(root))
    assert res["status"] == "ok", res
    seg = res["segments"][0]
    assert seg["metrics_before"]["counters"]["vllm:generation_tokens"] == 6  # two warm-ups of 3 tokens
    assert seg["metrics_after"]["counters"]["vllm:generation_tokens"] == 10
    p = seg["prompts"][0]
    assert p["id"] == "d/0" and p["token_ids"] == [100, 101, 102, 103] and p["decode_s"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "run" / "ar.result.json").read_text())["status"] == "ok"
    (sweep,) = res["concurrency"]  # 3 requests at once, round-robin over the one prompt
    assert sweep["concurrency"] == 3 and sweep["n_requests"] == 3 and sweep["output_tokens"] == 12
    assert sweep["metrics_after"]["counters"]["vllm:generation_tokens"] - sweep["metrics_before"]["counters"]["vllm:generation_tokens"] == 12
