"""Stages never reach the network: a stage process (the `target` stage on the tiny random target, MLflow
tracking on) under a socket guard that records every non-loopback name lookup or connection it attempts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Loaded at interpreter start (PYTHONPATH first): refuses and records any lookup / connection that is not local.
GUARD = '''
import json, os, socket

_LOG = os.environ["DRAFTFORGE_NET_LOG"]
_LOCAL = {None, "", "localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _local(host):
    if isinstance(host, bytes):
        host = host.decode()
    return host in _LOCAL or str(host).startswith("127.")


def _refuse(what, target):
    with open(_LOG, "a") as fh:
        fh.write(json.dumps([what, repr(target)]) + "\\n")
    raise OSError(f"network blocked by the test guard: {what} {target!r}")


_getaddrinfo, _connect, _connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex


def getaddrinfo(host, *args, **kwargs):
    if not _local(host):
        _refuse("getaddrinfo", host)
    return _getaddrinfo(host, *args, **kwargs)


def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
        _refuse("connect", address)
    return _connect(self, address)


def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
        _refuse("connect_ex", address)
    return _connect_ex(self, address)


socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex = getaddrinfo, connect, connect_ex
'''

# What would switch telemetry off without the stage doing it (pytest's own variable, CI markers, our settings).
_UNSET = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "VLLM_NO_USAGE_STATS",
          "VLLM_DO_NOT_TRACK", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")


def test_a_stage_process_attempts_no_network_connection(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "net.log"
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    env.update(DRAFTFORGE_NET_LOG=str(log), DRAFTFORGE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(guard), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "draftforge.target", "experiment=smoke", "target=tiny-random", f"results_root={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "mlflow.db").is_file()  # tracking ran (MLflow imported: its telemetry is what reaches out)
    attempts = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    assert not attempts, f"non-local network attempts: {attempts}"
