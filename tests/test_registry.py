"""The backend registry (torch_tweak.backends.registry): every built-in backend is in it, and
what is derived from it (BUILT_IN, the default backends, the tuning cache's optional packages,
the install extras, the variants tt.tweak tries) agrees with it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import torch_tweak as tt
from torch_tweak import backends
from torch_tweak._store import tuning_cache
from torch_tweak.backends import registry

ROOT = Path(__file__).resolve().parents[1]


def backend_classes() -> set[type]:
    """Every concrete Backend subclass defined in a module of torch_tweak.backends."""
    found = set()
    for info in pkgutil.iter_modules(backends.__path__):
        module = importlib.import_module(f"{backends.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, tt.Backend) and cls.__module__ == module.__name__ and not inspect.isabstract(cls)):
                found.add(cls)
    return found


def test_every_built_in_backend_is_registered():
    classes = backend_classes()
    assert {"TorchEagerBackend", "ONNXRuntimeBackend", "InductorGraphBackend"} <= {c.__name__ for c in classes}
    assert classes == set(registry.built_in()) == set(backends.BUILT_IN)
    for cls in backends.BUILT_IN:  # the package exports each with its config class
        assert getattr(backends, cls.__name__) is cls and cls.__name__ in backends.__all__
        assert getattr(backends, cls.config_class.__name__) is cls.config_class


def test_a_backend_file_without_its_registration_is_found(monkeypatch):
    """The check above fails for a backend whose file forgets to register it."""
    forgotten = backends.BUILT_IN[-1]
    monkeypatch.delitem(registry._REGISTERED, forgotten)
    assert forgotten in backend_classes() - set(registry.built_in())


def extras() -> dict[str, list[str]]:
    """pyproject.toml's [project.optional-dependencies]: extra -> distribution names."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {extra: [re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in reqs]
            for extra, reqs in project["optional-dependencies"].items()}


def test_the_install_extras_name_every_optional_package():
    declared = extras()
    optional = [r for r in registry.registrations() if r.extra is not None]
    assert {r.extra for r in optional} >= {"openvino", "onnxruntime", "torchao"}
    for r in optional:
        assert r.extra in declared, f"pyproject.toml has no extra {r.extra!r} for {r.name}"
        assert set(r.packages) <= set(declared[r.extra]), (r.name, r.packages, declared[r.extra])
    assert set(tuning_cache.OPTIONAL_PACKAGES) == {r.packages[0] for r in optional}


def test_registrations_say_where_a_backend_runs_and_is_a_default():
    for r in registry.registrations():
        assert r.devices and set(r.defaults) <= set(r.devices), r.name
        assert r.cls.name == r.name and registry.registration_of(r.cls) is r
    assert sum(r.baseline for r in registry.registrations()) == 1
    for kind in ("cpu", "cuda", "xpu"):
        named = [b.name for b in tt.default_backends(kind)]
        ranked = sorted((r for r in registry.registrations() if kind in r.defaults),
                        key=lambda r: (r.baseline, r.defaults[kind]))
        assert named == [r.name for r in ranked] and named[-1] == registry.baseline().name
    assert not any(r.cls.opt_in and r.defaults for r in registry.registrations())  # opt-in is never a default


def test_register_refuses_what_is_not_a_backend_or_registered_twice():
    with pytest.raises(TypeError, match="Backend subclass"):
        registry.register(int, devices=("cpu",))
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(backends.BUILT_IN[0], devices=("cpu",))
    assert registry.registration_of(type("Mine", (backends.BUILT_IN[0],), {})) is registry.registrations()[0]


def test_variants_come_from_the_registrations():
    """Each variant tt.tweak adds is one a registration offers, on the devices it names."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    axes = tt.Axes("high", (("bf16", 0.03), ("int8", 0.05)))
    for device in (cpu, cuda):
        for backend, rule in axes.variants(tt.default_backends(device), device):
            r = registry.registration_of(type(backend))
            offers = [v for v in r.variants if v.rule == rule and (not v.devices or device.type in v.devices)]
            assert any(all(getattr(backend.config, k) == value for k, value in v.fields) for v in offers), backend
    names = [b.name for b, _ in axes.variants(tt.default_backends(cpu), cpu)]
    assert "TorchAO [int8_weight_only]" in names and not any("sdpa" in n or "combo" in n for n in names)


def test_torchao_imports_without_a_line_on_a_cpu_torch():
    """Every transformers import printed torchao 0.18's load failures of its CUDA kernels and
    torch's deprecation of its Enum constants: on a CPU torch, scripts/setup.sh installs the
    torchao that imports without a line (0.13.0)."""
    import subprocess
    import sys

    import torch

    torchao = pytest.importorskip("torchao")
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("a GPU build of torch: torchao 0.18, whose kernels load there")
    if torchao.__version__ != "0.13.0":
        pytest.skip(f"torchao {torchao.__version__} was installed by an older set-up: scripts/setup.sh in a fresh "
                    ".venv installs 0.13.0 on a CPU torch")
    done = subprocess.run([sys.executable, "-W", "error", "-c", "import torchao, transformers"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr[-2000:]
