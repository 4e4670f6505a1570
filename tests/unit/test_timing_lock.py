"""The machine-wide timing lock with real processes: a second timed stage waits for the first (one line naming
it), a wait past timing_lock.timeout_s ends in a StageError naming the holder, and a killed holder frees it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftforge.errors import ConfigError, StageError
from draftforge.timing_lock import LOCK_NAME, TimingLockConfig, hold_timing_lock

# One timed stage: takes the lock, says when, holds it `hold` seconds, says when it lets go.
_TIMED = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from draftforge.timing_lock import TimingLockConfig, hold_timing_lock
folder, experiment, hold, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
with hold_timing_lock(TimingLockConfig(dir=folder, timeout_s=timeout), experiment=experiment, stage="evaluate", branch="dflash"):
    print(json.dumps({"taken": time.time()}), flush=True)
    time.sleep(hold)
    print(json.dumps({"released": time.time()}), flush=True)
"""


def timed_stage(folder: Path, experiment: str, hold: float, timeout: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _TIMED, str(folder), experiment, str(hold), str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def taken(proc: subprocess.Popen) -> float:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)["taken"]


def test_a_second_timed_stage_waits_for_the_first_and_names_it(tmp_path):
    first = timed_stage(tmp_path, "alpha", hold=4)
    taken(first)
    second = timed_stage(tmp_path, "beta", hold=0)
    out, err = second.communicate(timeout=120)
    first_out, _ = first.communicate(timeout=120)
    assert second.returncode == 0 and first.returncode == 0, err
    released = json.loads(first_out.splitlines()[-1])["released"]
    assert json.loads(out.splitlines()[0])["taken"] >= released  # the timings never overlapped
    waiting = [line for line in err.splitlines() if "timing lock held by" in line]
    assert len(waiting) == 1, err
    assert f"{tmp_path / LOCK_NAME}: timing lock held by pid {first.pid} on " in waiting[0]
    assert "(experiment 'alpha', evaluate/dflash, since " in waiting[0] and "timing_lock.timeout_s" in waiting[0]


def test_the_wait_ends_naming_the_holder_and_a_killed_holder_frees_the_lock(tmp_path):
    holder = timed_stage(tmp_path, "alpha", hold=600)
    try:
        taken(holder)
        start = time.monotonic()
        with pytest.raises(StageError, match=rf"^{tmp_path / LOCK_NAME}: waited 1 s \(timing_lock.timeout_s\) .* still held "
                                             rf"by pid {holder.pid} on .*\(experiment 'alpha', evaluate/dflash, since .*\); "
                                             "let that stage finish, or raise timing_lock.timeout_s$"):  # fmt: skip
            with hold_timing_lock(TimingLockConfig(dir=str(tmp_path), timeout_s=1), experiment="beta", stage="baselines"):
                pytest.fail("took a lock another process holds")
        assert time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait(timeout=60)
    with hold_timing_lock(TimingLockConfig(dir=str(tmp_path), timeout_s=1), experiment="beta", stage="baselines"):
        pass  # the kernel dropped the killed holder's lock: nothing stale is left to wait for


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="timing_lock.timeout_s"):
        TimingLockConfig(timeout_s=0)


def test_the_lock_folder_is_the_config_s_then_the_environment_s_then_tmp(tmp_path, monkeypatch):
    from draftforge.timing_lock import LOCK_DIR_ENV, lock_path

    monkeypatch.delenv(LOCK_DIR_ENV, raising=False)
    assert lock_path(TimingLockConfig()) == Path("/tmp") / LOCK_NAME
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "env"))
    assert lock_path(TimingLockConfig()) == tmp_path / "env" / LOCK_NAME
    assert lock_path(TimingLockConfig(dir=str(tmp_path / "cfg"))) == tmp_path / "cfg" / LOCK_NAME
