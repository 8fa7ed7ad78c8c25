"""ONNX Runtime: the module exported to ONNX in memory and run by an InferenceSession.

An optional dependency: ``pip install torch-tweak[onnxruntime]`` (onnxruntime, onnx and
onnxscript, which torch's dynamo exporter needs). Without it the backend reports "not
installed" and strategies move on.

The module is exported with ``torch.onnx.export`` from the recorded calls of one signature:
the dynamo exporter by default, the TorchScript exporter where the dynamo one fails (or when
``exporter="torchscript"``). An input dimension that differs between the recorded calls is
exported dynamic, the others static; plain (non-tensor) arguments are baked in, as with
OpenVINO. Either exporter keeps the branches its example took: a branch on the inputs'
values is refused at the build, and a call shape is served only where a check proved the
model there (backends._traced). The ONNX model lives in memory only: a saved tuned model
keeps the backend's name and config, and tt.load exports the module again; no ONNX file is
ever read.

Calls: inputs pass as numpy arrays that share the CPU tensors' memory (a contiguous CPU tensor
is not copied), outputs come back as tensors sharing ORT's arrays. ``InferenceSession.run`` may
be called from several threads at once (ONNX Runtime documents concurrent Run calls on one
session as safe), so the backend is thread-safe. The CPU provider only: a module on another
device is reported unavailable (ONNX Runtime's CUDA provider is not wired here).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .._core import settings
from .._core import noise
from .._core.cpu_load import usable_cpus
from .._core._samples import Call, unstorable
from .._core.schema import Count, OneOf
from .base import Backend, BackendConfig, Baked, OutputForm
from .registry import register
from ._traced import Served, flatten_for_numpy, watch_values

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
EXECUTION_MODES = ("sequential", "parallel")
EXPORTERS = ("dynamo", "torchscript")

ONNX_EXPORT = {"torch.onnx._internal.exporter._registration": ("is not installed. Skipping",),
               "onnxscript.optimizer._constant_folding": ("Evaluation failed:",)}
"""What torch's dynamo ONNX exporter says about packages the user does not have (dropped while it
runs, torch_tweak._core.noise): a warning for every torchvision operator it would register when
torchvision is not installed ("torchvision is not installed. Skipping torchvision::nms"), on
every export, and onnxscript's constant folding's "Evaluation failed" for a constant it leaves
unfolded (the exported model is unchanged by it)."""


@dataclasses.dataclass
class ONNXRuntimeBackendConfig(BackendConfig):
    """graph_optimization_level: ONNX Runtime's graph optimizations ("disable", "basic",
    "extended", "all"). intra_op_threads / inter_op_threads: the session's thread pools
    (0: ONNX Runtime's default). execution_mode: "sequential" or "parallel" (operators of
    independent branches at once). exporter: "dynamo" (torch.onnx.export(dynamo=True), falling
    back to the TorchScript exporter where it fails) or "torchscript" (that one alone)."""

    graph_optimization_level: str = "all"
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    execution_mode: str = "sequential"
    exporter: str = "dynamo"

    SCHEMA = {**BackendConfig.SCHEMA, "graph_optimization_level": OneOf(OPTIMIZATION_LEVELS),
              "intra_op_threads": Count(0, settings.ORT_MAX_THREADS),
              "inter_op_threads": Count(0, settings.ORT_MAX_THREADS),
              "execution_mode": OneOf(EXECUTION_MODES), "exporter": OneOf(EXPORTERS)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.graph_optimization_level not in OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization_level must be one of {', '.join(OPTIMIZATION_LEVELS)}; "
                             f"got {self.graph_optimization_level!r}")
        for field in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, field)
            most = settings.ORT_MAX_THREADS
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise ValueError(f"{field} must be a whole number from 0 (ONNX Runtime's default) to {most}; "
                                 f"got {value!r}")
        if self.execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {', '.join(EXECUTION_MODES)}; got {self.execution_mode!r}")
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}; got {self.exporter!r}")


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _varying(samples: Sequence[Call], slots: list[int]) -> list[set[int]]:
    """Per input tensor, the dimensions whose size differs between the recorded calls."""
    shapes = [[tuple(leaves[i].shape) for i in slots] for leaves in (pytree.tree_leaves(s) for s in samples)]
    out: list[set[int]] = []
    for k in range(len(slots)):
        first = shapes[0][k]
        if any(len(s[k]) != len(first) for s in shapes):
            raise ValueError("ONNX Runtime: one input is a tensor of different ranks in the recorded calls")
        out.append({d for d in range(len(first)) if any(s[k][d] != first[d] for s in shapes)})
    return out


class ONNXRuntimeBackend(Backend):
    """ONNX Runtime on the CPU: the module exported to ONNX in memory and run by an
    InferenceSession; an optional package: "not installed" when it is missing."""

    name = "ONNXRuntime"
    config_class = ONNXRuntimeBackendConfig
    supports_autograd = False  # outputs come back from numpy arrays
    thread_safe = True  # concurrent InferenceSession.run calls are safe (see the module docs)
    packages = ("onnxruntime", "onnx", "onnxscript")

    def unavailable(self, device: torch.device) -> str | None:
        if _import("onnxruntime") is None or _import("onnx") is None:
            return "not installed (pip install torch-tweak[onnxruntime])"
        if device.type != "cpu":
            return f"the ONNX Runtime backend runs on the CPU, not on {device.type}"
        return None

    def can_store(self, sample: Call) -> bool:
        return unstorable(sample) is None  # the export traces the module on its recorded calls

    def load_bound(self, module: torch.nn.Module, samples: Sequence[Call], model: torch.nn.Module) -> str | None:
        """A file's thread pools within this machine's CPUs (a forged 1,024 intra- and inter-op
        threads each made the session crawl): more threads than CPUs only contend."""
        cpus = usable_cpus()
        for field in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self.config, field)
            if value > cpus:
                return f"{field}={value} is more threads than this machine's CPUs; the bound is {cpus}"
        return None

    def session_options(self) -> Any:
        ort = importlib.import_module("onnxruntime")
        cfg = self.config
        options = ort.SessionOptions()
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[cfg.graph_optimization_level]
        options.intra_op_num_threads = cfg.intra_op_threads
        options.inter_op_num_threads = cfg.inter_op_threads
        options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if cfg.execution_mode == "parallel"
                                  else ort.ExecutionMode.ORT_SEQUENTIAL)
        # fatal only: a run that fails raises, and the exception says it (traced.Served answers such a call
        # with the module's own forward); its warnings are not the user's business
        options.log_severity_level = 4
        return options

    def export(self, flat: torch.nn.Module, example: tuple, varying: list[set[int]]) -> bytes:
        """The ONNX model of `flat` on `example`, as bytes; `varying`: the dynamic dimensions per input."""
        names = [f"in_{i}" for i in range(len(example))]
        failure = None
        if self.config.exporter == "dynamo" and _import("onnxscript") is not None:
            from torch.export import Dim
            dynamic = tuple({d: Dim.DYNAMIC for d in dims} or None for dims in varying)
            try:
                with warnings.catch_warnings(), torch.no_grad(), noise.dropped(ONNX_EXPORT):
                    warnings.simplefilter("ignore")
                    program = torch.onnx.export(flat, example, dynamo=True, input_names=names, verbose=False,
                                                dynamic_shapes=dynamic if any(varying) else None)
                return program.model_proto.SerializeToString()
            except Exception as exc:  # the TorchScript exporter takes some modules the dynamo one cannot
                failure = exc
        buffer = io.BytesIO()
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                torch.onnx.export(flat, example, buffer, dynamo=False, input_names=names,
                                  dynamic_axes={n: sorted(d) for n, d in zip(names, varying) if d})
        except Exception as exc:
            if failure is not None:
                raise RuntimeError(f"ONNX export failed: dynamo exporter: {type(failure).__name__}: "
                                   f"{str(failure).splitlines()[0] if str(failure) else ''}; TorchScript exporter: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
            raise
        return buffer.getvalue()

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        ort = importlib.import_module("onnxruntime")
        prepared = flatten_for_numpy("ONNX Runtime", "export", module, samples)
        leaves, spec, slots, flat = prepared.leaves, prepared.spec, prepared.slots, prepared.module
        example = tuple(leaves[i].detach() for i in slots)
        with watch_values("ONNX Runtime", len(example)):  # a branch on values: refused
            model = self.export(flat, example, _varying(samples, slots))
        session = ort.InferenceSession(model, self.session_options(), providers=["CPUExecutionProvider"])
        inputs = [i.name for i in session.get_inputs()]
        if len(inputs) != len(slots):  # an exporter that dropped an input the module ignores
            raise ValueError(f"ONNX Runtime: the exported model takes {len(inputs)} inputs, the module {len(slots)}")
        with torch.no_grad():
            form = OutputForm(module(*samples[0][0], **samples[0][1]))

        baked = Baked(module, "ONNX Runtime")
        served = Served("ONNX Runtime", module, self.check_tolerance(), samples, spec, slots, self.own_errors)

        def answer(flat_in: list, args: tuple, kwargs: dict) -> Any:
            feed = {name: flat_in[i].detach().contiguous().numpy() for name, i in zip(inputs, slots)}
            return form.fill(torch.from_numpy(array) for array in session.run(None, feed))

        def run(*args: Any, **kwargs: Any) -> Any:
            flat_in, in_spec = pytree.tree_flatten((args, kwargs))
            # another layout than the exported one, or weights changed since: the module itself answers
            if in_spec != spec or baked.changed():
                return module(*args, **kwargs)
            # served by the session only at sizes a check proved it on (traced.Served)
            return served(answer, flat_in, args, kwargs)

        run.baked = baked  # type: ignore[attr-defined]
        run.served = served  # type: ignore[attr-defined]
        return run

    def describe(self) -> dict | None:
        """The call shapes proven at first sight and refused (traced.Served); None before any."""
        served = getattr(self.callable, "served", None)
        line = served.describe() if served is not None else None
        return {"line": line} if line else None


register(ONNXRuntimeBackend, devices=("cpu",), extra="onnxruntime", packages=("onnxruntime", "onnx", "onnxscript"))
