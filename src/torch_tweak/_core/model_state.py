"""What a build must not change: a module's structure, training flags, parameters and
buffers; and where its weights are (weight_places, restore_places: weights a backend moved go
back).

snapshot(module) takes, cheaply, what restore() needs to put the module back exactly as it
was. Its structure, for every module of the subtree: its class; its instance dict (the
object, and which object sits at each of its names: `forward` or any attribute set on the
instance, a parameter or buffer turned into a plain attribute); and the contents, in order,
of every table torch keeps in it (`_parameters`, `_buffers`, `_modules`, the set of
non-persistent buffers, every hook table: forward and pre-forward hooks with their kwargs and
always-call variants, backward hooks, state-dict and load-state-dict hooks). Those are
references and dict copies, never tensor copies. Its values: every submodule's training flag;
every parameter and buffer object with its data, device, dtype, requires_grad and version
counter; a copy of every buffer (buffers are small: running statistics, masks, position ids);
and a copy of the parameters when they fit in PARAM_COPY_LIMIT bytes. Above that limit a
parameter written in place (its version counter moved) cannot be put back, and restore()
says so.

Plain attributes are put back by reference: the object that sat at a name sits there again;
what a build did inside such an object (a list appended to, a config object edited) is not
seen, nor are changes to the module's class itself or to torch's global hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from typing import Iterator
import torch
from torch import nn

from . import settings
from .. import _C



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


_TABLES = tuple(name for name, value in nn.Module().__dict__.items() if isinstance(value, (dict, set)))
"""The tables torch keeps in every module's instance dict (parameters, buffers, submodules,
non-persistent buffer names, hooks), as this torch version makes them."""

_tables_of = operator.itemgetter(*_TABLES)
_TABLE_TYPES = frozenset(type(nn.Module().__dict__[name]) for name in _TABLES)
_NO_TABLE: frozenset = frozenset()  # in place of a table a module lacks: always empty

_KINDS = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "submodule"}
_MISSING = object()


class _Structure:
    """One module's structure as it was: its class, its instance dict and a copy of each of
    torch's tables in it (references only; an empty table is not copied)."""

    __slots__ = ("module", "cls", "attrs", "entries", "tables", "copies", "size")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cls = type(module)
        self.attrs = module.__dict__
        self.entries = dict(self.attrs)
        try:
            self.tables = _tables_of(self.attrs)
            if not set(map(type, self.tables)) <= _TABLE_TYPES:
                raise TypeError
            self.size = sum(map(len, self.tables))
        except (KeyError, TypeError):  # a table missing or not a table: nn.Module.__init__ did not make it
            self.tables = tuple(t if type(t := self.attrs.get(name)) in _TABLE_TYPES else _NO_TABLE
                                for name in _TABLES)
            self.size = sum(map(len, self.tables))
        self.copies = [(i, table.copy()) for i, table in enumerate(self.tables) if table]

    def restore(self) -> list[str]:
        """Puts the module's structure back; one line per change, each to follow the module's
        label ("." and a name, or ":")."""
        changes: list[str] = []
        module = self.module
        if module.__dict__ is not self.attrs:
            object.__setattr__(module, "__dict__", self.attrs)
            changes.append(": its instance dict replaced; the original put back")
        if type(module) is not self.cls:
            changed = type(module).__qualname__
            try:
                object.__setattr__(module, "__class__", self.cls)
                changes.append(f": class changed to {changed}; set back to {self.cls.__qualname__}")
            except TypeError as exc:  # a class of another layout
                changes.append(f": class changed to {changed}; NOT set back ({exc})")
        attrs, entries = self.attrs, self.entries
        if not (len(attrs) == len(entries) and all(map(operator.is_, attrs.values(), entries.values()))
                and all(map(operator.eq, attrs, entries))):
            for key in [k for k in attrs if k not in entries]:
                del attrs[key]
                changes.append(f".{key}: attribute set by the build removed")
            for key, value in entries.items():
                now = attrs.get(key, _MISSING)
                if now is value or key == "training":  # a flag: see Snapshot.restore
                    continue
                attrs[key] = value
                changes.append(f".{key}: attribute " + ("deleted by the build put back" if now is _MISSING
                                                        else "replaced; the original put back"))
        tables = self.tables
        if sum(map(len, tables)) == self.size and all(_same_table(tables[i], saved) for i, saved in self.copies):
            return changes
        copies = dict(self.copies)
        for i, table in enumerate(tables):
            saved = copies.get(i)
            if saved is None:
                if not table:
                    continue
                saved = type(table)()
            elif _same_table(table, saved):
                continue
            changes.extend(_table_changes(_TABLES[i], table, saved))
            table.clear()
            table.update(saved)
        return changes


