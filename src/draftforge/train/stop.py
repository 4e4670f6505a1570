"""Graceful stop: SIGTERM (a scheduler's preemption or time limit) or the first Ctrl-C asks training to finish
the step it is in, write a checkpoint and return, so no finished step is lost; a rerun resumes there.

The training loops ask `requested()` once per optimizer step and all-reduce the answer, so every rank stops
after the same step. A second Ctrl-C interrupts at once (the default handler is back after the first).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class StopRequest:
    """Set by a signal handler (or any thread); read by the training loop once per step."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    def requested(self) -> bool:
        return self._event.is_set()

    @contextmanager
    def on_signals(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator["StopRequest"]:
        """Route `signals` to this request while the block runs (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in signals}

        def handler(signum: int, _frame) -> None:
            name = signal.Signals(signum).name
            log.warning("%s: finishing this step, writing a checkpoint, then stopping (rerun to resume)", name)
            self.set(name)
            if signum == signal.SIGINT:  # a second Ctrl-C stops at once
                signal.signal(signal.SIGINT, previous[signal.SIGINT])

        for sig in signals:
            signal.signal(sig, handler)
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
