"""OpenVINO: the module converted to an OpenVINO model and compiled for the CPU or an Intel GPU.

An optional dependency: ``pip install torch-tweak[openvino]``. Without it the backend
reports "not installed" and strategies move on.

Two conversion paths:
- ``"convert_model"`` (the default): ``openvino.convert_model`` traces the module on the
  recorded calls of one signature, with static input shapes when they all agree, and
  ``Core.compile_model`` compiles it. A call then goes straight to the compiled model,
  with no guards to check, where its shape is proven (traced.Served: checked at the build,
  or against the module at its first call; a branch on the inputs' values is refused at the
  build, traced.watch_values); plain (non-tensor) arguments are baked in, which is safe
  because every signature is built on its own.
- ``"torch_compile"``: ``torch.compile(backend="openvino")``; graph breaks fall back to
  Python, so it takes modules the tracer cannot, at the cost of dynamo's guards per call.

The weights of a module on another device are moved to the CPU to be converted and put
back on their device afterwards. Inputs and outputs cross to and from the CPU as numpy
arrays, so bfloat16 tensors are refused.

Every call into OpenVINO's converter and compiler (and its import) runs inside ``native()``:
- Ctrl-C is deferred until the call returns, then raised as KeyboardInterrupt: the converter
  calls back into Python from C++ (its telemetry, the TorchScript decoder), and a
  KeyboardInterrupt raised inside such a callback aborts the process (SIGABRT from
  pybind11::error_already_set) or is swallowed; deferred, tuning's cleanup runs and the
  model is left as it was.
- OpenVINO's telemetry (the ``openvino_telemetry`` package: a client-id file under
  ``~/intel``, events sent from a thread) is off for torch-tweak's own use: its singleton is
  replaced by a silent one for the duration and put back after, so nothing is written outside
  torch-tweak's cache folder and nothing is sent, while the user's own choice (the consent
  file ``~/intel/openvino_telemetry``, the environment, a Telemetry the user's own import of
  openvino started) is left exactly as it was. While a build runs, another thread's own
  OpenVINO conversion is silent too.
- The thread's alternate signal stack is put back as it was (_ov_shapes.kept_signal_stack): a
  compiled model sets its own and gives back the one it found when freed, so models freed
  out of order left the thread on freed memory, and the next Ctrl-C was a SIGSEGV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from .._core._samples import Call, move, unstorable
from .._core.correctness import check
from .._core.cpu_load import host_memory
from .._core.model_state import restore_places, weight_places
from .._core.schema import Count, Name, OneOf
from .._core.layout import CallLayout
from .._core.shapes import Shapes
from .base import Backend, BackendConfig, Baked, OutputForm
from . import _ov_cache
from ._ov_shapes import StaticShapes, kept_signal_stack
from ._traced import Served, flatten_for_numpy, watch_values
from .registry import register

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
CONVERSIONS = ("convert_model", "torch_compile")
PRECISIONS = {None: None, "f32": "f32", "f16": "f16", "bf16": "bf16"}
_PRECISION_OF = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
logger = logging.getLogger("torch_tweak")


@dataclasses.dataclass
class OpenVINOBackendConfig(BackendConfig):
    """performance_hint: OpenVINO's PERFORMANCE_HINT ("LATENCY", "THROUGHPUT",
    "CUMULATIVE_THROUGHPUT"). conversion: "convert_model" or "torch_compile" (see the
    module docs). ov_device: OpenVINO's device name ("CPU", "GPU", "GPU.1"...; None: "CPU"
    for a cpu module, "GPU" for an xpu one). inference_precision: "f32", "f16" or "bf16"
    (None: the dtype of the module's outputs, so a CPU with AMX does not silently run
    float32 in bfloat16). properties: further OpenVINO properties, passed as they are.
    static_shapes: on the CPU, how many call shapes of a module converted with dynamic sizes
    get a model compiled for exactly that shape (ov_shapes.StaticShapes: the recorded calls'
    shapes at the build, another shape off the call path once its calls have run five
    compiles' time; each checked against the module before it serves; 0: none).
    static_memory_mb: those models' memory, counted as the module's weights each, stays under
    this.
    """

    performance_hint: str = "LATENCY"
    conversion: str = "convert_model"
    ov_device: str | None = None
    inference_precision: str | None = None
    properties: dict[str, Any] | None = None
    static_shapes: int = 32
    static_memory_mb: int = 2048

    # properties go to OpenVINO as they are: never taken from a file
    SCHEMA = {**BackendConfig.SCHEMA, "performance_hint": OneOf(PERFORMANCE_HINTS), "conversion": OneOf(CONVERSIONS),
              "ov_device": Name(r"[A-Z]{2,10}(\.[0-9]{1,2})?"), "inference_precision": OneOf(PRECISIONS),
              "static_shapes": Count(0, 1024), "static_memory_mb": Count(0, 1 << 20)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.performance_hint not in PERFORMANCE_HINTS:
            raise ValueError(f"performance_hint must be one of {', '.join(PERFORMANCE_HINTS)}; "
                             f"got {self.performance_hint!r}")
        if self.conversion not in CONVERSIONS:
            raise ValueError(f"conversion must be one of {', '.join(CONVERSIONS)}; got {self.conversion!r}")
        if self.ov_device is not None and not isinstance(self.ov_device, str):
            raise ValueError(f"ov_device must be an OpenVINO device name such as 'CPU' or 'GPU', "
                             f"got {self.ov_device!r}")
        if self.inference_precision not in PRECISIONS:
            raise ValueError(f"inference_precision must be one of f32, f16, bf16 or None; "
                             f"got {self.inference_precision!r}")
        if self.properties is not None and not isinstance(self.properties, dict):
            raise ValueError(f"properties must be a dict of OpenVINO properties, got {type(self.properties).__name__}")
        for name in ("static_shapes", "static_memory_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def lowers_precision(self) -> bool:
        """An inference precision other than f32 (f16, bf16), set here or as the
        INFERENCE_PRECISION_HINT property; None lets OpenVINO run the module's own dtype."""
        hint = (self.properties or {}).get("INFERENCE_PRECISION_HINT")
        named = getattr(hint, "to_string", None)  # an openvino.Type
        hint = named() if callable(named) else hint
        return (self.inference_precision not in (None, "f32") or hint not in (None, "f32")
                or super().lowers_precision())


def _import_openvino() -> Any:
    """The openvino module, or None when it cannot be imported."""
    try:
        with native():  # importing openvino starts its telemetry
            return importlib.import_module("openvino")
    except ImportError:
        return None


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _SilentTelemetry:
    """Stands in for openvino_telemetry's Telemetry singleton while torch-tweak calls OpenVINO:
    every method does nothing, and it has no ``backend``, so OpenVINO's init_ovc_telemetry does
    not initialise it again."""

    consent = False
    init = send_event = send_error = send_stack_trace = start_session = end_session = staticmethod(_nothing)
    force_shutdown = send_opt_in_event = staticmethod(_nothing)


_SINGLETON = "_SingletonMetaClass__single_instance"  # where openvino_telemetry's metaclass keeps it
_telemetry_lock = threading.RLock()
_telemetry_depth = 0
_telemetry_saved: Any = None


@contextlib.contextmanager
def telemetry_off() -> Iterator[None]:
    """OpenVINO's telemetry silenced for the calls inside (see the module docs); the user's own
    Telemetry, if any, is put back afterwards. Nothing to do when openvino_telemetry is not
    installed (OpenVINO then uses its own stub) or keeps its singleton elsewhere."""
    global _telemetry_depth, _telemetry_saved
    try:
        tm = importlib.import_module("openvino_telemetry")  # defines classes only: no side effect
        cls = tm.Telemetry
    except Exception:
        yield
        return
    if _SINGLETON not in vars(cls):
        yield
        return
    with _telemetry_lock:
        if _telemetry_depth == 0:
            _telemetry_saved = vars(cls)[_SINGLETON]
            setattr(cls, _SINGLETON, _SilentTelemetry())
        _telemetry_depth += 1
    try:
        yield
    finally:
        with _telemetry_lock:
            _telemetry_depth -= 1
            if _telemetry_depth == 0:
                setattr(cls, _SINGLETON, _telemetry_saved)
                _telemetry_saved = None


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside is recorded, not raised, and delivered when the block ends: as
    KeyboardInterrupt by Python's default handler, or to whatever handler was installed. Only
    the main thread gets Python's signals, so elsewhere (and when SIGINT is ignored, or its
    handler was not set from Python) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):
        yield
        return
    if previous is None or previous is signal.SIG_IGN:
        yield
        return
    received: list[Any] = []

    def record(signum: int, frame: Any) -> None:
        received.append(frame)

    try:
        signal.signal(signal.SIGINT, record)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])  # default_int_handler raises KeyboardInterrupt here
            else:  # SIG_DFL: what the signal does by default
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def native() -> Iterator[None]:
    """The context of every call into OpenVINO's converter and compiler: Ctrl-C deferred until
    it returns, OpenVINO's telemetry off, the thread's alternate signal stack kept (see the
    module docs)."""
    with sigint_deferred(), telemetry_off(), kept_signal_stack():
        yield