def _same_table(table: dict | set, saved: dict | set) -> bool:
    if len(table) != len(saved):
        return False
    if isinstance(table, set):
        return table == saved
    return all(map(operator.is_, table.values(), saved.values())) and all(map(operator.eq, table, saved))


def _table_changes(name: str, table: dict | set, saved: dict | set) -> list[str]:
    kind = _KINDS.get(name)
    if kind is None:
        what = "which buffers are persistent" if name == "_non_persistent_buffers_set" else name.strip("_")
        return [f": {what} set back ({len(saved)} entries; the build left {len(table)})"]
    lines = [f".{key}: {kind} " + ("removed by the build put back" if key not in table
                                   else "replaced; the original object put back")
             for key, value in saved.items() if table.get(key, _MISSING) is not value]
    lines += [f".{key}: {kind} added by the build removed" for key in table if key not in saved]
    return lines or [f": order of its {kind}s set back"]


class Snapshot:
    """A module's state as it was; restore() puts it back and says what it changed.

    structure: also the structure of every module of the subtree (see the module's doc), put
    back first. False for a block that changes the structure on purpose (tuning wraps the
    modules it tunes in place): then only flags, parameters and buffers are put back, and a
    parameter or buffer the block added is removed."""

    def __init__(self, module: nn.Module, param_copy_limit: int | None = None, structure: bool = True) -> None:
        modules = list(module.modules())
        self.structure = [_Structure(m) for m in modules] if structure else []
        self.flags = [(m, m.training) for m in modules]
        self.root = module
        self.names = {} if structure else {(id(m), kind): (m, set(getattr(m, kind))) for m in modules
                                           for kind in ("_parameters", "_buffers")}
        params = [p for m in modules for p in m._parameters.values() if p is not None]
        limit = settings.PARAM_COPY_LIMIT if param_copy_limit is None else param_copy_limit
        copy_params = sum(p.numel() * p.element_size() for p in params) <= limit
        self.tensors: list[_Tensor] = []
        with torch.no_grad():
            for owner in modules:
                for kind in ("_parameters", "_buffers"):
                    for name, tensor in getattr(owner, kind).items():
                        if tensor is None:
                            continue
                        keep = kind == "_buffers" or copy_params
                        self.tensors.append(_Tensor(owner, kind, name, tensor, tensor.data, tensor.requires_grad,
                                                    version_of(tensor), tensor.detach().clone() if keep else None))

    def restore(self) -> list[str]:
        """Puts back whatever changed; returns one line per change (empty: nothing had)."""
        changes: list[str] = []
        structure = [(part.module, part.restore()) for part in self.structure]
        changes.extend(self._label(module) + line for module, lines in structure for line in lines)
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

    @functools.cached_property
    def paths(self) -> dict[int, str]:
        """Each module's path, for the lines restore() returns: read once the structure is back."""
        return {id(m): path or type(m).__name__ for path, m in self.root.named_modules(remove_duplicate=False)}

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
        if not same_values(t.data, t.copy):
            t.data.copy_(t.copy)
            changes.append(f"{where}: written in place; its values put back")
    elif t.version is not None and version_of(t.tensor) != t.version:  # an inference tensor keeps none
        changes.append(f"{where}: written in place; NOT put back (parameters over "
                       f"{settings.PARAM_COPY_LIMIT >> 20} MiB are not copied)")
    return changes


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values exactly: same shape and dtype, NaN where the
    other has NaN. The one exact equality of the package (a weight put back, an input written
    into)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # the common case, in one pass and no copy: equal, and so no NaN in either
        return True
    if a.is_floating_point() or a.is_complex():  # unequal, or NaN somewhere: the same where both have NaN?
        return bool(torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))) and bool(torch.equal(a.isnan(), b.isnan()))
    return False


