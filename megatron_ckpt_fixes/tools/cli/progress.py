"""What ``verify`` shows while it reads every byte of a checkpoint.

Checking a real checkpoint reads all of it (minutes for a multi-TB one), and minutes of
silence look like a hang. On a terminal (stderr is a TTY) a
tqdm bar shows the GiB read and the rate in GiB/s; elsewhere (a batch job's log, a pipe) a
bar's carriage returns would garble the log, so a plain line is written every
:data:`INTERVAL` seconds and one at the end. Everything goes to stderr: stdout keeps the
report, whose verdict stays its last line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

#: Called with the bytes just read.
Advance = Callable[[int], None]

GIB = 1 << 30
#: Seconds between two plain lines (not on a terminal).
INTERVAL = 30.0
#: tqdm's ``rate_fmt`` turns a rate under 1 into seconds per GiB: GiB/s always instead.
BAR = ("{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} GiB "
       "[{elapsed}<{remaining}, {rate_noinv_fmt}]")


class _Lines:
    """Plain progress lines, at most one per :data:`INTERVAL` seconds, and one at the end."""

    def __init__(self, total: int, what: str, stream: TextIO) -> None:
        self.total, self.what, self.stream = total, what, stream
        self.done = 0
        self.start = self.last = time.monotonic()

    def _rate(self, now: float) -> float:
        return self.done / GIB / max(now - self.start, 1e-9)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= INTERVAL:
            self.last = now
            print(f"{self.what}: {self.done / GIB:.2f} of {self.total / GIB:.2f} GiB read "
                  f"({100 * self.done / self.total:.0f}%), {self._rate(now):.2f} GiB/s",
                  file=self.stream, flush=True)

    def close(self) -> None:
        now = time.monotonic()
        print(f"{self.what}: {self.done / GIB:.2f} GiB read in {now - self.start:.1f} s "
              f"({self._rate(now):.2f} GiB/s)", file=self.stream, flush=True)


@contextmanager
def reading(total: int, what: str, show: bool, stream: TextIO | None = None) -> Iterator[Advance]:
    """A function to call with the bytes read, showing ``total`` bytes' progress on
    ``stream`` (stderr) when ``show``; nothing is shown when there is nothing to read."""
    if not show or total <= 0:
        yield lambda nbytes: None
        return
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        from tqdm import tqdm

        with tqdm(total=total / GIB, desc=what, unit="GiB", bar_format=BAR,
                  file=stream) as bar:
            yield lambda nbytes: bar.update(nbytes / GIB)
        return
    lines = _Lines(total, what, stream)
    yield lines.advance
    lines.close()  # not after an error: that stays the last line
