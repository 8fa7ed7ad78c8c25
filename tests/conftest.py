"""Shared fixtures: a small model, and one Inductor tweak of examples/Tweak shared by the tests
that need it (Inductor compiles on a CPU are slow)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

# Triton's interpreter runs the fused decode step's kernels on a machine without CUDA (its tests,
# tests/test_fused_*.py): Triton reads this when it is first imported, and importing transformers'
# models imports it, so it is set before anything is. Inductor's CPU kernels do not use Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch_tweak as tt
import support
from support import CLOCKED, FAST, MLP, FakeClock, encoder
from torch_tweak._core.cpu_load import reading as REAL_READING


SLOW_FIXTURES = ("encoder_tweak", "tweaked")
"""Shared fixtures that tune with Inductor or a decoder (tens of seconds to minutes, once): a
test using one is marked slow, so `pytest -m "not slow"` never builds them."""


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def cache_folder(tmp_path_factory):
    """Build logs go to a folder of this test session, not the user's cache."""
    folder = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("TORCH_TWEAK_CACHE")
    os.environ["TORCH_TWEAK_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TORCH_TWEAK_CACHE", None)
    else:
        os.environ["TORCH_TWEAK_CACHE"] = previous


@pytest.fixture(scope="session", autouse=True)
def config_folder(tmp_path_factory):
    """The per-user sealing key (torch_tweak._core.storage.seal_key) is made in a folder of this
    test session, not in the user's configuration folder."""
    folder = tmp_path_factory.mktemp("config")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CONFIG_HOME", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal, also when the suite was started
    in the background of a shell without job control (which starts it with SIGINT ignored,
    and Python then keeps it ignored): the tests of Ctrl-C need it, and so do their children,
    which start with the default disposition once this process handles the signal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def load_unknown():
    """The machine's load reads as unknown (torch_tweak._core.cpu_load.reading returns None), so that
    no test's decision turns on what else the CI machine runs: a tweak measured while other
    processes take more than a quarter of the CPUs claims no speedup and keeps only a 2x
    gain. test_busy.py reads the real load (the real_load fixture) or a fake one."""
    from torch_tweak._core import cpu_load as load

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "reading", lambda: None)
        yield


@pytest.fixture
def real_load(monkeypatch):
    """torch_tweak._core.cpu_load.reading reads the machine's load again (see load_unknown)."""
    from torch_tweak._core import cpu_load as load

    monkeypatch.setattr(load, "reading", REAL_READING)


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    """Every measurement of the engine (tt.tweak's depth search, its module searches, the
    decode loop's choice, tt.tune) reads a FakeClock instead of the machine's: a test's model
    advances it by what a call costs (clock.advance(ns)), so no verdict turns on the machine's
    speed or load. A call that passes its own clock (the ranks' under torch.distributed) keeps it."""
    import functools

    from torch_tweak import _C

    clock = FakeClock()

    def clocked(real, *args, **kwargs):
        if kwargs.get("clock") is None:
            kwargs["clock"] = clock
        return real(*args, **kwargs)

    for name in CLOCKED:
        monkeypatch.setattr(_C, name, functools.partial(clocked, getattr(_C, name)))
    monkeypatch.setattr(support, "CLOCK", clock)  # support.Slow and support.pause cost fake time
    return clock


def fake_load(others_share: float):
    """A load reading (torch_tweak._core.cpu_load.reading's form) whose every window shows
    other processes taking `others_share` of the CPUs: each reading adds 1 s of 2 cores."""
    totals = [0.0, 0.0]

    def reading(also=()):
        totals[0] += 2.0 * others_share
        totals[1] += 2.0
        return totals[0], totals[1]

    return reading


@pytest.fixture
def busy_machine(monkeypatch):
    """set(share): the machine's load reads as other processes taking `share` of the CPUs
    (fake_load), for tt.tweak and the tuning cache alike; set(None): unknown again."""
    from torch_tweak._core import cpu_load as load

    def set_share(share):
        monkeypatch.setattr(load, "reading", (lambda also=(): None) if share is None else fake_load(share))

    return set_share


@pytest.fixture(autouse=True)
def tuning_cache_folder(tmp_path, monkeypatch):
    """Each test gets an empty cache folder, so no tweak is served from another test's entry."""
    folder = tmp_path / "tt-cache"
    monkeypatch.setenv("TORCH_TWEAK_CACHE", str(folder))
    return folder


@pytest.fixture
def steady_figures(monkeypatch):
    """The tuning cache replays an entry whatever its figures' quality. For tests of the cache's
    mechanics: on a busy machine their tiny models' latencies (microseconds, and sleeps) can move
    beyond the engine's agreement margin between the depth search and the side-by-side
    measurement, and such an entry is not replayed. test_figures.py tests that rule itself, on
    figures made inconsistent on purpose."""
    from torch_tweak._store import tuning_cache

    monkeypatch.setattr(tuning_cache, "REPLAYED", ("consistent", "remeasured", "inconsistent"), raising=False)


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture
def mlp_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(3)]


@pytest.fixture(scope="session")
def encoder_tweak():
    """One tweak of examples/Tweak's encoder with the default CPU backends (Inductor, OpenVINO, Eager)
    and the default depths (0 and 1)."""
    model = encoder.build()
    data = encoder.samples(count=2)
    with torch.no_grad():
        expected = [model(x) for x in data]
    result = tt.tweak(model, data, progress=False, measure=FAST, cache=False)  # measured here, never a cached entry
    return model, data, expected, result