def _versions(ov: Any) -> dict[str, str]:
    """What a converted model depends on besides the module and its call (_ov_cache.key)."""
    from .._version import __version__

    return {"openvino": str(getattr(ov, "__version__", "")), "torch": torch.__version__, "torch_tweak": __version__}


def _compiled(backend: OpenVINOBackend, ov: Any, entry: str, module: torch.nn.Module, samples: Sequence[Call],
              device: torch.device, slots: list[int], first: Any, convert: Callable[[], Any]) -> tuple:
    """(the converted model, it compiled, the compile's seconds): the model torch-tweak's folder
    keeps for `entry` (_ov_cache) where it gives the module's answer `first` to the first recorded
    call, else convert() (traced with its values watched), kept there; backend.build_note says
    which."""
    model = _ov_cache.read(ov, entry, module)
    if model is not None:  # read, not converted: held to the module's answer before it is used
        start = time.perf_counter()
        compiled = ov.Core().compile_model(model, backend.ov_device(device), backend.properties(samples, module))
        compile_s = time.perf_counter() - start
        leaves = pytree.tree_leaves(samples[0])
        try:
            got = compiled.create_infer_request().infer([leaves[i].detach().cpu().numpy() for i in slots]).to_tuple()
            check(OutputForm(first).fill(torch.from_numpy(a) for a in got), first, backend.check_tolerance(),
                  where="the first recorded call", own=backend.own_errors)
        except Exception as exc:  # noqa: BLE001 - a mismatch (code the key does not see changed), or a failure
            logger.info("OpenVINO's converted model from torch-tweak's folder does not give the module's answer "
                        "(%s); converting again", str(exc)[:200])
            _ov_cache.drop(entry)
        else:
            backend.build_note = "its converted model read from torch-tweak's folder, not converted again"
            return model, compiled, compile_s
    start = time.perf_counter()
    with torch.no_grad(), watch_values("OpenVINO", len(slots)):
        model = convert()  # a branch on values: refused
    backend.build_note = f"converted in {time.perf_counter() - start:.2f} s"
    _ov_cache.write(ov, entry, model)
    start = time.perf_counter()
    compiled = ov.Core().compile_model(model, backend.ov_device(device), backend.properties(samples, module))
    return model, compiled, time.perf_counter() - start


