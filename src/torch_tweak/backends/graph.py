"""Device graph: the module recorded once (a CUDA graph on cuda, an XPU graph on xpu) and
replayed at every call by torch_tweak._C.GraphReplay.

Recording: the recorded samples must show one static call (the same argument structure,
tensor shapes, dtypes and plain values); the module runs ``warmup`` times on a side stream
(lazy initialisation, cuBLAS workspaces, autotuning happen there), then once more under
capture, on that stream, into a private memory pool.

Replay (C): a call that fits the recording copies its input tensors into the static
buffers and launches a graph on the current stream. Any other call (a larger batch,
another dtype, device or structure) runs the original module.

Outputs (``lend_outputs=True``, the default): the module is recorded twice on the same
static inputs. A call returns the outputs of the second recording as they are, without a
copy, whenever nothing the previous such call returned is still alive (torch's use count
of each output's storage, which every tensor and view of that memory raises, says so);
when the caller still holds any of it, the call replays the first recording instead and
returns fresh copies of its outputs. Outputs that share memory with an input or with the
module's weights are always copied. Either way a later call never overwrites a tensor the
caller holds. With ``lend_outputs=False`` there is one recording and every output is copied.

What a graph cannot see: Python side effects of forward, reads of tensors that are not
arguments but change between calls by reassignment (a parameter replaced by ``p.data =
...`` or ``model.to(...)``: call tt.tune again), and in-place writes to the input
tensors (the graph writes to its static copy). Outputs come back detached from autograd.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .. import _C
from .._core._samples import Call
from .._core.schema import Count, Flag, OneOf
from .base import Backend, ShapesVary
from .inductor import compile_module, shared_compiles
from .registry import register
from .variants import AUTOTUNE_MODE, CHANNELS_LAST, COMBO_KERNELS, LOWER_PRECISION, MAX_AUTOTUNE, SDPA, VariantConfig

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
               torch.memory_format, torch.layout, enum.Enum)
"""Values a recording may bake in: they are compared with == at every call."""


class GraphUnsupported(Exception):
    """The recorded samples or the module's outputs cannot be served by one static graph."""


class GraphShapesVary(GraphUnsupported, ShapesVary):
    """The recorded samples' sizes vary: one static graph cannot serve them."""


class GraphCaptureError(Exception):
    """The module failed while being recorded (it synchronises, or calls what a graph cannot hold)."""


@dataclasses.dataclass
class DeviceGraphBackendConfig(VariantConfig):
    """warmup: calls on a side stream before the capture (at least 1).
    share_pool: every graph this process records on a device shares one memory pool
    (less memory with many modules; safe only when the graphs are replayed one at a time,
    which the tuned model does, never concurrently on several streams).
    capture_error_mode: torch's cudaStreamCaptureMode for the capture ("global",
    "thread_local" or "relaxed"); ignored on xpu.
    lend_outputs: record a second time and return that recording's outputs without a copy
    while the caller holds nothing from the last such call (see the module docstring);
    False: one recording, every output copied (less memory, a copy per output per call).
    memory_format, sdpa_kernel, tf32, autocast_dtype: the candidate's variant
    (backends.variants.VariantConfig), recorded into the graph with the module's kernels.
    """

    warmup: int = 3
    share_pool: bool = False
    capture_error_mode: str = "global"
    lend_outputs: bool = True

    SCHEMA = {**VariantConfig.SCHEMA, "warmup": Count(1, 100), "share_pool": Flag(),
              "capture_error_mode": OneOf(CAPTURE_ERROR_MODES), "lend_outputs": Flag()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {self.warmup!r}")
        if not isinstance(self.share_pool, bool):
            raise ValueError(f"share_pool must be a bool, got {self.share_pool!r}")
        if not isinstance(self.lend_outputs, bool):
            raise ValueError(f"lend_outputs must be a bool, got {self.lend_outputs!r}")
        if self.capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}; "
                             f"got {self.capture_error_mode!r}")


# (device type, index) -> pool handle shared by graphs recorded with share_pool=True.
_SHARED_POOLS: dict[tuple[str, int], Any] = {}


