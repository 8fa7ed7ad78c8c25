"""What a build must not change: a module's training flags, parameters and buffers; and
where its weights are (weight_places, restore_places: weights a backend moved go back).

snapshot(module) takes, cheaply, what restore() needs to put the module back exactly as it
was: every submodule's training flag; every parameter and buffer object in its owner's
dict with its data, device, dtype, requires_grad and version counter; a copy of every
buffer (buffers are small: running statistics, masks, position ids); and a copy of the
parameters when they fit in PARAM_COPY_LIMIT bytes. Above that limit a parameter written
in place (its version counter moved) cannot be put back, and restore() says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator
import torch
from torch import nn

PARAM_COPY_LIMIT = 256 * 2**20
"""Parameters of a module up to this many bytes are copied by a snapshot, so values a
backend wrote in place (even through ``.data``) are put back; larger ones are watched
through their version counter only."""


@dataclasses.dataclass(eq=False)
class _Tensor:
    owner: nn.Module
    kind: str  # "_parameters" or "_buffers"
    name: str
    tensor: torch.Tensor
    data: torch.Tensor  # the original storage: a backend that moves the tensor leaves it as it was
    requires_grad: bool
    version: int
    copy: torch.Tensor | None


class Snapshot:
    """A module's state as it was; restore() puts it back and says what it changed."""

    def __init__(self, module: nn.Module, param_copy_limit: int = PARAM_COPY_LIMIT) -> None:
        self.flags = [(m, m.training) for m in module.modules()]
        self.paths = {id(m): path or type(m).__name__ for path, m in module.named_modules(remove_duplicate=False)}
        self.names = {(id(m), kind): (m, set(getattr(m, kind))) for m in module.modules()
                      for kind in ("_parameters", "_buffers")}
        params = [p for m in module.modules() for p in m._parameters.values() if p is not None]
        copy_params = sum(p.numel() * p.element_size() for p in params) <= param_copy_limit
        self.tensors: list[_Tensor] = []
        with torch.no_grad():
            for owner in module.modules():
                for kind in ("_parameters", "_buffers"):
                    for name, tensor in getattr(owner, kind).items():
                        if tensor is None:
                            continue
                        keep = kind == "_buffers" or copy_params
                        self.tensors.append(_Tensor(owner, kind, name, tensor, tensor.data, tensor.requires_grad,
                                                    tensor._version, tensor.detach().clone() if keep else None))

    def restore(self) -> list[str]:
        """Puts back whatever changed; returns one line per change (empty: nothing had)."""
        changes: list[str] = []
        for module, training in self.flags:
            if module.training != training:
                module.training = training
                changes.append(f"{self._label(module)}: training flag set back to {training}")
        for (_, kind), (owner, names) in self.names.items():
            for extra in set(getattr(owner, kind)) - names:
                del getattr(owner, kind)[extra]
                changes.append(f"{self._label(owner)}.{extra}: {kind[1:-1]} added by the build removed")
        with torch.no_grad():
            for t in self.tensors:
                changes.extend(_restore_tensor(t, f"{self._label(t.owner)}.{t.name}"))
        return changes

    def _label(self, module: nn.Module) -> str:
        return self.paths.get(id(module), type(module).__name__)


def _restore_tensor(t: _Tensor, where: str) -> list[str]:
    changes = []
    table = getattr(t.owner, t.kind)
    if table.get(t.name) is not t.tensor:
        table[t.name] = t.tensor
        changes.append(f"{where}: replaced; the original object put back")
    current = t.tensor.data
    if current.device != t.data.device or current.dtype != t.data.dtype or current.data_ptr() != t.data.data_ptr():
        t.tensor.data = t.data
        changes.append(f"{where}: moved or cast; its original data put back on {t.data.device}")
    if t.tensor.requires_grad != t.requires_grad:
        t.tensor.requires_grad_(t.requires_grad)
        changes.append(f"{where}: requires_grad set back to {t.requires_grad}")
    if t.copy is not None:
        if not _same(t.data, t.copy):
            t.data.copy_(t.copy)
            changes.append(f"{where}: written in place; its values put back")
    elif t.tensor._version != t.version:
        changes.append(f"{where}: written in place; NOT put back (parameters over "
                       f"{PARAM_COPY_LIMIT >> 20} MiB are not copied)")
    return changes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))) and bool(torch.equal(a.isnan(), b.isnan()))
    return bool(torch.equal(a, b))


def snapshot(module: nn.Module, param_copy_limit: int = PARAM_COPY_LIMIT) -> Snapshot:
    return Snapshot(module, param_copy_limit)


@contextlib.contextmanager
def kept(module: nn.Module) -> Iterator[Snapshot]:
    """The block runs on `module`; its state is put back when the block ends, however it ends."""
    state = snapshot(module)
    try:
        yield state
    finally:
        state.restore()


Place = tuple[nn.Module, str, str, torch.Tensor, torch.Tensor]


def weight_places(module: nn.Module) -> list[Place]:
    """Every parameter and buffer of `module`: (owner, kind, name, tensor, its data).

    Holding the data keeps the original storage: a backend that moves weights (to the
    CPU, say) leaves it untouched, and restore_places puts it back without a copy."""
    places = []
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    places.append((owner, kind, name, tensor, tensor.data))
    return places


def restore_places(places: list[Place]) -> int:
    """Puts back every parameter and buffer a backend moved to another device; returns how many."""
    moved = 0
    for owner, kind, name, tensor, data in places:
        current = getattr(owner, kind).get(name)
        if current is tensor and tensor.device == data.device:
            continue
        if current is not None and current is not tensor and current.device == data.device:
            continue  # replaced on the same device: the backend's own business
        if tensor.device != data.device:
            tensor.data = data  # a parameter moved in place by module.to()
        getattr(owner, kind)[name] = tensor
        moved += 1
    return moved
