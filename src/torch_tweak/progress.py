"""What a tweak is doing: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

log = logging.getLogger("torch_tweak")


class Progress:
    """Reports depth, module and backend. `enabled=False` silences it."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.depth_label = ""
        self.done = 0
        self.total = 0
        self.open_line = False

    def start_depth(self, depth: int, position: int, count: int, modules: int, to_tune: int) -> None:
        self.depth_label = f"depth {depth} ({position}/{count})"
        self.done = 0
        self.total = to_tune
        self.line(f"{self.depth_label}: {modules} modules, {to_tune} to tune")

    def step(self, module: str, what: str) -> None:
        self.show(f"{self.depth_label}: {module or '(root)'}: {what}")

    def finish_module(self) -> None:
        self.done += 1

    def line(self, text: str) -> None:
        """A message that stays."""
        if not self.enabled:
            return
        if self.tty:
            self.clear()
            self.stream.write(text + "\n")
            self.stream.flush()
        else:
            self.stream.write(f"torch-tweak: {text}\n")
            self.stream.flush()
        log.info(text)

    def show(self, text: str) -> None:
        """A status that the next one replaces: a bar on a terminal, a log line otherwise."""
        if not self.enabled:
            return
        if not self.tty:
            self.line(text)
            return
        width = 20
        filled = width * self.done // self.total if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        status = f"[{bar}] {self.done}/{self.total} {text}"
        self.stream.write("\r\x1b[2K" + status[:160])
        self.stream.flush()
        self.open_line = True

    def clear(self) -> None:
        if self.tty and self.open_line:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.open_line = False

    def close(self) -> None:
        self.clear()
