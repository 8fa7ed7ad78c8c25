"""Native crash isolation: a backend whose build runs native code that can crash the process
(``Backend.isolate_build = True``; OpenVINO's compile) is first built in a child process.

The child builds the backend for the module and one signature's recorded calls and runs
each call once; it only proves that this does not kill the process. A child that dies by
a signal, or exits before it finished, rejects the candidate (BuildCrashed, "OpenVINO
crashed while compiling (signal 11, SIGSEGV)"); an exception in the child is not a crash
(the real build, in the parent, raises it again and reports it). The verdict is stored
(torch_tweak._search.verdicts), so the child runs once per backend config, module, signature and
library versions; the real build then happens in the parent as before. Nothing of this
is on the path of a tuned call.

How the child gets the module:
- "fork" (Linux, a CPU module, no CUDA or XPU runtime started in this process): the child
  is a copy of this process, so the module and its calls are simply there (~0.1 s). A
  forked child must not enter the parent's OpenMP pool (libgomp's threads do not survive
  fork and the child would hang), so it runs torch with one intra-op thread. CUDA cannot
  be used after fork, hence the conditions.
- "spawn" (anything else): a fresh interpreter loads the backend, the module and the calls
  from a temporary file written with torch.save (~2 s more per child: importing torch).
  Classes must be importable there; a module that cannot be sent (a class defined in a
  script's ``__main__``, a lambda) is built without isolation, and its build log says so.
``$TORCH_TWEAK_ISOLATION`` = "fork", "spawn" or "off" overrides the choice ("off": no child).

A child never outlives the tuning process: it asks the kernel to kill it when its parent
dies (Linux's PR_SET_PDEATHSIG; elsewhere a thread watches the parent's pid), and Ctrl-C
while a child runs kills it. A hung child (a forked one can deadlock in a thread pool the
fork left half-alive, as OpenVINO's once did) is killed after a bound that scales with the
candidate's expected build time (see bound): ISOLATION_MULTIPLE times what finished children of the
same backend class and kind took per unit of the module's size (the last ones, kept beside
the verdicts), at least ISOLATION_FLOOR seconds, at most ISOLATION_CAP (``$TORCH_TWEAK_ISOLATION_TIMEOUT``, 600 s
by default). A forked child that hangs is tried again in a fresh interpreter, as a crash is;
a candidate whose child still does not finish is rejected (that verdict is not stored).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._core import settings
from .. import _C
from . import verdicts
from .._core._samples import Call

ISOLATION_ENV = "TORCH_TWEAK_ISOLATION"


class BuildCrashed(Exception):
    """A backend's build killed its isolated child process: the candidate is rejected."""


def method(device: torch.device) -> str:
    """"fork", "spawn" or "off" for a build on `device` (see the module docs)."""
    chosen = os.environ.get(ISOLATION_ENV, "").strip().lower()
    if chosen in ("fork", "spawn", "off"):
        return chosen
    if not hasattr(os, "fork") or not sys.platform.startswith("linux") or device.type != "cpu":
        return "spawn"
    if torch.cuda.is_initialized():
        return "spawn"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)():
        return "spawn"
    return "fork"


