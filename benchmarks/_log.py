"""Progress lines: on a machine shared with other jobs, the time of each line is what tells
a stall from work."""

from __future__ import annotations

import sys
import time

T0 = time.monotonic()


def log(message: str) -> None:
    """Seconds since the run started, on stdout (the serving benchmark's lines)."""
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


def log_clock(message: str) -> None:
    """The wall clock, on stderr (the offline benchmark's lines; stdout keeps its table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
