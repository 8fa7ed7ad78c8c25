"""Padded: calls whose sizes vary, served from a few buckets, each with its own device graph.

A service's calls vary in batch size (what its batcher formed) and in length (what its
tokenizer padded to). A device graph replays one shape only; a graph per shape seen means a
recording for every new shape. This backend pads a call up to one of a few bucket shapes,
runs that bucket's graph on the padded call, and cuts the outputs back to the call's own
sizes, as serving systems do with their capture sizes.

What is padded, read from the layout of the recorded calls (torch_tweak._core.layout: its
batch-axis rule and its length rule; make_plan):

- the batch: axis 0 of every input tensor, when it has one size per call and that size
  varies among the calls; buckets are powers of two up to 8, then steps of a quarter of the
  power of two below (12, 16, 20, 24, 28, 32, 40, 48...). Padded rows hold rows of earlier calls
  (at first, rows unlike any of the call's: infinities of alternating sign, or for token
  ids and masks the call's rows reversed): a module whose rows are independent gives the
  same answer for the call's rows whatever they hold;
- the length: axis 1 of the inputs shaped like an ``attention_mask`` argument (the mask
  itself, the token ids, the token types...), when it varies; buckets are steps of the
  largest length seen. The padded positions are zeros: a mask of zeros there hides them
  from a module that honours its mask;
- any other size that varies makes the backend refuse the module (nothing is padded that
  is not understood), as does an output axis that follows neither.

Padding is kept only where it is proven harmless: besides the correctness check on the
recorded calls (padded as they come), the build checks, per bucket, a call made from a
recorded one that needs the most padding that bucket can take (its batch one more than the
bucket below, its length one more than the step below), against the original module on
that same unpadded call. A module whose rows are not independent (a statistic over the
batch) or that ignores its mask fails there, and the reason says which.

The range reaches the model's own limits: lengths up to the model's position table (read where
the calls were grouped, as tt.tweak's shapes= is checked against it), in steps of the learned
ones; batches up to what memory holds (decided once at the build: the device's free memory and
max_graph_memory_mb, over the memory a row of the largest recorded bucket took; at most
65536). Where no limit can be read the range is the learned one (batch up to twice the largest
seen, rounded up to a bucket; length up to the largest seen), and describe() says which. The
declared max_batch and max_length (tt.tweak's shapes= sets them: for_shapes) win over both.

Buckets are recorded at build for the recorded calls, and after it in the call that first
needs one (_padded_buckets): that call is answered as a call of no bucket is (the module
compiled for dynamic shapes, or the module itself with compile=False), then the bucket is
recorded and run on that call and checked against the original's answer; it serves the next
calls only once that check passed. Not beside the calls on a thread of its own: a graph being
recorded forbids any device-wide synchronize of the process (a service's own
torch.cuda.synchronize() failed beside it, and spoiled the recording), and a recompile beside
the calls patches torch.nn.Module.__call__ for every thread while it traces. Past max_graphs
buckets or max_graph_memory_mb of their memory, the least used bucket is evicted. A call
outside the range, or one that does not fit the recorded layout, runs the module compiled for
dynamic shapes: never a graph that was not checked.

The graphs of one module each have a memory pool of their own, released when the bucket is
evicted, and the outputs are copied out after each replay, so a later replay never changes what
a caller holds; calls run one at a time (the dispatcher serialises them: static buffers).

The per-call path is C: PaddedCall's base type, _C.PaddedReplay (src/ext/padded.c), decides
whether a call fits the recorded layout (structure, containers, plain values, each tensor's
dtype, device, rank and sizes), serves a call of a ready bucket (finds the bucket whose range
holds the call's sizes, copies the call in, launches the bucket's graph through its
_C.GraphReplay or runs the target on the buffers, cuts the outputs back and copies them out,
counts the call), runs the target on a call that does not fit or falls outside the range, and
hands the rest back to PaddedCall._slow: recording at the build, a new bucket's first sight
after it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .._core import settings
from .. import _C
from .._core._samples import Call, fresh
from .._core.correctness import MismatchError, check
from .._core.layout import CallLayout
from .._core.schema import Count, Flag
from .._core.shapes import Shapes, mask_lengths, position_table, positions
from ._padded_buckets import Bucket, Table, fill_unlike, free_bytes
from .base import Backend, BackendConfig, BackendUnavailable
from .graph import DeviceGraphBackend, _DeviceApi, capture, graph_unavailable, warm_up
from .inductor import compile_module, shared_compiles
from .registry import register

logger = logging.getLogger("torch_tweak")


class PaddingRefused(MismatchError):
    """Padding changed the answer of a call: the module's rows are not independent, or it
    does not honour its mask."""


class NothingToPad(BackendUnavailable):
    """The recorded calls show no size that varies, or one that cannot be padded."""


@dataclasses.dataclass
class PaddedGraphBackendConfig(BackendConfig):
    """max_graphs: buckets held per module, recorded at build and after it; past it the least
    used is evicted. max_graph_memory_mb: the buckets' memory (graphs and their pools; with
    graph=False, their buffers) kept under this, the least used evicted past it; with the
    device's free memory, the bound of the learned batch range.
    max_batch, max_length: the declared upper end of the batch and length ranges (None: the
    model's limits where they can be read, else the learned range: see the module docs).
    length_buckets: how many length buckets the largest length is cut into (steps of 8).
    graph: a device graph per bucket (cuda); False runs the target on the padded call.
    compile: the target is the module compiled by Torch Inductor with dynamic shapes (one
    compile serves every bucket, and calls outside the range); False: the module itself.
    warmup: calls before each recording."""

    max_graphs: int = 32
    max_graph_memory_mb: int = 8192
    max_batch: int | None = None
    max_length: int | None = None
    length_buckets: int = 8
    graph: bool = True
    compile: bool = True
    warmup: int = 2

    SCHEMA = {**BackendConfig.SCHEMA, "max_graphs": Count(1, 256), "max_graph_memory_mb": Count(1, 1 << 20),
              "max_batch": Count(1, 1 << 16, optional=True), "max_length": Count(1, 1 << 20, optional=True),
              "length_buckets": Count(1, 64), "graph": Flag(), "compile": Flag(), "warmup": Count(1, 100)}

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_graphs", "max_graph_memory_mb", "length_buckets", "warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_batch", "max_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        for name in ("graph", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


# ----------------------------------------------------------------- the plan


def batch_bucket(b: int) -> int:
    """The batch bucket of batch b: powers of two up to 8; past it, steps of a quarter of the
    power of two below (9-16 by 4, 17-32 by 4, 33-64 by 8, 65-128 by 16...): there the work is
    arithmetic more than launches, and at most a fifth of a call's rows are padding. The rule is
    the C type's (ext/padded_bucket.c), which finds the bucket of every call it serves."""
    return _C.PaddedReplay._pad_batch_bucket(b)


@dataclasses.dataclass
class Plan:
    """What gets padded: the calls' layout, whether the batch and the length are; per output
    leaf whether axis 0 follows the batch and axis 1 the length, and the outputs' structure;
    the range and the length step, and where each end of the range came from (notes)."""

    layout: CallLayout
    batch: bool
    length: bool
    out_batch: list[bool]
    out_length: list[bool]
    out_spec: Any
    max_batch: int
    max_length: int
    step: int
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def axes(self) -> list[tuple[bool, bool]]:
        """Per tensor slot of the layout: (axis 0 is padded, axis 1 is padded)."""
        return [(self.batch, self.length and s.length) for s in self.layout.slots]

    def lower(self, key: tuple[int, int]) -> tuple[int, int]:
        """The smallest batch and length that fall into bucket `key` (the C type's rule)."""
        return _C.PaddedReplay._pad_lower(key[0], key[1], self.batch, self.length, self.step)


def _outputs(refs: Sequence[Any], layout: CallLayout, pad_batch: bool, pad_length: bool) -> tuple[list, list, Any]:
    """Per output leaf whether axis 0 follows the calls' batch and axis 1 their length, and the
    outputs' structure; NothingToPad when an axis varies and follows neither."""
    outs = [pytree.tree_flatten(r) for r in refs]
    out_batch, out_length = [], []
    for j, leaf in enumerate(outs[0][0]):
        if not isinstance(leaf, torch.Tensor):
            out_batch.append(False)
            out_length.append(False)
            continue
        leaves = [o[0][j] for o in outs]
        by_batch = pad_batch and leaf.dim() >= 1 and all(int(o.shape[0]) == b for o, b in zip(leaves, layout.batches))
        by_length = pad_length and leaf.dim() >= 2 and all(int(o.shape[1]) == n for o, n in zip(leaves, layout.lengths))
        for axis in range(leaf.dim()):
            if len({int(o.shape[axis]) for o in leaves}) > 1 and not (
                    (axis == 0 and by_batch) or (axis == 1 and by_length)):
                raise NothingToPad(f"axis {axis} of output {j} varies and follows neither the batch nor the length")
        out_batch.append(by_batch)
        out_length.append(by_length)
    return out_batch, out_length, outs[0][1]


def make_plan(layout: CallLayout | None, refs: Sequence[Any], config: PaddedGraphBackendConfig) -> Plan:
    """The plan for calls laid out as `layout` (None: they differ in structure) and the
    original's outputs `refs`; raises NothingToPad naming what varies and cannot be padded."""
    if layout is None:
        raise NothingToPad("the recorded calls differ in structure; each structure is its own group")
    if not layout.slots:
        raise NothingToPad("the calls pass no tensor")
    pad_batch = layout.batch and (len(set(layout.batches)) > 1 or config.max_batch is not None)
    pad_length = layout.mask is not None and (len(set(layout.lengths)) > 1 or config.max_length is not None)
    for k, slot in enumerate(layout.slots):
        for axis in slot.varies:
            if not ((axis == 0 and pad_batch) or (axis == 1 and pad_length and slot.length)):
                raise NothingToPad(f"axis {axis} of {slot.name or f'input tensor {k}'} varies and is neither a batch "
                                   "axis shared by every input nor a length along an attention_mask")
    if not pad_batch and not pad_length:
        raise NothingToPad("no size varies among the recorded calls: nothing to pad")
    out_batch, out_length, out_spec = _outputs(refs, layout, pad_batch, pad_length)
    most_b = max(layout.batches) if layout.batches else 1
    most_n = max(layout.lengths) if layout.lengths else 0
    notes = {}
    max_batch = config.max_batch if config.max_batch is not None else batch_bucket(2 * most_b)
    if pad_batch:
        notes["batch"] = "declared" if config.max_batch is not None else "twice the largest batch seen"
    step, max_length = 1, most_n
    if pad_length:
        max_length, step, notes["length"] = _length_range(layout, config, most_n)
    return Plan(layout, pad_batch, pad_length, out_batch, out_length, out_spec, max(max_batch, most_b),
                max(max_length, most_n, 1), step, notes)


def _length_range(layout: CallLayout, config: PaddedGraphBackendConfig, most_n: int) -> tuple[int, int, str]:
    """(max_length, step, where it came from): the declared end (the step its cut), else the
    model's position table in steps of the learned lengths, else the longest length seen."""
    if config.max_length is not None:
        return config.max_length, length_step(max(config.max_length, most_n), config.length_buckets), "declared"
    step = length_step(most_n, config.length_buckets)
    if layout.positions is not None and layout.positions[0] >= most_n:
        return layout.positions[0], step, f"the model's position table ({layout.positions[1]})"
    return most_n, step, "the longest length seen: the model has no position table to read"


def length_step(longest: int, buckets: int) -> int:
    """A length bucket's step: the longest length cut into `buckets`, rounded up to a multiple of 8."""
    per = -(-longest // buckets)
    return max(8, -(-per // 8) * 8)




_launch_of = DeviceGraphBackend._launch
"""How a recorded graph is launched (the CUDA driver's exec handle, or replay()): the device
graph backend's rule, which reads nothing of its backend object."""


# ----------------------------------------------------------------- the proof


class _Checked:
    """The part of PaddedCall that checks padding against the original: each recorded call that
    gets padded and each bucket's most padding at the build (prove), a new bucket on a copy of
    its first call after it (_prove_new). Its state is PaddedCall's."""

    def prove(self, samples: Sequence[Call]) -> None:
        """Checks each recorded call that gets padded, and for each bucket the samples use a
        call made from one of them that needs that bucket's most padding, against the
        original on the same unpadded call; raises PaddingRefused saying what failed."""
        plan = self.plan
        done: set[tuple[int, int]] = set()
        for sample in samples:
            b, n, key, _ = self._pad_fit(sample)
            if key is None:
                continue
            if key != (b, n):
                self._prove_one(sample, b, n, key)
            if key in done:
                continue
            done.add(key)
            low_b, low_n = plan.lower(key)
            cut_b, cut_n = min(b, low_b), (min(n, low_n) if plan.length else n)
            if (cut_b, cut_n) != (b, n):
                self._prove_one(sample, cut_b, cut_n, key)

    def _prove_one(self, sample: Call, cut_b: int, cut_n: int, key: tuple[int, int]) -> None:
        plan = self.plan
        leaves, spec = pytree.tree_flatten(sample)
        for slot, (batch, length) in zip(plan.layout.slots, plan.axes):
            x = leaves[slot.leaf]
            x = x[:cut_b] if batch else x
            leaves[slot.leaf] = (x[:, :cut_n] if length else x).contiguous()
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        rows = cut_b < key[0] and plan.batch
        columns = plan.length and cut_n < key[1]
        where = (f"a call of batch {cut_b}" + (f", length {cut_n}" if plan.length else "")
                 + f" padded to {key[0]}" + (f"x{key[1]}" if plan.length else ""))
        with torch.no_grad():
            reference = self.module(*args, **kwargs)
            try:
                check(self(*args, **kwargs), reference, self.tolerance, where=where, own=self.own)
            except MismatchError as exc:
                what = ("the module's rows are not independent, or it does not honour its attention_mask"
                        if rows and columns else "the module does not honour its attention_mask" if columns
                        else "the module's rows are not independent")
                raise PaddingRefused(f"padding changes the answer ({what}): {exc}", exc.error,
                                     exc.tolerance) from None

    def _prove_new(self, key: tuple[int, int], call: Call, reference: Any) -> None:
        """Bucket `key` recorded and run on its first call, checked against the original's
        answer for that call (`reference`, or None: the module is run for it); it serves from
        now on if they match, else it is refused with the reason (also when recording raised)."""
        try:
            with torch.no_grad():
                if reference is None:
                    reference = self.module(*call[0], **call[1])
                self._make_room(key)
                bucket = self._record(key, call)
                got = self._pad_run(call, False)
            self.checks += 1
            check(got, reference, self.tolerance, where="a new bucket's first call", own=self.own)
            self._make_room(key, bucket.memory)
        except MismatchError as exc:
            self._refuse(key, f"it gave another answer than the original ({exc})")
        except Exception as exc:  # noqa: BLE001 - the call was answered: the bucket alone is refused
            self._refuse(key, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        else:
            self._pad_serve(*key)

    def _refuse(self, key: tuple[int, int], why: str) -> None:
        """Bucket `key` serves nothing (what it held let go), with the reason kept and logged."""
        try:
            self._pad_drop(*key)  # never ready, so never one a call is served from
        finally:
            self.table.refuse(key, why)
        logger.warning("torch-tweak: a new bucket %s is not served (%s); its calls run the module compiled for "
                       "dynamic shapes", key, why)


# ----------------------------------------------------------------- the callable


class PaddedCall(_C.PaddedReplay, _Checked):
    """The built callable. A call of a ready bucket is served by the C base type
    (_C.PaddedReplay: whether it fits, the bucket found from its sizes, the copies in, the
    replay, the cuts and copies out, the counters), as is a call that does not fit or falls
    outside the range (the target); a call that fits whose bucket is not ready comes back
    here, to _slow: recorded at the build, and in its first call after it."""

    def __init__(self, module: torch.nn.Module, target: Callable[..., Any], plan: Plan,
                 config: PaddedGraphBackendConfig, device: torch.device, tolerance: float | None,
                 sample: Call, own: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.module, self.target, self.plan, self.config = module, target, plan, config
        self.tolerance = tolerance
        self.own = own  # the original's own errors (correctness.Reference.own): the measured rule's allowance
        self.api = _DeviceApi(device) if config.graph else None
        self.rebuild = None if plan.out_spec.is_leaf() else plan.out_spec.unflatten
        self.table = Table(config.max_graphs, config.max_graph_memory_mb * 2**20)  # the buckets held
        self.unready = 0   # calls that fit whose bucket was not ready: served by the target
        self.checks = 0    # new buckets checked on their first call after tuning
        self.building = True
        try:
            self._pad_layout(sample, plan.axes, list(zip(plan.out_batch, plan.out_length)), plan.length, target,
                             pytree.tree_leaves, plan.max_batch, plan.max_length, plan.step)
        except ValueError as exc:  # a tensor the C type cannot find in a call: nothing is padded
            raise NothingToPad(str(exc).replace("_pad_layout: ", "")) from None

    # ---- a call that the C path hands back
    def _slow(self, bb: int, bn: int, b: int, n: int, *args: Any, **kwargs: Any) -> Any:
        # one call at a time: the dispatcher serialises a backend that is not thread-safe
        key, call = (bb, bn), (args, kwargs)
        if self.building:  # the recorded calls' buckets, checked by prove() before anything is served
            self._make_room(key)
            self._record(key, call)
            self._pad_serve(bb, bn)
            return self._pad_run(call, True)
        out = self.target(*args, **kwargs)
        self.unready += 1
        if key not in self.table.refused:
            self._prove_new(key, call, out if self.target is self.module else None)
        return out

    # ---- buckets held
    def _record(self, key: tuple[int, int], call: Call) -> Bucket:
        """A new bucket for `key`, its buffers filled from the call, recorded (not yet serving)."""
        b, _, _, tensors = self._pad_fit(call)
        bucket = Bucket(key)
        for (batch, length), x in zip(self.plan.axes, tensors):
            shape = list(x.shape)
            shape[0] = key[0] if batch else shape[0]
            if length:
                shape[1] = key[1]
            with torch.inference_mode(False):  # a plain tensor, written also by calls outside inference mode
                bucket.buffers.append(torch.zeros(shape, dtype=x.dtype, device=x.device))
        self._pad_bucket(key[0], key[1], bucket.buffers, None, None, self.rebuild)
        self.table.add(bucket)
        args, kwargs = self._pad_filled(call)
        for buffer, (batch, _) in zip(bucket.buffers, self.plan.axes):
            if batch and b < key[0]:
                fill_unlike(buffer, b)
        bucket.memory = sum(t.numel() * t.element_size() for t in bucket.buffers)
        if self.api is not None:
            self._capture(bucket, args, kwargs)
        return bucket

    def _capture(self, bucket: Bucket, args: tuple, kwargs: dict) -> None:
        """The bucket's graph, recorded in a pool of its own ("thread_local": other threads of
        the service may run their own work meanwhile), and the memory it took."""
        api = self.api
        bucket.pool = api.mod.graph_pool_handle()
        with torch.no_grad(), api.mod.device(api.index):
            warm_up(api, self.target, args, kwargs, self.config.warmup)
            before = api.mod.memory_reserved(api.device)
            graph, out = capture(api, self.target, args, kwargs, bucket.pool, "thread_local")
            bucket.memory += max(0, api.mod.memory_reserved(api.device) - before)
        bucket.graph, bucket.outputs = graph, pytree.tree_leaves(out)
        handle, replay = _launch_of(None, api, graph)  # type: ignore[arg-type]
        bucket.replay = _C.GraphReplay(handle, api.index, _C.Signature(args, kwargs), [], list(bucket.outputs),
                                       self.module, rebuild=self.rebuild, replay=replay, keep=[graph])
        self._pad_bucket(bucket.key[0], bucket.key[1], bucket.buffers, bucket.replay, list(bucket.outputs),
                         self.rebuild)

    def _make_room(self, key: tuple[int, int], memory: int | None = None) -> None:
        """The least used buckets evicted until one more (`key`, of `memory` bytes, else its
        estimate) fits max_graphs and max_graph_memory_mb (Table.make_room)."""
        memory = self.table.estimate(key) if memory is None else memory
        self.table.make_room(key, memory, self._pad_counts(), self._pad_drop, self._retire)

    def _retire(self, bucket: Bucket) -> None:
        """A bucket taken out of the calls' path, before it is let go: on a device, its last
        replay (queued on any stream) is waited for, so its graph and pool are freed idle."""
        if bucket.graph is not None and self.api is not None:
            self.api.mod.synchronize()

    # ---- the range, decided once at the build
    def widen(self, device: torch.device) -> None:
        """The learned batch range reaches what memory holds: the largest batch bucket whose
        memory (a row at the longest length, as the recorded buckets took it per element) fits
        the device's free memory and max_graph_memory_mb, at most SHAPE_LIMITS["batch"]; a declared
        max_batch stays, and where no memory can be read the learned range stays, said in the
        notes."""
        plan, config = self.plan, self.config
        held = self.table.snapshot()[0]
        if not plan.batch or config.max_batch is not None or not held:
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1
        if distributed:  # each rank's free memory is its own: the ranks keep one range, the learned one
            plan.notes["batch"] += " (under torch.distributed, the same on every rank)"
            return
        each = max(b.memory / (b.key[0] * max(b.key[1], 1)) for b in held)
        per_row, free = each * (plan.max_length if plan.length else 1), free_bytes(device)
        if free is None or per_row <= 0:
            plan.notes["batch"] += f" (the {device.type} device's free memory cannot be read)"
            return
        rows = min(settings.SHAPE_LIMITS["batch"], int(min(free, config.max_graph_memory_mb * 2**20) // per_row))
        while rows > plan.max_batch and batch_bucket(rows) > rows:
            rows -= 1
        if rows > plan.max_batch:
            plan.max_batch = rows
            plan.notes["batch"] = (f"what memory holds: {per_row / 2**10:.1f} KiB a row, under max_graph_memory_mb and "
                                   f"the {device.type} device's free memory, at most {settings.SHAPE_LIMITS['batch']}")
            self._pad_range(plan.max_batch, plan.max_length)

    # ---- what status and print(result) show
    def describe(self) -> dict:
        counts = self._pad_counts()
        ready = set(self._pad_ready())
        held, refused = self.table.snapshot()
        valid = sum(c[1] for c in counts.values())
        served = sum(c[2] for c in counts.values())
        plan = self.plan
        d = {"buckets": {f"{b}x{n}" if plan.length else f"{b}": counts.get((b, n), (0, 0, 0))[0]
                         for (b, n) in sorted(ready)},
             "graphs": sum(1 for b in held if b.graph is not None),
             "graph_memory_mb": round(sum(b.memory for b in held) / 2**20, 1),
             "padding_waste": round(1 - valid / served, 3) if served else 0.0,
             "outside_range": self.outside_calls, "unready_calls": self.unready, "refused_buckets": refused,
             "evicted_buckets": self.table.evicted, "checked_buckets": self.checks,
             "batch_range": (1, plan.max_batch) if plan.batch else None,
             "length_range": (1, plan.max_length) if plan.length else None,
             "range_from": dict(plan.notes)}
        buckets = ", ".join(f"{k}: {n}" for k, n in d["buckets"].items())
        ranges = "; ".join(f"{axis} 1-{hi} ({plan.notes[axis]})" for axis, r in (("batch", d["batch_range"]),
                                                                                 ("length", d["length_range"]))
                           if r is not None for hi in (r[1],))
        d["line"] = (f"buckets (calls) {buckets or 'none'}; padding waste {d['padding_waste']:.0%}; {d['graphs']} "
                     f"graphs, {d['graph_memory_mb']:.0f} MiB; {d['outside_range']} calls outside the range"
                     + (f"; {d['unready_calls']} calls answered without their bucket (a new bucket's first call, "
                        "or a refused bucket's calls)"
                        if d["unready_calls"] else "")
                     + (f"; {refused} new buckets refused" if refused else "")
                     + (f"; {d['evicted_buckets']} buckets evicted" if d["evicted_buckets"] else "")
                     + f"; range: {ranges}")
        return d

    def reset_counts(self) -> None:
        """Counts start again from 0 (the calls of tuning itself are not the user's)."""
        super().reset_counts()
        self.unready = 0


# ----------------------------------------------------------------- backend


class PaddedGraphBackend(Backend):
    """Calls of varying sizes padded to a few buckets, a device graph per bucket (see the
    module docstring). For a module's "any other call" group and the groups of calls whose
    sizes vary; a module called with one shape is the device graph's."""

    name = "PaddedGraph"
    records_graph = True  # under torch.distributed: recorded on every rank together, NCCL only
    config_class = PaddedGraphBackendConfig
    needs_varying_sizes = True
    """It serves only calls whose sizes vary (a module called with one shape: NothingToPad)."""
    thread_safe = False       # static buffers per bucket: the dispatcher serialises calls
    supports_autograd = False  # outputs are copies out of the graphs
    build_scope = staticmethod(shared_compiles)

    @property
    def compiles_with_inductor(self) -> bool:  # type: ignore[override]
        return self.config.compile

    def unavailable(self, device: torch.device) -> str | None:
        return graph_unavailable(device) if self.config.graph else None

    def build(self, module: torch.nn.Module, samples: Sequence[Call], device: torch.device) -> Callable[..., Any]:
        if len(samples) < 1:
            raise NothingToPad("no recorded call")
        with torch.no_grad():
            refs = [module(*fresh(s)[0], **fresh(s)[1]) for s in samples]
        try:
            layout = self.layout_for(module, samples)
        except ValueError:
            layout = None
        if layout is not None and layout.positions is None:  # built alone: the module's own table, if it has one
            layout = dataclasses.replace(layout, positions=position_table(module))
        plan = make_plan(layout, refs, self.config)
        target = (compile_module(module, samples, dynamic=None) if self.config.compile else module)
        call = PaddedCall(module, target, plan, self.config, device, self.check_tolerance(), samples[0],
                          self.own_errors)
        for sample in samples:
            call(*sample[0], **sample[1])
        call.prove(samples)
        call.building = False
        call.widen(device)
        return call

    def for_shapes(self, shapes: Shapes) -> "PaddedGraphBackend":
        """A fresh copy whose max_batch and max_length are the declared maxima, where its config
        left them None (a value set on the config wins)."""
        clone_ = self.fresh()
        for field, declared in (("max_batch", shapes.batch), ("max_length", shapes.length)):
            if declared is not None and getattr(clone_.config, field) is None:
                setattr(clone_.config, field, declared[1])
        return clone_

    def load_bound(self, module: torch.nn.Module, samples: Sequence[Call], model: torch.nn.Module) -> str | None:
        """A file's max_length within the model's positions, and its length step (max_length
        / length_buckets) within PADDED_LOAD_GROWTH times the longest stored call: a padded call at
        load or while serving holds at most that many times the positions of the calls the
        module was checked on (a forged max_length of 2^20 in one bucket padded every call to
        a million positions)."""
        from .._core.signatures import forward_params

        cfg = self.config
        table = positions(model)
        if cfg.max_length is not None and table is not None and cfg.max_length > table:
            return (f"max_length={cfg.max_length} is past the model's position table ({table} positions); the bound "
                    "is the model's positions")
        lengths = mask_lengths(samples, forward_params(module))
        if not lengths:
            return None
        longest = max(lengths)
        step = length_step(max(cfg.max_length or 0, longest), cfg.length_buckets)
        if step > settings.PADDED_LOAD_GROWTH * longest:
            return (f"max_length={cfg.max_length} with length_buckets={cfg.length_buckets} pads to steps of {step} "
                    f"positions; the bound is {settings.PADDED_LOAD_GROWTH} x the longest stored call ({longest} "
                    "positions)")
        return None

    def describe(self) -> dict | None:
        """The buckets, their hits, the padding waste, the graphs and their memory; None unbuilt."""
        return self.callable.describe() if isinstance(self.callable, PaddedCall) else None


register(PaddedGraphBackend, devices=("cuda", "xpu"), defaults={"cuda": 3})