def check(backend: Any, module: nn.Module, samples: Sequence[Call], device: torch.device,
          notes: list[str]) -> None:
    """Proves that building `backend` on `module` and `samples` does not crash: by the stored
    verdict, else by a child run now (whose verdict is stored). Raises BuildCrashed when it
    crashes; appends what it did to `notes` (the build log's)."""
    how = method(device)
    if how == "off":
        notes.append(f"isolation: off (${ISOLATION_ENV}=off)")
        return
    parts = verdicts.parts_of(backend, module, samples, device)
    where = verdicts.path_of(verdicts.key_of(parts))
    verdict = verdicts.read(parts)
    if verdict is not None:
        notes.append(f"isolation: stored verdict {where} used, no child")
        if verdict.crashed:
            raise BuildCrashed(verdict.reason + " (stored verdict; a new library version runs the child again)")
        return
    limit = bound(backend, module, how)
    start = time.monotonic()
    code, stages, output, timed_out = _run_child(how, backend, module, samples, device, limit)
    took = time.monotonic() - start
    notes.append(f"isolation: {how} child ran in {took:.3f} s (bound {limit:.0f} s), exit status {code}, "
                 f"stages {' '.join(stages) or '-'}")
    if "unsent" in stages:
        notes.append("isolation: the module could not be sent to a child; built without isolation")
        notes.extend(_tail(output))
        return
    _record(backend, module, how, took, code, stages, timed_out)
    verdict = _verdict_of(backend.name, code, stages)
    if (verdict.crashed or timed_out) and how == "fork":
        # A forked child inherits the parent's threads in whatever state they were (OpenVINO's
        # and OpenMP's pools): it can abort, or deadlock, where a fresh process would not. A
        # crash or a hang seen there is believed only when a fresh interpreter shows it too.
        notes.extend(_tail(output))
        again = bound(backend, module, "spawn")
        start = time.monotonic()
        code, stages, output, hung = _run_child("spawn", backend, module, samples, device, again)
        took = time.monotonic() - start
        notes.append(f"isolation: the forked child {'hung' if timed_out else 'crashed'}; a spawned child ran in "
                     f"{took:.3f} s (bound {again:.0f} s) to confirm, exit status {code}, "
                     f"stages {' '.join(stages) or '-'}")
        if "unsent" in stages:
            notes.append("isolation: the module could not be sent to a fresh process; the fork's verdict stands")
        else:
            _record(backend, module, "spawn", took, code, stages, hung)
            verdict, timed_out, limit = _verdict_of(backend.name, code, stages), hung, again
    if timed_out:
        notes.extend(_tail(output))
        raise BuildCrashed(f"{backend.name} did not finish building within {limit:.0f} s in its isolated child "
                           "(killed as hung; the bound is a multiple of the build times of this backend's earlier "
                           f"children, at most $TORCH_TWEAK_ISOLATION_TIMEOUT = {settings.ISOLATION_CAP:.0f} s)")
    if verdict.crashed:
        notes.extend(_tail(output))
    stored = verdicts.write(parts, verdict)
    notes.append(f"isolation: verdict {'stored as' if stored else 'could not be stored as'} {where}")
    if verdict.crashed:
        raise BuildCrashed(verdict.reason)


def size_units(module: nn.Module) -> float:
    """The size a build's time is taken to scale with: 1 + the module's parameter and buffer
    elements in millions."""
    elements = sum(t.numel() for t in list(module.parameters()) + list(module.buffers()))
    return 1.0 + elements / 1e6


def bound(backend: Any, module: nn.Module, how: str) -> float:
    """Seconds a `how` child building `backend` on `module` may run before it counts as hung:
    ISOLATION_MULTIPLE times the expected build time (the module's size_units times the largest rate
    recorded for the backend's class and child kind, ISOLATION_DEFAULT_RATE when none is), at least
    ISOLATION_FLOOR, at most ISOLATION_CAP."""
    rate = max(verdicts.rates(backend, how), default=settings.ISOLATION_DEFAULT_RATE)
    cap = settings.ISOLATION_CAP
    return max(min(cap, settings.ISOLATION_FLOOR), min(cap, settings.ISOLATION_MULTIPLE * size_units(module) * rate))


def _record(backend: Any, module: nn.Module, how: str, took: float, code: int, stages: list[str],
            timed_out: bool) -> None:
    """Records how long a child that finished its build took (for the bound of later ones)."""
    if not timed_out and code == 0 and "built" in stages:
        verdicts.record_rate(backend, how, took / size_units(module))


def _verdict_of(name: str, code: int, stages: list[str]) -> verdicts.Verdict:
    if code == 0 and "done" in stages:
        return verdicts.Verdict(False)
    phase = "running its first call" if "built" in stages else "compiling"
    if code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = "unknown signal"
        how = f"signal {-code}, {sig}"
    else:
        how = f"exit status {code}"
    return verdicts.Verdict(True, f"{name} crashed while {phase} ({how})")


def _tail(output: str) -> list[str]:
    if not output.strip():
        return []
    tail = output[-settings.ISOLATION_OUTPUT_TAIL:]
    return ["child output (last lines):"] + [f"  {line}" for line in tail.splitlines()]


def _run_child(how: str, backend: Any, module: nn.Module, samples: Sequence[Call],
               device: torch.device, limit: float | None = None) -> tuple[int, list[str], str, bool]:
    """Runs the child; returns (exit code, negative for a signal; stages it reached; its
    output; whether it was killed for the time limit)."""
    folder = Path(tempfile.mkdtemp(prefix="torch-tweak-child-"))
    status, output = folder / "status", folder / "output"
    try:
        if how == "fork":
            poll, kill = _fork(backend, module, samples, device, status, output)
        else:
            started = _spawn(backend, module, samples, device, folder, status, output)
            if started is None:
                return 0, ["unsent"], _read(output), False
            poll, kill = started
        code, timed_out = _wait(poll, kill, settings.ISOLATION_CAP if limit is None else limit)
        return code, _read(status).split(), _read(output), timed_out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(poll: Callable[[], int | None], kill: Callable[[], None], limit: float) -> tuple[int, bool]:
    """Waits for the child in short sleeps, so Ctrl-C (KeyboardInterrupt) is handled at once:
    any exception here kills the child before it propagates. After `limit` seconds the child
    is killed (returns timed out)."""
    deadline = time.monotonic() + limit
    pause = 0.001
    try:
        while True:
            code = poll()
            if code is not None:
                return code, False
            if time.monotonic() > deadline:
                kill()
                return -signal.SIGKILL, True
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    except BaseException:
        kill()
        raise


