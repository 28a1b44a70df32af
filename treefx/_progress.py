"""A minimal progress bar on stderr (no dependency), drawn only on a terminal or when forced."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "planning") as p: p.update(k)``; silent unless enabled.

    ``unit``: when given, the bar also shows ``done/total`` with it (``" trees"``). ``delay``:
    nothing is drawn before this many seconds have passed (a run that ends sooner stays
    quiet). ``lines_every``: when the bar is off, a plain line (``desc: done/total, 12%,
    30 s``) every this many seconds, the first after as long: progress of a long run into a
    log file."""

    def __init__(self, total: float, desc: str = "", *, enabled: bool | None = None, unit="",
                 delay: float = 0.0, lines_every: float | None = None):
        self.total = max(float(total), 1.0)
        self.desc = desc
        self.unit = unit
        self.done = 0.0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.delay = delay
        self.lines_every = lines_every
        self._drawn = False
        self._last = 0.0
        self._start = time.perf_counter()
        self._last_line = self._start

    def _count(self) -> str:
        return f" {self.done:.0f}/{self.total:.0f}{self.unit}" if self.unit else ""

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.enabled:
            if self.lines_every is not None and now - self._last_line >= self.lines_every:
                self._last_line = now
                frac = min(self.done / self.total, 1.0)
                sys.stderr.write(f"{self.desc}:{self._count()}, {100 * frac:.1f}%, "
                                 f"{now - self._start:.0f} s\n")
                sys.stderr.flush()
            return
        if now - self._start < self.delay:
            return
        if now - self._last > 0.1 or self.done >= self.total:
            self._last = now
            self._drawn = True
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.desc} [{bar:<30}] {100 * frac:5.1f}%{self._count()} "
                f"{now - self._start:6.1f}s"
            )
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and (self._drawn or not self.delay):
            sys.stderr.write("\n")
            sys.stderr.flush()
