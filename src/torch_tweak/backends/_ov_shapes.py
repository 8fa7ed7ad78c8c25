"""OpenVINO models compiled for exactly one call shape, beside the dynamic model a module was
converted to (OpenVINOBackendConfig.static_shapes).

On the CPU a model of static shapes runs 5 to 20 % faster than the dynamic model at the same
shape (a 4-layer BERT, docs/serving.md), and compiles in about a tenth of a second for a
small encoder. A compile costs that tenth of a second of a core, and the check of its model
one more forward of the module, so a shape gets its own model only where its calls pay it back:

- the shapes of the recorded calls are compiled when the module is built (tuning's time):
  the traffic the user showed is served by them from its first call after tuning;
- a shape the recording did not have runs the dynamic model, and is handed to a compiling
  thread once its calls on the dynamic model have taken OV_PATIENCE compiles' time (a compile's
  time: the compiles' mean so far; the dynamic model's own compile until there is one), and not
  before its second call: a shape seen a few times in a burst costs no compile, a shape that
  keeps coming gets its model once it has run long enough to pay it back. No call waits for
  a compile (OpenVINO releases the interpreter while it compiles);
- the first call after a compile runs the module and the new model both; the new model
  answers it and serves the shape's later calls only if its answer matched the module's
  (tweak's rule: checked against the original before it serves, as the padded backend's new
  buckets are), and the dynamic model answers otherwise (whether the dynamic model holds at
  that shape is traced.Served's to prove, or the build's check's: a shape's own model that
  fails its check never vouches for it);
- a shape whose compile or check failed stays on the dynamic model and is not tried again.

At most `limit` shapes, counted with those being compiled. Each thread has its own infer
request per shape. One compiling thread per model, started on the first shape it is handed
and ended after OV_IDLE_SECONDS with nothing to compile; while it compiles it takes a core from the
calls being served. It holds the model only while it compiles: a tuned model its user drops
is freed with its compiled models. At exit the compile in
progress is waited for (none is cut off) and the shapes still waiting are dropped; a fork waits
for the compile in progress (the isolated builds of tuning fork) and the child starts without
its parent's thread.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from .._core import settings
from .._core.correctness import MismatchError, check
from .base import OutputForm


class _SignalStack(ctypes.Structure):
    """stack_t of sigaltstack(2)."""

    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


_LIBC: list[Any] = []


@contextlib.contextmanager
def kept_signal_stack() -> Iterator[None]:
    """The calling thread's alternate signal stack as it was, put back when the block ends
    (Linux; elsewhere nothing). OpenVINO's compiled model gives the thread that compiles it an
    alternate signal stack of its own, and gives back the one it found when it is freed, on
    whichever thread frees it: models freed in another order than they were compiled left the
    thread on a stack already freed, and the next signal Python handles there (Ctrl-C, with
    SA_ONSTACK) killed the process with SIGSEGV. Put back at once, every model finds and
    gives back the same stack."""
    if not sys.platform.startswith("linux"):
        yield
        return
    if not _LIBC:
        _LIBC.append(getattr(ctypes.CDLL(None, use_errno=True), "sigaltstack", None))
    call = _LIBC[0]
    saved = _SignalStack()
    if call is None or call(None, ctypes.byref(saved)) != 0:
        yield
        return
    try:
        yield
    finally:
        call(ctypes.byref(saved), None)  # fails only while on that stack (a handler running): left as is

logger = logging.getLogger("torch_tweak")

_COMPILING = threading.Lock()
"""Held by a compiling thread around each compile: a fork waits for it (register_at_fork)."""
_LIVE: "weakref.WeakSet[StaticShapes]" = weakref.WeakSet()
_clock = time.perf_counter
Dynamic = Callable[[list], tuple]
"""The dynamic model's answer to a call's inputs."""


class StaticShapes:
    """The models per call shape of one converted model (see the module docs)."""

    def __init__(self, ov: Any, model: Any, device: str, properties: dict, limit: int, module: torch.nn.Module,
                 form: OutputForm, tolerance: float | None, compile_s: float, own: Any = None) -> None:
        self.ov, self.model, self.device, self.properties = ov, model, device, properties
        self.limit, self.module, self.form, self.tolerance = limit, module, form, tolerance
        self.own = own  # the original's own errors (Backend.own_errors): the measured rule per shape
        self.ready: dict[tuple, Any] = {}     # checked: serves its shape
        self.compiled: dict[tuple, Any] = {}  # compiled, not yet checked
        self.pending: set[tuple] = set()      # handed to the compiling thread
        self.seen: dict[tuple, list] = {}     # per shape not handed over: [calls, seconds on the dynamic model]
        self.refused: dict[tuple, str] = {}
        self.served = 0
        self.compiles = (0, 0.0)              # compiles timed, their seconds
        self.guess_s = compile_s              # a compile's seconds until one is timed (the dynamic model's)
        self.patience = settings.OV_PATIENCE  # compiles' worth of a shape's time on the dynamic model before its own
        self.local = threading.local()
        self.jobs: queue.Queue | None = None
        self.worker: threading.Thread | None = None
        self.start = threading.Lock()
        self.stopping = False
        _LIVE.add(self)

    @property
    def compile_s(self) -> float:
        """A compile's seconds: the mean of those timed, else the guess."""
        count, total = self.compiles
        return total / count if count else self.guess_s

    def full(self) -> bool:
        return len(self.ready) + len(self.compiled) + len(self.pending) >= self.limit

    def prepare(self, shapes: Iterable[tuple]) -> None:
        """The recorded calls' shapes compiled now (at most `limit`), each checked at its first
        call; a compile that fails leaves its shape on the dynamic model."""
        for key in dict.fromkeys(shapes):
            if self.full():
                break
            self._compile(key)

    def infer(self, feed: list, args: tuple, kwargs: dict, dynamic: Dynamic) -> tuple:
        """The call's outputs: from its shape's own model where it has one, else `dynamic`'s."""
        key = tuple(a.shape for a in feed)
        compiled = self.ready.get(key)
        if compiled is not None:
            requests = self.local.__dict__.setdefault("requests", {})
            request = requests.get(key)
            if request is None:
                request = requests[key] = compiled.create_infer_request()
            self.served += 1
            return request.infer(feed).to_tuple()
        unchecked = self.compiled.pop(key, None)  # one thread takes it
        if unchecked is not None:
            return self._check(key, unchecked, feed, args, kwargs, dynamic)
        if key in self.refused or key in self.pending or self.full():  # nothing to count it for
            return dynamic(feed)
        start = _clock()
        results = dynamic(feed)
        took = _clock() - start
        if len(self.seen) >= settings.OV_SEEN_MAX:  # a stream of shapes that never repeat: counted afresh
            self.seen.clear()
        calls, spent = self.seen.get(key, (0, 0.0))
        self.seen[key] = [calls + 1, spent + took]
        if calls >= 1 and spent + took >= self.patience * self.compile_s:
            self._hand(key)
        return results

    def _check(self, key: tuple, compiled: Any, feed: list, args: tuple, kwargs: dict, dynamic: Dynamic) -> tuple:
        """The model's answer to the call where it matched the module's (the model then serves
        the shape), else the dynamic model's, as for any shape without its own model: never the
        module's in its place, so that a check of the dynamic model at this shape (the build's,
        or traced.Served's at a shape's first sight) sees what the dynamic model answers there."""
        with torch.no_grad():
            reference = self.module(*args, **kwargs)
        try:
            results = compiled.create_infer_request().infer(feed).to_tuple()
            check(self.form.fill(torch.from_numpy(r) for r in results), reference, self.tolerance,
                  where=f"OpenVINO's model for calls of shape {list(map(list, key))}", own=self.own)
        except (MismatchError, RuntimeError, ValueError, TypeError) as exc:
            self._refuse(key, exc)
            return dynamic(feed)
        self.ready[key] = compiled
        self.served += 1
        return results

    def _refuse(self, key: tuple, exc: BaseException) -> None:
        self.refused[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        logger.info("torch-tweak: no OpenVINO model of static shapes for calls of shape %s (%s); the dynamic "
                    "model serves them", [list(s) for s in key], self.refused[key])

    def _hand(self, key: tuple) -> None:
        with self.start:
            if key in self.pending or key in self.compiled or key in self.ready:
                return
            if self.worker is None or not self.worker.is_alive():
                self.jobs = queue.Queue()
                self.worker = threading.Thread(target=_work, args=(weakref.ref(self), self.jobs), daemon=True,
                                               name="torch-tweak OpenVINO shapes")
                self.worker.start()
            self.pending.add(key)
            assert self.jobs is not None
            self.jobs.put(key)

    def _compile(self, key: tuple) -> None:
        """The model for `key`'s shapes into `compiled` (to be checked), its compile timed; a
        failure refuses the shape."""
        try:
            start = _clock()
            model = self.model.clone()
            model.reshape({model.inputs[i]: self.ov.PartialShape(list(shape)) for i, shape in enumerate(key)})
            with kept_signal_stack():
                self.compiled[key] = self.ov.Core().compile_model(model, self.device, self.properties)
            count, total = self.compiles
            self.compiles = (count + 1, total + _clock() - start)
        except Exception as exc:  # noqa: BLE001 - a compiling thread must not die of it: the shape stays dynamic
            self._refuse(key, exc)

    def wait(self, timeout: float = 60.0) -> None:
        """Returns once the shapes handed over so far are compiled (or failed); the compiling
        thread then ends, and the next shape handed over starts another."""
        worker, jobs = self.worker, self.jobs
        if worker is None or jobs is None or not worker.is_alive():
            return
        jobs.put(None)  # ends this thread once what is queued before it is done
        worker.join(timeout)

    def reset_counts(self) -> None:
        """The calls served count from 0 (tt.status counts from the end of tuning or loading:
        the checks of a build or of tt.load are not the user's calls)."""
        self.served = 0

    def describe(self) -> dict:
        refused = f"; {len(self.refused)} refused" if self.refused else ""
        return {"line": f"OpenVINO models of static shapes for {len(self.ready)} call shapes (of at most "
                        f"{self.limit}), {self.served} calls served by them{refused}"}


_IDLE = object()


def _work(owner: "weakref.ref[StaticShapes]", jobs: queue.Queue) -> None:
    """The compiling thread. It holds its models only while it compiles one: a model its user
    dropped is freed (its compiled models too), and the thread ends at its next look; it also
    ends after OV_IDLE_SECONDS with nothing to compile (the next shape handed over starts another)."""
    while True:
        try:
            key = jobs.get(timeout=settings.OV_IDLE_SECONDS)
        except queue.Empty:
            key = _IDLE
        shapes = owner()
        if shapes is None or key is None or shapes.stopping:
            return
        if key is _IDLE:
            with shapes.start:  # _hand starts a thread where this one is gone
                if jobs.empty():
                    shapes.worker = None
                    return
            continue
        try:
            with _COMPILING:
                shapes._compile(key)
        finally:
            shapes.pending.discard(key)
            shapes = None  # not held while waiting for the next shape


def _stop_all() -> None:
    """At exit: the compile in progress ends, the shapes still waiting are dropped."""
    for shapes in list(_LIVE):
        shapes.stopping = True
        shapes.wait(timeout=30.0)


def _after_fork_in_child() -> None:
    _COMPILING.release()
    for shapes in list(_LIVE):  # the compiling threads are the parent's
        shapes.worker, shapes.jobs = None, None
        shapes.pending.clear()


atexit.register(_stop_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_COMPILING.acquire, after_in_parent=_COMPILING.release,
                        after_in_child=_after_fork_in_child)
