"""A candidate's variant settings beyond its backend (memory layout, attention kernel, TF32,
autocast): the config fields every config that carries them has, their schema and checks, the
label they give a candidate, their tolerance, where they cannot run, and the build wrapper that
runs a backend's callable under them. torch_tweak.backends.axes decides which variants a tweak tries."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from .._core import settings
from .._core._samples import Call
from .._core.correctness import tolerance_for
from .._core.schema import DType, Flag, OneOf
from .base import BackendConfig, copy_module

LAYOUTS = (None, "channels_last")
SDPA_KERNELS = (None, "flash", "efficient", "cudnn", "math")
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"

AXIS_SCHEMA = {"memory_format": OneOf(LAYOUTS), "sdpa_kernel": OneOf(SDPA_KERNELS), "tf32": Flag(),
               "autocast_dtype": DType(AUTOCAST_DTYPES)}
"""What a saved file may hold of each axis field: every value the fields accept."""

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}




def _sdpa_backend(kernel: str) -> Any:
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return None
    return getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                                "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[kernel], None)


@contextlib.contextmanager
def entered(config: Any, device: torch.device) -> Iterator[None]:
    """The contexts the axes of `config` run under (the SDPA kernel, TF32, autocast)."""
    with contextlib.ExitStack() as stack:
        if getattr(config, "sdpa_kernel", None):
            from torch.nn.attention import sdpa_kernel
            stack.enter_context(sdpa_kernel([_sdpa_backend(config.sdpa_kernel)]))
        if getattr(config, "tf32", False):
            stack.enter_context(_tf32())
        if getattr(config, "autocast_dtype", None) is not None:
            stack.enter_context(torch.autocast(device.type, dtype=config.autocast_dtype))
        yield


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    """TF32 for matmuls and cuDNN convolutions, put back as it was afterwards (process-wide
    flags: another thread's matmul at that moment would also run in TF32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _to_layout(value: Any) -> Any:
    return (value.contiguous(memory_format=torch.channels_last)
            if isinstance(value, torch.Tensor) and value.dim() == 4 else value)


def _contiguous(value: Any) -> Any:
    return value.contiguous() if isinstance(value, torch.Tensor) and value.dim() == 4 else value


@dataclasses.dataclass
class VariantConfig(BackendConfig):
    """The config of a backend that offers variants (torch_tweak.backends.axes): the variant fields, their
    schema and check, the label they give a candidate, their tolerance, where they cannot run,
    whether they lower precision, and the build wrapper that runs the backend's own callable
    under them. The fields are keyword-only, after a subclass's own.

    memory_format   None, or "channels_last": the module runs on a channels-last copy of
                    itself, its 4-D tensor inputs are made channels-last and its 4-D
                    outputs contiguous again (modules with a Conv2d only)
    sdpa_kernel     None, or "flash", "efficient", "cudnn", "math": the module runs under
                    torch.nn.attention.sdpa_kernel with that kernel only (CUDA)
    tf32            True: float32 matmuls and convolutions in TF32 (CUDA; lower precision)
    autocast_dtype  None, or torch.bfloat16 / torch.float16: under torch.autocast, floating
                    outputs cast back to the dtypes the module gives without it (lower
                    precision)
    """

    memory_format: str | None = dataclasses.field(default=None, kw_only=True)
    sdpa_kernel: str | None = dataclasses.field(default=None, kw_only=True)
    tf32: bool = dataclasses.field(default=False, kw_only=True)
    autocast_dtype: torch.dtype | None = dataclasses.field(default=None, kw_only=True)

    SCHEMA = {**BackendConfig.SCHEMA, **AXIS_SCHEMA}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_format not in LAYOUTS:
            raise ValueError(f"memory_format must be None or 'channels_last'; got {self.memory_format!r}")
        if self.sdpa_kernel not in SDPA_KERNELS:
            raise ValueError(f"sdpa_kernel must be one of {', '.join(map(str, SDPA_KERNELS))}; "
                             f"got {self.sdpa_kernel!r}")
        if not isinstance(self.tf32, bool):
            raise ValueError(f"tf32 must be True or False, got {self.tf32!r}")
        dtype = self.autocast_dtype
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in AUTOCAST_DTYPES):
            raise ValueError(f"autocast_dtype must be a torch.dtype, torch.bfloat16 or torch.float16 (or None); "
                             f"got {dtype!r}")

    def has_variants(self) -> bool:
        """Whether any variant field is set."""
        return any(getattr(self, name) not in (None, False) for name in AXIS_SCHEMA)

    def takes_variants(self) -> bool:
        """Whether torch_tweak.backends.axes may add variants to this config: it is the backend as it
        is (no variant field set, not lowering precision; a subclass adds its own settings)."""
        return not self.has_variants() and not self.lowers_precision()

    def own_label_parts(self) -> list[str]:
        """What a subclass's own settings add to the label ("max-autotune", "combo kernels"),
        shown after the layout and SDPA kernel and before the precision."""
        return []

    def label_parts(self) -> list[str]:
        """What a candidate's name shows of its variant: "channels_last", "sdpa=flash",
        "max-autotune", "tf32", "bf16 autocast"."""
        parts = []
        if self.memory_format:
            parts.append(self.memory_format)
        if self.sdpa_kernel:
            parts.append(f"sdpa={self.sdpa_kernel}")
        parts += self.own_label_parts()
        if self.tf32:
            parts.append("tf32")
        if self.autocast_dtype is not None:
            parts.append(f"{_SHORT[self.autocast_dtype]} autocast")
        return parts

    def lowers_precision(self) -> bool:
        """TF32 or autocast (see BackendConfig.lowers_precision)."""
        return bool(self.tf32) or self.autocast_dtype is not None

    def check_tolerance(self) -> float | None:
        """The config's tolerance; when it sets none, the autocast dtype's, or TF32's."""
        if self.tolerance is not None or not self.lowers_precision():
            return self.tolerance
        if self.autocast_dtype is not None:
            return tolerance_for(self.autocast_dtype)
        if self.tf32:
            return settings.TF32_TOLERANCE
        return None

    def unavailable(self, device: torch.device) -> str | None:
        """Why the variant cannot run on `device`, or None."""
        if self.sdpa_kernel and device.type != "cuda":
            return f"the SDPA kernel choice runs on CUDA only, not on {device.type}"
        if self.sdpa_kernel and _sdpa_backend(self.sdpa_kernel) is None:
            return f"this torch ({torch.__version__}) has no SDPA kernel {self.sdpa_kernel!r}"
        if self.tf32 and device.type != "cuda":
            return f"TF32 runs on CUDA only, not on {device.type}"
        return None

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device,
              make: Callable[[torch.nn.Module, Sequence[Call]], Callable[..., Any]]) -> Callable[..., Any]:
        """The callable of a backend with this variant: `make(module, samples)` builds the
        backend's own callable (compiles, warms up) on the module as the variant changes it and on
        samples as the variant lays them out, under the variant's contexts; the result runs every call
        under those contexts. Without a variant, `make(module, samples)` as it is.

        A build does not change `module`: channels-last runs on a copy."""
        config = self
        if not self.has_variants():
            return make(module, samples)
        layout = config.memory_format == "channels_last"
        if layout:
            if not any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
                raise ValueError("channels_last: the module has no Conv2d")
            module = copy_module(module).to(memory_format=torch.channels_last)
            samples = [pytree.tree_map(_to_layout, s) for s in samples]
        plain = None
        if config.autocast_dtype is not None:
            args, kwargs = samples[0]
            with torch.no_grad():
                plain = [t.dtype if isinstance(t, torch.Tensor) else None
                         for t in pytree.tree_leaves(module(*args, **kwargs))]
        with entered(config, device):
            inner = make(module, samples)

        def run(*args: Any, **kwargs: Any) -> Any:
            if layout:
                args, kwargs = pytree.tree_map(_to_layout, (args, kwargs))
            with entered(config, device):
                out = inner(*args, **kwargs)
            if plain is None and not layout:
                return out
            leaves, spec = pytree.tree_flatten(out)
            if plain is not None and len(leaves) == len(plain):
                leaves = [t.to(want) if isinstance(t, torch.Tensor) and want is not None and t.dtype != want
                          and t.is_floating_point() else t for t, want in zip(leaves, plain)]
            if layout:
                leaves = [_contiguous(t) for t in leaves]
            return pytree.tree_unflatten(leaves, spec)

        run.inner = inner  # type: ignore[attr-defined]
        return run


