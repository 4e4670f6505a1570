"""Atomic writes and content hashes. Invariant: a final path either does not exist or is complete.

A final file or folder gets the mode a plain `open()` / `mkdir()` would give it (0666 / 0777 less the umask),
not the 0600 / 0700 of its private temp name: results folders are shared.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftforge.errors import StageError


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc), else set and restored."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_mode(path: Path) -> None:
    """Give a temp file / folder the mode a plain open() / mkdir() would have created it with."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~current_umask())


@contextlib.contextmanager
def atomic_path(final: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside `final`; on success rename it over `final`, on error remove it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix + ".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _plain_mode(tmp)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temp directory beside `final`; on success it replaces `final` as a whole."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        for path in (tmp, *tmp.rglob("*")):  # what third-party writers made there too (safetensors' 0600 files)
            if not path.is_symlink():
                _plain_mode(path)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def build_lock(final: str | Path) -> Iterator[None]:
    """An exclusive advisory lock beside `final` (`.<name>.lock`) for the block: of several processes that find a
    shared cached folder missing (two runs on one cache), one builds it while the others wait, then re-check and
    find it built. The kernel drops the lock when its holder exits, however it exits."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_json(path: str | Path, what: str = "file") -> Any:
    """Read JSON or raise one clear StageError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StageError(f"{path}: {what} is not valid JSON ({exc})") from None


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
