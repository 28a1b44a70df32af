"""A minimal progress bar on stderr (no dependency), drawn only on a terminal or when forced."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "planning") as p: p.update(k)``; silent unless enabled."""

    def __init__(self, total: float, desc: str = "", *, enabled: bool | None = None, unit=""):
        self.total = max(float(total), 1.0)
        self.desc = desc
        self.unit = unit
        self.done = 0.0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._start = time.perf_counter()

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.desc} [{bar:<30}] {100 * frac:5.1f}% {now - self._start:6.1f}s"
            )
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