def snapshot(module: nn.Module, param_copy_limit: int | None = None, structure: bool = True) -> Snapshot:
    """What a build must not change in `module` (see Snapshot; param_copy_limit None:
    settings.PARAM_COPY_LIMIT); what tuning takes before a build."""
    return Snapshot(module, param_copy_limit, structure)


@contextlib.contextmanager
def kept(module: nn.Module, structure: bool = False) -> Iterator[Snapshot]:
    """The block runs on `module`; its flags, parameters and buffers are put back when the block
    ends, however it ends. Its structure only when `structure` is True: tt.tweak and tt.tune
    run their whole work in such a block, and wrap modules in place inside it on purpose (each
    build inside it has its own snapshot, structure included)."""
    state = snapshot(module, structure=structure)
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


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def weights_of(model: nn.Module) -> list[tuple]:
    """Where a recorded graph or a converted model reads the model's parameters and buffers:
    per tensor, its module's own table, its dotted path, its name in the table, the tensor,
    its address, its version counter (weight_change compares them), and no sampled bytes
    (span 0, sample None: sampled adds them)."""
    return [(table, f"{prefix}.{name}" if prefix else name, name, t, t.data_ptr(), version_of(t), 0, None)
            for prefix, module in model.named_modules() for table in (module._parameters, module._buffers)
            for name, t in table.items() if t is not None]


def span_of(t: torch.Tensor) -> int:
    """The bytes from t.data_ptr() that a strided CPU tensor's values lie in, where all of them
    are in its storage; 0 for any other tensor (another device, a sparse or quantized layout, a
    subclass's, an empty one): it gets no sampled bytes."""
    try:
        if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.numel() == 0
                or type(t) not in (torch.Tensor, nn.Parameter) or any(s < 0 for s in t.stride())):
            return 0
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (a fake or functional tensor)
        return 0
    return span if 0 < span <= room else 0


def sampled(entry: tuple) -> tuple:
    """A weights_of entry with its tensor's sampled bytes (_C.weight_sample over span_of): a
    write its version counter misses (numpy, a storage's copy_, another tensor over the same
    memory, another process's) is seen where it changes one of those bytes."""
    span = span_of(entry[3])
    return entry[:6] + ((span, _C.weight_sample(entry[3], span)) if span else (0, None))


def weight_change(weights: list[tuple], in_place: bool = False) -> str:
    """What changed since weights_of listed the weights, or "": a tensor replaced in its module
    or given other memory (p.data = ..., model.to(...)); with in_place, also one written in
    place (load_state_dict, p.mul_), which a graph sees and a converted model does not, and,
    for an entry with sampled bytes, one written behind its version counter."""
    found = _C.weight_change(weights, in_place)  # per call of a converted model: read in C
    if found is None:
        return ""
    index, kind = found
    what = ("replaced", "given other memory", "updated in place",
            "written behind its version counter (its sampled bytes differ)")[kind]
    return f"{weights[index][1]} was {what}"


def weights_moved(weights: list[tuple]) -> bool:
    """Whether a weight weights_of listed was replaced or given other memory: what a recorded
    graph, which reads them by address, cannot follow."""
    return bool(weight_change(weights))
