"""Which process owns something (an MLflow run, the timing lock), and whether that process is still alive.

An owner is recorded as (host, machine, pid, started). `machine` is the kernel's boot id plus the pid
namespace, so two records compare pids only when they were taken on the same machine, in the same boot, seen
through the same pid namespace (a container sharing the host name still has its own pids). `started` is the
process's start time in clock ticks after boot (/proc/<pid>/stat field 22): a pid reused by a later process
has another start time, so a reused pid never passes for the recorded owner. Without /proc (not Linux)
`machine` is the host name and `started` is empty: liveness is then the pid alone (os.kill(pid, 0)).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Owner:
    host: str
    machine: str
    pid: int
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def machine_id() -> str:
    """boot id + pid namespace of this process (the host name where /proc is missing)."""
    try:
        boot = (PROC / "sys/kernel/random/boot_id").read_text().strip()
        pidns = os.readlink(PROC / "self/ns/pid")
    except OSError:
        return socket.gethostname()
    return f"{boot}/{pidns}"


def start_ticks(pid: int) -> str | None:
    """The process's start time ("" without /proc); None when no such process runs (a zombie counts as gone:
    it has exited and only waits for its parent to read its status)."""
    if not PROC.joinpath("self/stat").exists():
        return ""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and parentheses
    if fields[0] in ("Z", "X"):  # state: zombie / dead
        return None
    return fields[19]  # field 22 of the whole line: starttime


def this_process() -> Owner:
    pid = os.getpid()
    return Owner(host=socket.gethostname(), machine=machine_id(), pid=pid, started=start_ticks(pid) or "")


def is_alive(owner: Owner) -> bool | None:
    """True/False for an owner recorded on this machine; None for another machine's (its pids are not ours to
    look up, so nothing can be said about it)."""
    if owner.machine != machine_id():
        return None
    started = start_ticks(owner.pid)
    if started is None:
        return False
    if started:  # /proc: the same pid started at the same tick is the same process
        return not owner.started or started == owner.started
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def as_fields(owner: Owner, prefix: str = "owner_") -> dict[str, str]:
    return {f"{prefix}host": owner.host, f"{prefix}machine": owner.machine, f"{prefix}pid": str(owner.pid),
            f"{prefix}started": owner.started}


def from_fields(fields: dict[str, object], prefix: str = "owner_") -> Owner | None:
    """The owner recorded by `as_fields` (None when the record has none, or a damaged one)."""
    try:
        return Owner(host=str(fields[f"{prefix}host"]), machine=str(fields[f"{prefix}machine"]),
                     pid=int(str(fields[f"{prefix}pid"])), started=str(fields.get(f"{prefix}started") or ""))
    except (KeyError, ValueError):
        return None