class _DeviceApi:
    """The graph, stream and pool calls of one device type (torch.cuda or torch.xpu)."""

    def __init__(self, device: torch.device) -> None:
        self.type = device.type
        self.mod = torch.cuda if device.type == "cuda" else torch.xpu
        self.index = device.index if device.index is not None else self.mod.current_device()
        self.device = torch.device(device.type, self.index)

    def graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self.type == "cuda" else torch.xpu.XPUGraph()

    def pool(self, shared: bool) -> Any:
        if not shared:
            return None
        key = (self.type, self.index)
        if key not in _SHARED_POOLS:
            _SHARED_POOLS[key] = self.mod.graph_pool_handle()
        return _SHARED_POOLS[key]

    def capture_begin(self, graph: Any, pool: Any, mode: str) -> None:
        if self.type == "cuda":
            graph.capture_begin(pool=pool, capture_error_mode=mode)
        else:
            graph.capture_begin(pool=pool)


def graph_unavailable(device: torch.device) -> str | None:
    """Why device graphs cannot run on `device`, or None."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this process"
        return None
    if device.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return "XPU is not available in this process"
        if not hasattr(xpu, "XPUGraph"):
            return f"this torch ({torch.__version__}) has no XPU graphs (torch.xpu.XPUGraph)"
        return None
    return f"device graphs run on cuda and xpu devices, not {device.type}"


# ----------------------------------------------------------------- samples


def _where(key: int | str) -> str:
    return f"argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"


def _check_plain(values: list, where: str) -> None:
    first = values[0]
    leaves = pytree.tree_leaves(first)
    if any(isinstance(v, torch.Tensor) for v in leaves):
        raise GraphUnsupported(
            f"{where} holds tensors inside a {type(first).__name__}; a device graph copies tensors "
            "passed directly or in a tuple or list argument")
    for leaf in leaves:
        if not isinstance(leaf, PLAIN_TYPES):
            raise GraphUnsupported(
                f"{where} is a {type(leaf).__name__}, which a device graph cannot store; it takes "
                "tensors and plain values (None, numbers, strings, dtypes)")
    for n, value in enumerate(values[1:], 1):
        if type(value) is not type(first) or value != first:
            raise GraphUnsupported(
                f"{where} varies across samples ({first!r} in sample 0, {value!r} in sample {n}); "
                "a device graph bakes it in")


def _check_tensors(values: list, where: str, device: torch.device) -> None:
    first = values[0]
    for n, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise GraphUnsupported(f"{where} is a tensor in sample 0 but a {type(value).__name__} in sample {n}")
        if value.device != device:
            raise GraphUnsupported(f"{where} is on {value.device}, not on {device} where the graph runs")
        if value.dtype != first.dtype:
            raise GraphUnsupported(f"{where} is {first.dtype} in sample 0 but {value.dtype} in sample {n}")
        if value.dim() != first.dim():
            raise GraphShapesVary(f"dynamic shapes: {where} has {first.dim()} dims in sample 0, "
                                   f"{value.dim()} in sample {n}")
    for axis in range(first.dim()):
        sizes = sorted({int(v.shape[axis]) for v in values})
        if len(sizes) > 1:
            raise GraphShapesVary(f"dynamic shapes: {where} axis {axis} varies "
                                   f"(sizes {', '.join(map(str, sizes))})")


def static_inputs(samples: Sequence[Call], device: torch.device) -> list[tuple[int | str, int, torch.Tensor]]:
    """The input tensors of the one static call the samples show, as (position or keyword
    name, index in a tuple/list argument or -1, tensor of sample 0); raises GraphUnsupported
    naming what varies."""
    args0, kwargs0 = samples[0]
    for n, (args, kwargs) in enumerate(samples[1:], 1):
        if len(args) != len(args0):
            raise GraphUnsupported(f"sample {n} has {len(args)} positional arguments, sample 0 has {len(args0)}")
        if set(kwargs) != set(kwargs0):
            raise GraphUnsupported(f"sample {n} has keyword arguments {sorted(kwargs)}, sample 0 has {sorted(kwargs0)}")
    slots: list[tuple[int | str, int, torch.Tensor]] = []
    keys: list[int | str] = list(range(len(args0))) + list(kwargs0)
    for key in keys:
        values = [args[key] if isinstance(key, int) else kwargs[key] for args, kwargs in samples]
        first, where = values[0], _where(key)
        if isinstance(first, torch.Tensor):
            _check_tensors(values, where, device)
            slots.append((key, -1, first))
        elif type(first) in (tuple, list):
            for n, value in enumerate(values):
                if type(value) is not type(first) or len(value) != len(first):
                    raise GraphUnsupported(f"{where} is a {type(first).__name__} of {len(first)} in sample 0, "
                                           f"a {type(value).__name__} of {len(value)} in sample {n}")
            for j, item in enumerate(first):
                items = [v[j] for v in values]
                if isinstance(item, torch.Tensor):
                    _check_tensors(items, f"{where} item {j}", device)
                    slots.append((key, j, item))
                else:
                    _check_plain(items, f"{where} item {j}")
        else:
            _check_plain(values, where)
    return slots


def static_call(args: tuple, kwargs: dict, slots: list) -> tuple[tuple, dict, list]:
    """Sample 0 with each input tensor replaced by a contiguous copy of it, the static
    buffers, and the inputs for GraphReplay: (position or name, item, buffer)."""
    buffers = {}
    inputs = []
    for key, item, tensor in slots:
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
        buffers[key, item] = buffer
        inputs.append((key, item, buffer))

    def place(key: int | str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return buffers[key, -1]
        if type(value) in (tuple, list):
            return type(value)(buffers.get((key, j), v) for j, v in enumerate(value))
        return value

    static_args = tuple(place(i, a) for i, a in enumerate(args))
    static_kwargs = {k: place(k, v) for k, v in kwargs.items()}
    return static_args, static_kwargs, inputs


def graph_outputs(out: Any) -> tuple[Any, Callable[[list], Any] | None]:
    """How GraphReplay returns `out`: (outputs, rebuild or None); raises GraphUnsupported
    for an output it cannot copy."""
    if isinstance(out, torch.Tensor):
        return out, None
    leaves, spec = pytree.tree_flatten(out)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor,) + PLAIN_TYPES):
            raise GraphUnsupported(
                f"the module returns a {type(leaf).__name__} inside its output, which a device graph "
                "cannot copy; it returns tensors, plain values, and tuples, lists, dicts of them")
    if type(out) in (tuple, list) and len(leaves) == len(out) and all(a is b for a, b in zip(leaves, out)):
        return out, None
    return list(leaves), spec.unflatten


def lend_specs(outputs: Any, held: Sequence[torch.Tensor]) -> list:
    """GraphReplay's `lend` for a lending recording's outputs (a tensor, or a list of
    leaves): per leaf None (copied: not a tensor, or its memory is shared with a tensor in
    `held`, such as an input buffer or a weight), or (storage, its address, the use count
    it has with nothing lent: one per distinct tensor among the outputs on that storage,
    plus one for the storage object kept here)."""
    leaves = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    taken = {t.untyped_storage()._cdata for t in held}
    storages: dict[int, Any] = {}
    tensors: dict[int, set[int]] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages.setdefault(storage._cdata, storage)
            tensors.setdefault(storage._cdata, set()).add(id(leaf))
            del storage
    specs: list = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            specs.append(None)
            continue
        address = leaf.untyped_storage()._cdata
        specs.append(None if address in taken else
                     (storages[address], address, len(tensors[address]) + 1))
    return specs


def warm_up(api: _DeviceApi, target: Callable[..., Any], args: tuple, kwargs: dict, times: int) -> None:
    """`times` calls of `target` on a side stream (lazy initialisation, workspaces, autotuning), waited for."""
    current = api.mod.current_stream()
    side = api.mod.Stream()
    side.wait_stream(current)
    with api.mod.stream(side):
        for _ in range(times):
            target(*args, **kwargs)
    current.wait_stream(side)
    api.mod.synchronize()


def capture(api: _DeviceApi, target: Callable[..., Any], args: tuple, kwargs: dict, pool: Any,
            mode: str) -> tuple[Any, Any]:
    """One call of `target` recorded in a new graph, in `pool`, with capture mode `mode`: (graph,
    its outputs); raises GraphCaptureError when the call cannot be recorded."""
    side = api.mod.Stream()
    side.wait_stream(api.mod.current_stream())
    graph = api.graph()
    failure: BaseException | None = None
    out = None
    # no garbage collection while capturing: one could free another graph, whose reset is not
    # permitted during a capture and spoils it (seen on the H200: "operation not permitted when
    # stream is capturing (function reset)", then the capture failed)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with api.mod.stream(side):
            api.capture_begin(graph, pool, mode)
            try:
                out = target(*args, **kwargs)
            except BaseException as exc:  # the capture must end before anything else runs
                failure = exc
            try:
                graph.capture_end()
            except Exception as exc:
                if failure is None:
                    failure = exc
    finally:
        if collecting:
            gc.enable()
    if failure is not None:
        del graph, out
        if not isinstance(failure, Exception):
            raise failure
        try:
            api.mod.synchronize()
        except RuntimeError:
            pass  # the capture's own error says more
        raise GraphCaptureError(
            f"the module cannot be recorded in a device graph: {type(failure).__name__}: {failure}"
        ) from failure
    api.mod.synchronize()
    return graph, out


# ----------------------------------------------------------------- backend


class DeviceGraphBackend(Backend):
    """Records the module once in a device graph and replays it (see the module docstring)."""

    name = "DeviceGraph"
    config_class = DeviceGraphBackendConfig
    records_graph = True  # under torch.distributed: recorded on every rank together, NCCL only
    checks_inputs = True  # GraphReplay checks its signature and falls back by itself
    # One set of static input and output buffers per recording: two calls at once would
    # overwrite each other's inputs, or a lent output, so the dispatcher serialises them.
    thread_safe = False
    supports_autograd = False  # replayed outputs are detached

    def unavailable(self, device: torch.device) -> str | None:
        return graph_unavailable(device) or self.config.unavailable(device)

    def target(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        """What gets recorded: the module itself here; a compiled module in subclasses."""
        return module

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        api = _DeviceApi(device)
        slots = static_inputs(samples, api.device)
        with torch.no_grad(), api.mod.device(api.index):
            # the axes' conversions and contexts run inside the recording
            target = self.config.build(module, samples, api.device, lambda m, s: self.target(m, s, api.device))
            static_args, static_kwargs, inputs = static_call(*samples[0], slots)
            self._warm_up(api, target, static_args, static_kwargs)
            graph, out = self._capture(api, target, static_args, static_kwargs, api.pool(self.config.share_pool))
            outputs, rebuild = graph_outputs(out)
            exec_handle, replay = self._launch(api, graph)
            keep: list[Any] = [graph, target]  # the target: what the graph's kernels belong to
            lent = None
            if self.config.lend_outputs:
                lent = self._lending(api, target, static_args, static_kwargs, graph, exec_handle, inputs, module)
                if lent is not None:
                    keep.append(lent[0])
                    lent = lent[1]
            signature = _C.Signature(static_args, static_kwargs)
            return _C.GraphReplay(exec_handle, api.index, signature, inputs, outputs, module,
                                  rebuild=rebuild, replay=replay, keep=keep, lent=lent)

    def _lending(self, api: _DeviceApi, target: Callable[..., Any], args: tuple, kwargs: dict, first: Any,
                 exec_handle: int, inputs: list, module: torch.nn.Module) -> tuple[Any, tuple] | None:
        """The second recording, in the first one's memory pool: (graph, GraphReplay's lent),
        or None when it cannot be made (then every output is copied)."""
        pool = getattr(first, "pool", None)
        if pool is None:
            return None  # a graph type that cannot hand its pool to a second capture
        try:
            graph, out = self._capture(api, target, args, kwargs, pool())
        except (GraphCaptureError, RuntimeError):
            return None
        outputs, _ = graph_outputs(out)
        del out
        handle, replay = self._launch(api, graph)
        if (handle == 0) != (exec_handle == 0):
            return None
        held = [buffer for _, _, buffer in inputs]
        held += [t for t in module.parameters()] + [t for t in module.buffers()]
        specs = lend_specs(outputs, held)
        if all(spec is None for spec in specs):
            return None  # nothing to lend: the second recording would only take memory
        return graph, (handle, replay, outputs, specs)

    def _warm_up(self, api: _DeviceApi, target: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        warm_up(api, target, args, kwargs, self.config.warmup)

    def _capture(self, api: _DeviceApi, target: Callable[..., Any], args: tuple, kwargs: dict,
                 pool: Any) -> tuple[Any, Any]:
        return capture(api, target, args, kwargs, pool, self.config.capture_error_mode)

    def _launch(self, api: _DeviceApi, graph: Any) -> tuple[int, Callable[[], None] | None]:
        """(exec handle, None) to launch through the CUDA driver, or (0, graph.replay).

        The driver path needs the raw exec handle (torch >= 2.8 has it), a loadable driver,
        and a graph that draws no random numbers: torch's replay() advances the generator's
        offset before each launch, a raw launch would not."""
        if api.type != "cuda" or not hasattr(graph, "raw_cuda_graph_exec") or _C.GraphReplay.driver_error():
            return 0, graph.replay
        generator = torch.cuda.default_generators[api.index]
        try:
            before = generator.get_offset()
            graph.replay()
            api.mod.synchronize()
            if generator.get_offset() != before:
                return 0, graph.replay
            handle = int(graph.raw_cuda_graph_exec())
        except (RuntimeError, AttributeError):
            return 0, graph.replay
        return (handle, None) if handle else (0, graph.replay)


# ------------------------------------------------------- Inductor in a graph

INDUCTOR_GRAPH_MODES = (None, "default", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class InductorGraphBackendConfig(DeviceGraphBackendConfig):
    """A device graph of the module compiled by torch.compile (Inductor): mode (no
    cudagraphs mode: the graph here is the device graph), options, fullgraph. The
    compiled module is specialised to the recorded shapes (dynamic=False). combo_kernels:
    Inductor's combo_kernels option (independent small kernels fused side by side, fewer
    kernels per replay; default mode only), a field of its own so that a file can hold it."""

    mode: str | None = None
    options: dict[str, Any] | None = None
    fullgraph: bool = False
    combo_kernels: bool = False

    # options reach Inductor's compiler command lines: never taken from a file
    SCHEMA = {**DeviceGraphBackendConfig.SCHEMA, "mode": OneOf(INDUCTOR_GRAPH_MODES), "fullgraph": Flag(),
              "combo_kernels": Flag()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in INDUCTOR_GRAPH_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(str, INDUCTOR_GRAPH_MODES))}; got {self.mode!r} "
                             "(modes with cudagraphs would record a graph inside the graph)")
        if self.mode is not None and self.options:
            raise ValueError("torch.compile takes either mode or options, not both")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {type(self.options).__name__}")
        if not isinstance(self.combo_kernels, bool):
            raise ValueError(f"combo_kernels must be True or False, got {self.combo_kernels!r}")
        if self.combo_kernels and (self.options or {}).get("combo_kernels", True) is not True:
            raise ValueError("combo_kernels=True and options={'combo_kernels': ...} disagree: give one of them")
        if self.combo_kernels and self.mode not in (None, "default"):
            raise ValueError(f"combo_kernels goes with the default mode only (an option of torch.compile, which "
                             f"takes either mode or options), got mode={self.mode!r}")

    def own_label_parts(self) -> list[str]:
        return (["max-autotune"] if self.mode in ("max-autotune", AUTOTUNE_MODE) else []) + (
            ["combo kernels"] if self.combo_kernels else [])

    def takes_variants(self) -> bool:
        return super().takes_variants() and self.mode in (None, "default") and not self.combo_kernels


class InductorGraphBackend(DeviceGraphBackend):
    """torch.compile (Inductor, without its own cudagraphs), recorded in a device graph:
    Inductor's fused kernels without the per-call cost of launching them from Python."""

    name = "InductorGraph"
    config_class = InductorGraphBackendConfig
    compiles_with_inductor = True
    build_scope = staticmethod(shared_compiles)

    def target(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        cfg = self.config
        options = dict(cfg.options or {})
        if cfg.mode is None or cfg.mode == "default":
            options.setdefault("triton.cudagraphs", False)
            if cfg.combo_kernels:
                options["combo_kernels"] = True
            # compiled outside the warm-up and the capture; shared with an Inductor candidate
            return compile_module(module, samples[:1], options=options, dynamic=False, fullgraph=cfg.fullgraph,
                                  variant=tuple(cfg.label_parts()))
        return compile_module(module, samples[:1], mode=cfg.mode, dynamic=False, fullgraph=cfg.fullgraph,
                              variant=tuple(cfg.label_parts()))


register(DeviceGraphBackend, devices=("cuda", "xpu"), defaults={"cuda": 0, "xpu": 0},
         variants=(*SDPA, *LOWER_PRECISION))
register(InductorGraphBackend, devices=("cuda", "xpu"), defaults={"cuda": 2},
         variants=(CHANNELS_LAST, MAX_AUTOTUNE, COMBO_KERNELS, *SDPA, *LOWER_PRECISION))
