"""What a tweak is doing, for the person watching it.

On a terminal: one status line that updates in place (step of total, depth, module,
candidate, elapsed time, and the time left estimated from the steps done so far); lines
that stay are printed above it. Elsewhere (a log file, a notebook's captured stderr): plain
lines at the milestones only (a depth starts, a module is tuned, a measurement starts),
each with the elapsed time. The last line says how long the whole tweak took and what it
kept, with the counter at its total.

The time left is estimated per kind of step, never across kinds: tuning a module (its builds
and compiles) costs in proportion to its size, the called modules under it (its weight:
the whole model at depth 0 weighs as much as the modules of depth 1 together), and a
measurement costs what the measurements before it cost. No estimate is shown until a step
of each kind still to come has been timed: the untuned model's measurement, done first, says
nothing of what a compile takes (it said "about 0:03 left" before 46 s of compiling).

This is a display, not a log: it never writes to ``logging`` (the library's records go
there on their own, see docs/tweak.md), and ``progress=False`` turns it off alone. It is
written here rather than with tqdm or rich: the steps are of very different lengths (a
compile, a measurement), the estimate is over steps of several kinds, and a dependency for
sixty lines of display is not worth its weight.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def clock_text(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Steps of a tweak: each module to tune, and each end-to-end measurement."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.clock = clock
        self.start = clock()
        self.total = 0
        self.done = 0
        self.depth_label = ""
        self.open_line = False
        self.phase_open = False
        self.mark = self.start  # when the step now running began
        self.weights: dict[str, float] = {}  # module path -> its weight (plan)
        self.timed = {"module": [0.0, 0.0], "measure": [0.0, 0.0]}  # kind -> [seconds, weight done]
        self.to_do = {"module": 0.0, "measure": 0.0}  # kind -> weight planned

    def plan(self, steps: int, weights: dict[str, float] | None = None) -> None:
        """How many steps the whole tweak has (modules to tune and measurements); weights:
        {module path: its weight} of the modules to tune (each 1 when not given)."""
        self.total = max(steps, self.done)
        self.weights = dict(weights or {})
        modules = len(self.weights)
        self.to_do = {"module": float(sum(self.weights.values())), "measure": float(max(0, steps - modules))}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def _timed(self, kind: str, weight: float) -> None:
        """The step that began at the mark, of `kind` and `weight`, is done now."""
        now = self.clock()
        spent = self.timed[kind]
        spent[0] += max(0.0, now - self.mark)
        spent[1] += weight
        self.mark = now

    def eta(self) -> str:
        if self.done == 0 or self.total <= self.done:
            return ""
        if not self.weights:  # steps of no known kind or weight (a plan without them): all alike
            return f", about {clock_text(self.elapsed() / self.done * (self.total - self.done))} left"
        left = 0.0
        for kind, (seconds, weight) in self.timed.items():
            remaining = max(0.0, self.to_do[kind] - weight)
            if remaining == 0:
                continue
            if weight == 0:  # no step of this kind timed yet: no estimate rather than a wrong one
                return ""
            left += seconds / weight * remaining
        return f", about {clock_text(left)} left" if left > 0 else ""

    def counter(self) -> str:
        return f"[{self.done}/{self.total}] " if self.total else ""

    def start_depth(self, depth: int, position: int, count: int, modules: int, to_tune: int) -> None:
        self.depth_label = f"depth {depth} ({position}/{count})"
        noun = "module" if modules == 1 else "modules"
        self.line(f"{self.depth_label}: {modules} {noun}, {to_tune} to tune")

    def step(self, module: str, what: str) -> None:
        """A status the next one replaces (a terminal only: these come many a second)."""
        if self.tty:
            self.show(f"{self.depth_label}: {module or '(root)'}: {what}")

    def finish_module(self, module: str = "", what: str = "") -> None:
        self.done += 1
        self._timed("module", self.weights.get(module, 1.0))
        if what:
            self.line(f"{self.depth_label}: {module or '(root)'}: {what}")

    def phase(self, what: str) -> None:
        """A measurement starts; the one before it, if any, is a step done."""
        if self.phase_open:
            self.done += 1
            self._timed("measure", 1.0)
        else:
            self.mark = self.clock()  # what ran before it (recording, leaving a cut) is no step's
        self.phase_open = True
        self.line(what)

    def end_phase(self) -> None:
        if self.phase_open:
            self.done += 1
            self._timed("measure", 1.0)
            self.phase_open = False

    def line(self, text: str) -> None:
        """A message that stays, with the step count and the time so far."""
        if not self.enabled:
            return
        stamp = f"{self.counter()}{text} ({clock_text(self.elapsed())}{self.eta()})"
        if self.tty:
            self.clear()
            self.stream.write(stamp + "\n")
        else:
            self.stream.write(f"torch-tweak: {stamp}\n")
        self.stream.flush()

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        status = f"{self.counter()}{text} | {clock_text(self.elapsed())} elapsed{self.eta()}"
        self.stream.write("\r\x1b[2K" + status[:160])
        self.stream.flush()
        self.open_line = True

    def clear(self) -> None:
        if self.tty and self.open_line:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.open_line = False

    def note(self, text: str) -> None:
        """A line of the library's own (a warning of torch_tweak's logger, tweak._voiced), with
        the prefix plain lines have, on a terminal too: it is no step."""
        if not self.enabled:
            return
        self.clear()
        self.stream.write(("" if text.startswith("torch-tweak: ") else "torch-tweak: ") + f"{text}\n")
        self.stream.flush()

    def finish(self, text: str) -> None:
        """The last line: the counter at its total (steps not run, such as depths a budget
        left out, are over too), how long it took and what it kept."""
        self.end_phase()
        self.done = max(self.done, self.total)
        if not self.enabled:
            return
        self.clear()
        self.stream.write(("" if self.tty else "torch-tweak: ") + f"{self.counter()}tuned in {self.elapsed():.1f} s: "
                          f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        self.clear()