@dataclasses.dataclass(frozen=True)
class Variant:
    """A variant a backend offers (declared in its registration, torch_tweak.backends.registry):
    tried when tt.tweak is asked for it, on the modules its rule picks (torch_tweak.backends.axes).

    asked: "high" (effort="high") or a precision policy ("tf32", "bf16", "int8", "fp8"; the
    policy's tolerance becomes the variant's). rule: the modules it applies to ("conv",
    "heavy", "sdpa", "fp32", "linear"; torch_tweak.backends.axes.Axes.applies). fields: the config
    fields it sets. order: its place among the variants of one `asked` (backends in their own
    order within one place). devices: the device types it is offered on (empty: all).
    alone: a candidate of its own, the registered class built with `fields`, instead of a
    copy of each of the strategy's backends of that class with `fields` replaced.
    refusal: for an alone variant, why a device can never run it (tt.tweak refuses the
    policy before anything changes)."""

    asked: str
    rule: str
    fields: tuple[tuple[str, Any], ...] = ()
    order: int = 0
    devices: tuple[str, ...] = ()
    alone: bool = False
    refusal: Callable[[torch.device], str | None] | None = None


CHANNELS_LAST = Variant("high", "conv", (("memory_format", "channels_last"),), order=0)
MAX_AUTOTUNE = Variant("high", "heavy", (("mode", AUTOTUNE_MODE), ("options", None)), order=1)
COMBO_KERNELS = Variant("high", "heavy", (("combo_kernels", True),), order=2, devices=("cuda",))
SDPA = tuple(Variant("high", "sdpa", (("sdpa_kernel", kernel),), order=3 + i, devices=("cuda",))
             for i, kernel in enumerate(SDPA_KERNELS[1:]))
LOWER_PRECISION = (Variant("tf32", "fp32", (("tf32", True),)),
                   Variant("bf16", "fp32", (("autocast_dtype", torch.bfloat16),)))
"""The variants a VariantConfig's backend may offer: effort="high"'s channels-last,
max-autotune, combo kernels (fewer kernels per replay: what the small-batch rows pay for,
bench/results/knobs.md) and SDPA kernels; precision's TF32 and bfloat16 autocast."""
