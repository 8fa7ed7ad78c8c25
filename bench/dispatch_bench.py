"""Per-call cost of the tuned-module dispatcher against the alternatives.

One run prints a table of nanoseconds per call (the median of several timeit
repeats, each a loop of many calls) and writes bench/results/dispatch.md:

    direct            a tiny backend called directly
    dispatcher        the same backend through _C.Dispatcher, active, signature None
    + signature       the same through a Signature of one tensor (dtype, shape, device)
    subclass          a TunedModule-shaped subclass (Dispatcher, nn.Module), signature None
    in place          a module tuned in place (module.install): its class's __call__ is
                      _C.root_call, sending the call to its TunedModule; beside it the same
                      through the Python __call__ that was there before (for comparison), and
                      the TunedModule called directly
    fallback          a call the signature rejects, so the original (the backend) runs
    keywords          a call by keyword through a Signature recorded with the same keywords,
                      in the recorded order (the fast path) and reversed (bound by name)
    nn.Identity()     nn.Module.__call__ around a trivial forward: what a wrapper replaces

The cases are timed round-robin (repeat 1 of every case, then repeat 2...), so a busy
moment of a shared machine falls on every case alike. Dispatcher overhead = dispatcher call -
direct call. Usage:
    python bench/dispatch_bench.py [--number N] [--repeat R] [--out PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import timeit

import torch
from torch import nn

from torch_tweak import _C
from torch_tweak._runtime.module import install, make_wrapper


class TunedLike(_C.Dispatcher, nn.Module):
    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self._tt_bind(module)
        _C.enable_vectorcall(type(self))


def backend(x):
    return x


def kw_backend(a=None, b=None):
    return a


def dispatcher(entries, original=backend, cls=_C.Dispatcher):
    d = cls(original) if cls is not _C.Dispatcher else cls()
    if cls is _C.Dispatcher:
        d._tt_bind(original)
    d._tt_set_entries(entries)
    d._tt_mode = 1
    return d


def python_call_root(self, *args, **kwargs):
    """The in-place __call__ as it was in Python, before _C.root_call: the comparison row."""
    return self.__dict__["_tt_root"](*args, **kwargs)


def tuned_in_place():
    """(a TunedModule active on `backend`, a module tuned in place with it, the same module
    shape sending its calls through python_call_root instead)."""
    model = nn.Sequential(nn.Identity())
    wrapper = make_wrapper(model, "0")
    install(model, wrapper)
    wrapper._tt_set_entries([(None, backend)])
    wrapper._tt_mode = 1
    py = nn.Identity()
    py.__dict__["_tt_root"] = wrapper
    py.__class__ = type("Identity", (nn.Identity,), {"__call__": python_call_root})
    return wrapper, model[0], py


def timer_of(fn, arg) -> timeit.Timer:
    """arg: one positional argument, or a dict of keyword arguments (in its order)."""
    stmt = "fn(**arg)" if isinstance(arg, dict) else "fn(arg)"
    return timeit.Timer(stmt, globals={"fn": fn, "arg": arg})


def per_call_ns(cases, number: int, repeat: int) -> list[list[float]]:
    """ns per call of each (fn, arg), one list of `repeat` loops per case, timed
    round-robin."""
    timers = [timer_of(fn, arg) for fn, arg in cases]
    for timer in timers:
        timer.timeit(number // 10 or 1)  # warm caches
    runs: list[list[float]] = [[] for _ in timers]
    for _ in range(repeat):
        for i, timer in enumerate(timers):
            runs[i].append(timer.timeit(number) / number * 1e9)
    return runs


def summary(runs: list[float]) -> tuple[float, float]:
    """(median ns per call over the repeats, their min-max range as a fraction of it)."""
    median = statistics.median(runs)
    return median, (max(runs) - min(runs)) / median


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000, help="calls per timeit loop")
    parser.add_argument("--repeat", type=int, default=7, help="timeit loops; the median counts")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results", "dispatch.md"))
    parser.add_argument("--json", default=None, help="also write every loop's figure here")
    args = parser.parse_args()

    x = torch.ones(8, 16)
    other = torch.ones(4, 16)
    sig = _C.Signature((x,), {})
    kwsig = _C.Signature((), {"a": x, "b": x})
    wrapper, in_place, python_in_place = tuned_in_place()
    cases = [
        ("direct call of the backend", backend, x),
        ("Dispatcher, active, signature None", dispatcher([(None, backend)]), x),
        ("Dispatcher, active, 1-tensor Signature", dispatcher([(sig, backend)]), x),
        ("TunedModule-like subclass, signature None",
         dispatcher([(None, backend)], nn.Identity(), TunedLike), x),
        ("TunedModule, signature None", wrapper, x),
        ("tuned in place: _C.root_call -> TunedModule", in_place, x),
        ("tuned in place: Python __call__ -> TunedModule", python_in_place, x),
        ("Dispatcher, signature mismatch -> original", dispatcher([(sig, backend)]), other),
        ("nn.Identity() (nn.Module.__call__)", nn.Identity(), x),
        ("direct call, 2 keywords", kw_backend, {"a": x, "b": x}),
        ("Dispatcher, 2-keyword Signature, recorded order",
         dispatcher([(kwsig, kw_backend)], kw_backend), {"a": x, "b": x}),
        ("Dispatcher, 2-keyword Signature, reversed order",
         dispatcher([(kwsig, kw_backend)], kw_backend), {"b": x, "a": x}),
    ]
    runs = per_call_ns([(lambda a: None, x)] + [(fn, arg) for _, fn, arg in cases], args.number,
                       args.repeat)
    loop = summary(runs[0])[0]
    results = [(name, *summary(r)) for (name, _, _), r in zip(cases, runs[1:])]
    direct = results[0][1]

    info = [
        ("CPU", cpu_model()),
        ("Python", platform.python_version()),
        ("torch", torch.__version__),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("timing", f"median of {args.repeat} timeit loops of {args.number} calls"),
        ("loop + lambda call", f"{loop:.1f} ns (included in every row)"),
    ]
    rows = [(name, ns, ns - direct, spread) for name, ns, spread in results]
    header = f"{'case':48s} {'ns/call':>9s} {'vs direct':>10s} {'range':>7s}"
    lines = [header, "-" * len(header)]
    lines += [f"{name:48s} {ns:9.1f} {delta:+10.1f} {spread:7.0%}" for name, ns, delta, spread in rows]
    print("\n".join(f"{k}: {v}" for k, v in info))
    print()
    print("\n".join(lines))

    md = ["# Dispatcher per-call cost", "",
          "Produced by `python bench/dispatch_bench.py` (one run, one machine). "
          "Each row is nanoseconds per call including the timeit loop; "
          "`vs direct` is the row minus the direct call of the backend, which for the "
          "dispatcher rows is the dispatcher's own overhead; `range` is the spread of the "
          "repeats (max - min) over their median, a measure of the machine's noise.", ""]
    md += [f"- {k}: {v}" for k, v in info]
    md += ["", "| case | ns/call | vs direct | range |", "|---|---:|---:|---:|"]
    md += [f"| {name} | {ns:.1f} | {delta:+.1f} | {spread:.0%} |" for name, ns, delta, spread in rows]
    md.append("")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md))
    print(f"\nwritten: {args.out}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": dict(info), "loop_ns": runs[0],
                       "cases": {name: r for (name, _, _), r in zip(cases, runs[1:])}}, f, indent=1)
        print(f"written: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
