"""A progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`with Progress(total, "collect") as bar: bar.advance(ok=True)`."""

    def __init__(
        self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self._last_decile = -1

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        if not ok:
            self.failed += 1
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        share = self.done / self.total if self.total else 1.0
        filled = int(width * share)
        bar = "#" * filled + "-" * (width - filled)
        text = (
            f"{self.label} [{bar}] {self.done}/{self.total} "
            f"failed {self.failed} {time.monotonic() - self.started:.1f}s"
        )
        if self.tty:
            self.stream.write("\r" + text)
            self.stream.flush()
            return
        decile = int(share * 10)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(text + "\n")
            self.stream.flush()
