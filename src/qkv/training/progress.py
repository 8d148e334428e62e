"""What a training run shows while it runs: the progress line, and what Ctrl-C and SIGTERM do."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any


def _catch_stops(stop: dict[str, bool]) -> dict[int, Any]:
    """Make the first Ctrl-C (SIGINT) or SIGTERM ask the loop to stop after its step (it then
    writes a checkpoint). A second one raises KeyboardInterrupt at once. Returns the previous
    handlers, to put back."""
    if not _main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True

    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: seconds between plain progress lines where stderr is not a terminal (a log, CI)
PLAIN_EVERY = 30.0


class _Progress:
    """Progress on stderr between evaluations: step, loss, steps and tokens per second and
    the time left — one redrawn bar on a terminal, a plain line every
    :data:`PLAIN_EVERY` seconds otherwise."""

    def __init__(self, steps: int, start: int, tokens_per_step: int, enabled: bool) -> None:
        self.steps, self.start, self.tokens = steps, start, tokens_per_step
        self.enabled, self.t0, self.last = enabled, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, step: int, loss: float) -> None:
        now = self.elapsed()
        every = 0.25 if self.tty else PLAIN_EVERY
        if not self.enabled or (now - self.last < every and step < self.steps):
            return
        self.last = now
        done = step - self.start
        rate = done / now if now > 0 else 0.0
        left = (self.steps - step) / rate if rate > 0 else 0.0
        line = (
            f"step {step}/{self.steps}  loss {loss:.4f}  {rate:.2f} steps/s  "
            f"{rate * self.tokens / 1e3:.1f}k tok/s  {_clock(left)} left"
        )
        if self.tty:
            bar = "#" * int(20 * step / self.steps)
            sys.stderr.write(f"\r[{bar:<20}] {line} ")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(("\r\033[K" if self.tty else "") + text + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"
