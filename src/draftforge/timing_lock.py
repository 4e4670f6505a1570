"""The machine-wide timing lock: the timed part of `evaluate` and `baselines` holds it, so no two timings share a
machine, whichever experiment, results root or Snakemake invocation started them (docs/architecture.md,
"Faults and bad input"). Snakemake's `timing=1` resource serialises timing jobs of one invocation only.

An advisory `fcntl.flock` on one file: the kernel drops it when its holder exits, however it exits, so a killed
stage never leaves the lock taken. While it holds the lock, the holder keeps a JSON line in the file naming
itself (pid, host, experiment, stage, branch, since); a stage that finds the lock taken logs one line naming
that holder, waits, and after `timing_lock.timeout_s` ends in a StageError naming it. Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftforge.errors import StageError, check
from draftforge.owner import this_process

log = logging.getLogger(__name__)
LOCK_NAME = "draftforge-timing.lock"


@dataclass
class TimingLockConfig:
    # Folder of the lock file; "" → /tmp. Not $TMPDIR (tempfile's choice): Slurm and login setups often point it
    # at a per-job or per-user folder, which would give each stage a lock of its own. Not beside results_root:
    # two experiments timing on one machine may write to different results roots. A container with a private
    # /tmp needs a folder shared with the host here (a bind mount) for the lock to span containers.
    dir: str = ""
    # Longest wait for another stage's timing (seconds); then the stage ends naming the holder. A command-line
    # override of timing_lock changes the timing stages' command, which Snakemake reruns: set it in the
    # experiment file instead.
    timeout_s: float = 86400.0

    def __post_init__(self) -> None:
        check(self.timeout_s > 0, "timing_lock.timeout_s", f"{self.timeout_s} must be > 0 (seconds to wait for the lock)")


# The folder when timing_lock.dir is empty, before /tmp. Read when the lock is taken, so it changes no stage's
# command: the test suite gives each pytest-xdist worker its own (tests/conftest.py; test timings are not compared,
# and a machine-wide lock would idle one worker while another's pipeline times).
LOCK_DIR_ENV = "DRAFTFORGE_TIMING_LOCK_DIR"


def lock_path(cfg: Any) -> Path:
    folder = str(cfg.dir) or os.environ.get(LOCK_DIR_ENV) or ("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir())
    return Path(folder) / LOCK_NAME


def _open_shared(path: Path) -> int:
    """The lock file opened read-write, created 0666 so every user timing on this machine can take it.

    Opened without O_CREAT first: in a sticky world-writable folder (/tmp) Linux refuses O_CREAT on a file
    another user owns (fs.protected_regular), even one it may write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # another stage created it just now
            return os.open(path, os.O_RDWR)
        os.fchmod(fd, 0o666)  # not narrowed by the umask
        return fd
    except OSError as exc:
        raise StageError(f"{path}: cannot open the machine-wide timing lock ({exc.strerror or exc}); make it writable "
                         "for every user who times on this machine, or set timing_lock.dir to a folder they share") from None


def _read_holder(fd: int, tries: int = 20) -> str:
    """The holder's record as words; the holder writes it just after taking the lock, so an empty file is
    re-read for a moment before the holder counts as unknown."""
    for _ in range(tries):
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        try:
            rec = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            rec = None  # written half-way: read again
        if isinstance(rec, dict):
            return (f"pid {rec.get('pid')} on {rec.get('host')} (experiment {rec.get('experiment')!r}, "
                    f"{rec.get('stage')}{'/' + rec['branch'] if rec.get('branch') else ''}, since {rec.get('since')})")
        time.sleep(0.05)
    return "a process that has not named itself"


def _write_holder(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


@contextlib.contextmanager
def hold_timing_lock(cfg: Any, *, experiment: str, stage: str, branch: str | None = None,
                     poll_s: float = 0.5) -> Iterator[None]:
    """Hold the machine-wide timing lock for the block; wait (one log line naming the holder) while another
    stage holds it, up to cfg.timeout_s."""
    path = lock_path(cfg)
    timeout = float(cfg.timeout_s)
    fd = _open_shared(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            log.warning("%s: timing lock held by %s; waiting up to %g s (timing_lock.timeout_s) so the two timings "
                        "do not overlap", path, holder, timeout)
            start = time.monotonic()
            while True:
                time.sleep(min(poll_s, max(0.01, timeout - (time.monotonic() - start))))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - start >= timeout:
                        raise StageError(
                            f"{path}: waited {timeout:g} s (timing_lock.timeout_s) for the machine-wide timing lock, "
                            f"still held by {_read_holder(fd)}; let that stage finish, or raise timing_lock.timeout_s"
                        ) from None
            log.info("%s: timing lock taken after %.0f s", path, time.monotonic() - start)
        me = this_process()
        _write_holder(fd, {"pid": me.pid, "host": me.host, "experiment": experiment, "stage": stage,
                           "branch": branch or "", "since": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: the next holder writes its own record
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
