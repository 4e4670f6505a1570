"""Atomic writes (draftforge/io.py): a final file or folder has the mode a plain open() / mkdir() gives it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from draftforge import io


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_outputs_get_the_mode_of_a_plain_open(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        assert getattr(io, "current_umask", lambda: umask)() == umask  # read without changing it
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        (tmp_path / "plain_dir").mkdir()
        io.write_json(tmp_path / "a.json", {"a": 1})
        io.write_text(tmp_path / "sub" / "b.txt", "b")
        with io.atomic_path(tmp_path / "c.bin") as tmp:
            tmp.write_bytes(b"c")
        with io.atomic_dir(tmp_path / "export") as tmp:
            (tmp / "config.json").write_text("{}")
        with io.atomic_dir(tmp_path / "export") as tmp:  # replacing an existing folder
            (tmp / "config.json").write_text("{}")
            fd = os.open(tmp / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)  # as mkstemp-based writers do
            os.close(fd)
            (tmp / "nested").mkdir(mode=0o700)
    finally:
        os.umask(old)
    assert _mode(plain) == 0o666 & ~umask
    for name in ("a.json", "sub/b.txt", "c.bin", "export/config.json", "export/model.safetensors"):
        assert _mode(tmp_path / name) == _mode(plain), name
    assert _mode(tmp_path / "export") == _mode(tmp_path / "export" / "nested") == _mode(tmp_path / "plain_dir") == 0o777 & ~umask
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left behind


def _build_once(final: str, log: str) -> None:
    """What a cache builder does: check, lock, check again, build (slowly) atomically."""
    import time

    target = Path(final)
    if (target / "done").is_file():
        return
    with io.build_lock(target):
        if (target / "done").is_file():
            return
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        with io.atomic_dir(target) as tmp:
            time.sleep(0.5)
            (tmp / "done").write_text("ok")


def test_build_lock_lets_one_of_concurrent_processes_build_a_cached_folder(tmp_path: Path) -> None:
    import multiprocessing as mp

    final, log = tmp_path / "cache" / "targets" / "x", tmp_path / "builds.log"
    procs = [mp.get_context("fork").Process(target=_build_once, args=(str(final), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1 and (final / "done").read_text() == "ok"