def _fork(backend: Any, module: nn.Module, samples: Sequence[Call], device: torch.device,
          status: Path, output: Path) -> tuple[Callable[[], int | None], Callable[[], None]]:
    sys.stdout.flush()
    sys.stderr.flush()
    parent, prctl = os.getpid(), _prctl()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        code = 70
        try:
            _die_with(parent, prctl)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C at the terminal ends it too
            out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            if faulthandler.is_enabled():  # its traceback of the crash goes to the child's output
                faulthandler.enable(file=2)
            torch.set_num_threads(1)  # the parent's OpenMP threads are not in this process
            _build_and_run(backend, module, samples, device, status)
            code = 0
        except BaseException:
            code = 0  # an exception is no crash: the parent's own build reports it
        finally:
            os._exit(code)
    reaped: list[int] = []

    def poll() -> int | None:
        if reaped:
            return reaped[0]
        done, state = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            return None
        reaped.append(os.waitstatus_to_exitcode(state))
        return reaped[0]

    def kill() -> None:
        if reaped:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            reaped.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    return poll, kill


def _spawn(backend: Any, module: nn.Module, samples: Sequence[Call], device: torch.device, folder: Path,
           status: Path, output: Path) -> tuple[Callable[[], int | None], Callable[[], None]] | None:
    payload = folder / "payload.pt"
    try:
        torch.save({"backend": backend.fresh(), "module": module, "samples": list(samples), "device": str(device)},
                   payload, pickle_module=_WithoutWrappers)
    except Exception as exc:
        output.write_text(f"{type(exc).__name__}: {exc}\n", encoding="utf-8")
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with open(output, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch_tweak._search.isolation", str(payload), str(status),
                                 str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def kill() -> None:
        if proc.returncode is None:
            proc.kill()
            proc.wait()

    return proc.poll, kill


def _none() -> None:
    return None


PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux, else None; looked up before a fork (the loader's lock may be held
    by another thread at the moment of the fork, and a forked child must not need it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with(parent: int, prctl: Callable[..., int] | None) -> None:
    """Makes this child die when `parent` (the tuning process) does: the kernel sends SIGKILL
    on Linux (PR_SET_PDEATHSIG), elsewhere a thread polls the parent's pid. A parent already
    gone (it died before this ran) ends the child at once."""
    armed = False
    if prctl is not None:
        try:
            armed = prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except Exception:
            armed = False
    if os.getppid() != parent:
        os._exit(0)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, name="torch-tweak-parent-watch", daemon=True).start()


class _WithoutWrappers:
    """The pickle module torch.save uses for a spawned child: the tuned-module wrappers the
    module refers to (a wrapped root's own) are left out; the child builds the module alone."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, _C.Dispatcher):
                return _none, ()
            return NotImplemented


def _build_and_run(backend: Any, module: nn.Module, samples: Sequence[Call], device: torch.device,
                   status: Path) -> None:
    """The child's work: build, then run every call once, noting each stage as it is reached."""
    with open(status, "a", encoding="utf-8") as note:
        def reached(stage: str) -> None:
            note.write(stage + "\n")
            note.flush()

        reached("started")
        try:
            with torch.no_grad():
                fn = backend.fresh().prepare(module, samples, device)
                reached("built")
                for args, kwargs in samples:
                    fn(*args, **kwargs)
        except Exception:
            reached("raised")
        reached("done")


def _spawned_main(payload: str, status: str, parent: str | None = None) -> int:
    """The spawned child's entry point (python -m torch_tweak._search.isolation PAYLOAD STATUS PARENT_PID)."""
    if parent is not None:
        _die_with(int(parent), _prctl())
    try:
        given = torch.load(payload, weights_only=False)  # written by our own parent, in its private folder
    except Exception as exc:
        with open(status, "a", encoding="utf-8") as note:
            note.write("unsent\n")
        print(f"could not load the module: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 0
    _build_and_run(given["backend"], given["module"], given["samples"], torch.device(given["device"]), Path(status))
    return 0


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).decode("utf-8", errors="replace")
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(_spawned_main(*sys.argv[1:4]))