def _within(leaves: list, slots: list[int], bounds: list) -> bool:
    """Whether each tensor slot's sizes are within its axes' bounds (OpenVINOBackend.bounds)."""
    for i, axes in zip(slots, bounds):
        shape = leaves[i].shape
        if len(shape) != len(axes):
            return False
        for size, want in zip(shape, axes):
            if (size < want[0] or size > want[1]) if isinstance(want, tuple) else want not in (-1, size):
                return False
    return True


def declared_bounds(declared: Shapes | None, layout: CallLayout, slots: list[int]) -> list | None:
    """Per tensor slot (its leaf index), per axis: its size where every sample has the same,
    the declared (min, max) on a declared axis that varies (the layout's batch axis and length
    inputs), -1 (any size) on another axis that varies; None without declared shapes (then
    every axis that varies is fully dynamic)."""
    if declared is None:
        return None
    by_leaf = {s.leaf: s for s in layout.slots}
    dims = []
    for i in slots:
        slot = by_leaf[i]
        axes: list = []
        for axis, size in enumerate(slot.shape):
            limits = (declared.batch if axis == 0 and layout.batch else
                      declared.length if axis == 1 and slot.length else None)
            axes.append(size if axis not in slot.varies else limits if limits is not None else -1)
        dims.append(axes)
    return dims


class OpenVINOBackend(Backend):
    """OpenVINO: the module converted and compiled for an OpenVINO device (the CPU, or an
    Intel GPU), an optional package: "not installed" when it is missing. Weights it moves
    to the CPU go back to their device after the build."""

    name = "OpenVINO"
    config_class = OpenVINOBackendConfig
    supports_autograd = False  # outputs come back from numpy arrays
    isolate_build = True  # compile_model has segfaulted on some CPUs (docs/backends.md)
    packages = ("openvino",)
    declared: Shapes | None = None
    """tt.tweak's shapes= (for_shapes): the bounds convert_model gives the declared axes."""

    def for_shapes(self, shapes: Shapes) -> "OpenVINOBackend":
        """A fresh copy that converts the declared axes with the declared ranges as their
        bounds (min..max), not as fully dynamic; a call past them runs the module itself."""
        clone = self.fresh()
        clone.declared = shapes
        return clone

    @property
    def thread_safe(self) -> bool:  # type: ignore[override]
        """convert_model: yes, every thread gets its own infer request of the compiled model.
        torch_compile: not shown (the openvino torch.compile backend's requests are its own),
        so the dispatcher serialises its calls."""
        return self.config.conversion == "convert_model"

    def unavailable(self, device: torch.device) -> str | None:
        ov = _import_openvino()
        if ov is None:
            return "not installed (pip install torch-tweak[openvino])"
        if device.type not in ("cpu", "xpu"):
            return f"OpenVINO runs on the CPU and Intel GPUs, not on {device.type}"
        wanted = self.ov_device(device)
        with native():
            available = ov.Core().available_devices
        if wanted.split(".")[0] not in {d.split(".")[0] for d in available}:
            return f"OpenVINO has no device {wanted} here (it sees {', '.join(available) or 'none'})"
        return None

    def can_store(self, sample: Call) -> bool:
        if self.config.conversion == "torch_compile":
            return unstorable(sample) is None
        return True  # the converted model is the artifact; no sample is needed to rebuild it

    def ov_device(self, device: torch.device) -> str:
        if self.config.ov_device is not None:
            return self.config.ov_device
        return "GPU" if device.type == "xpu" else "CPU"

    def properties(self, samples: Sequence[Call], module: torch.nn.Module) -> dict[str, Any]:
        cfg = self.config
        props: dict[str, Any] = {"PERFORMANCE_HINT": cfg.performance_hint}
        precision = cfg.inference_precision or self._output_precision(samples, module)
        if precision is not None:
            props["INFERENCE_PRECISION_HINT"] = precision
        props.update(cfg.properties or {})
        return props

    @staticmethod
    def _output_precision(samples: Sequence[Call], module: torch.nn.Module) -> str | None:
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_floating_point():
                return _PRECISION_OF.get(tensor.dtype)
        for args, kwargs in samples[:1]:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    return _PRECISION_OF.get(leaf.dtype)
        return None

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        places = weight_places(module)
        try:
            if device.type != "cpu":
                module.to("cpu")  # the converter reads the weights on the CPU
            with native():  # Ctrl-C waits for OpenVINO to return; its telemetry is off
                if self.config.conversion == "torch_compile":
                    return self._build_compiled(module, samples, device)
                return self._build_converted(module, samples, device)
        finally:
            restore_places(places)

    def _build_compiled(self, module: torch.nn.Module, samples: Sequence[Call],
                        device: torch.device) -> Callable[..., Any]:
        importlib.import_module("openvino.torch")  # registers the "openvino" torch.compile backend
        compiled = torch.compile(module, backend="openvino",
                                 options={"device": self.ov_device(device),
                                          "config": {k: str(v) for k, v in self.properties(samples, module).items()}})
        for args, kwargs in samples:  # compile now, so no compile lands in a measurement
            compiled(*args, **kwargs)

        def run(*args: Any, **kwargs: Any) -> Any:
            with telemetry_off():  # a call of a shape not seen yet converts again
                return compiled(*args, **kwargs)

        return run

    def _build_converted(self, module: torch.nn.Module, samples: Sequence[Call],
                         device: torch.device) -> Callable[..., Any]:
        ov = _import_openvino()
        prepared = flatten_for_numpy("OpenVINO", "convert", module, samples)
        leaves, spec, slots, flat = prepared.leaves, prepared.spec, prepared.slots, prepared.module
        example = tuple(leaves[i].detach().cpu() for i in slots)
        static = all(
            [tuple(leaf.shape) for leaf in pytree.tree_leaves(s) if isinstance(leaf, torch.Tensor)]
            == [tuple(t.shape) for t in example] for s in samples)
        bounds = None if static else declared_bounds(self.declared, self.layout_for(module, samples), slots)
        shapes = [tuple(t.shape) for t in example] if static else bounds
        entry = _ov_cache.key(module, _versions(ov), spec, [leaf for i, leaf in enumerate(leaves) if i not in slots],
                              example, shapes)
        args, kwargs = move(samples[0], torch.device("cpu"))
        with torch.no_grad():
            first = module(*args, **kwargs)
        form = OutputForm(first)
        model, compiled, compile_s = _compiled(self, ov, entry, module, samples, device, slots, first, lambda: (
            ov.convert_model(flat, example_input=example, input=None if shapes is None else [
                ov.PartialShape([ov.Dimension(*d) if isinstance(d, tuple) else d for d in axes]) if bounds
                else axes for axes in shapes])))
        target = None if device.type == "cpu" else device
        special = self._static_shapes(ov, model, device, static, samples, module, form, compile_s)
        if special is not None:  # the recorded calls' shapes: compiled now, checked at their first call
            special.prepare(tuple(tuple(flat[i].shape) for i in slots)
                            for flat, layout in map(pytree.tree_flatten, samples) if layout == spec)
        # An infer request runs one inference at a time ("Infer Request is busy"), and the
        # compiled model's own __call__ shares one between all callers: each thread gets
        # its own, made on its first call.
        local = threading.local()

        def dynamic(feed: list) -> tuple:
            request = getattr(local, "request", None)
            if request is None:
                request = local.request = compiled.create_infer_request()
            return request.infer(feed).to_tuple()

        baked = Baked(module, "OpenVINO")
        served = Served("OpenVINO", module, self.check_tolerance(), samples, spec, slots, self.own_errors)

        def answer(flat_in: list, args: tuple, kwargs: dict) -> Any:
            feed = [flat_in[i].detach().cpu().numpy() for i in slots]
            results = special.infer(feed, args, kwargs, dynamic) if special is not None else dynamic(feed)
            tensors = (torch.from_numpy(array) for array in results)
            return form.fill(tensors if target is None else (t.to(target) for t in tensors))

        def run(*args: Any, **kwargs: Any) -> Any:
            flat_in, in_spec = pytree.tree_flatten((args, kwargs))
            if in_spec != spec or (bounds is not None and not _within(flat_in, slots, bounds)) or baked.changed():
                # Another layout or structure than the converted one (only possible in the
                # "any other call" group, which has no signature to bind calls to), or sizes
                # past the declared bounds it was converted for.
                return module(*args, **kwargs)
            # served by the model only at sizes a check proved it on (traced.Served)
            return served(answer, flat_in, args, kwargs)

        run.input_shapes = [str(i.get_partial_shape()) for i in compiled.inputs]  # type: ignore[attr-defined]
        run.static_shapes = special  # type: ignore[attr-defined]
        if special is not None:  # its count of calls served starts with tt.status's (arm_untuned)
            run.reset_counts = special.reset_counts  # type: ignore[attr-defined]
        run.baked = baked  # type: ignore[attr-defined]
        run.served = served  # type: ignore[attr-defined]
        return run

    def load_bound(self, module: torch.nn.Module, samples: Sequence[Call], model: torch.nn.Module) -> str | None:
        """A file's static_memory_mb within this machine's memory: the models per call shape
        may take that much."""
        memory = host_memory()
        if memory is not None and self.config.static_memory_mb > memory >> 20:
            return (f"static_memory_mb={self.config.static_memory_mb} is more than this machine's memory; the bound "
                    f"is {memory >> 20} MiB")
        return None

    def _static_shapes(self, ov: Any, model: Any, device: torch.device, static: bool, samples: Sequence[Call],
                       module: torch.nn.Module, form: OutputForm, compile_s: float) -> StaticShapes | None:
        """Models per exact call shape, for a module converted with dynamic sizes to run on the
        CPU (an Intel GPU compiles for seconds); None where none are made."""
        cfg = self.config
        weights = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
        limit = min(cfg.static_shapes, (cfg.static_memory_mb << 20) // max(1, weights))
        if static or limit < 1 or self.ov_device(device) != "CPU" or device.type != "cpu":
            return None
        return StaticShapes(ov, model, "CPU", self.properties(samples, module), limit, module, form,
                            self.check_tolerance(), compile_s, self.own_errors)

    def describe(self) -> dict | None:
        """The call shapes proven (traced.Served) and the models per exact call shape
        (StaticShapes); None where there is neither."""
        special = getattr(self.callable, "static_shapes", None)
        served = getattr(self.callable, "served", None)
        lines = [special.describe()["line"]] if special is not None else []
        lines += [line for line in [served.describe() if served is not None else None] if line]
        return {"line": "; ".join(lines)} if lines else None


register(OpenVINOBackend, devices=("cpu", "xpu"), defaults={"cpu": 1, "xpu": 2}, extra="openvino",
         packages=("openvino",))
