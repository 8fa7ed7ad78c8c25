"""Padded: calls whose sizes vary, served from a few buckets, each with its own device graph.

A service's calls vary in batch size (what its batcher formed) and in length (what its
tokenizer padded to). A device graph replays one shape only; a graph per shape seen means a
recording for every new shape. This backend pads a call up to one of a few bucket shapes,
runs that bucket's graph on the padded call, and cuts the outputs back to the call's own
sizes, as serving systems do with their capture sizes.

What is padded, learned from the recorded calls (``plan``):

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

Buckets are recorded at build for the recorded calls, and on first sight for a new bucket
inside the range (batch up to twice the largest seen, rounded up to a bucket; length up
to the largest seen; or the declared max_batch and max_length, which tt.tweak's shapes= sets:
for_shapes), while there are fewer than
max_graphs and their memory stays under max_graph_memory_mb. The first call of a new bucket
runs the original module too and is answered with the original's result; the bucket serves
later calls only if its answer matched. A call outside the range, or past those caps, runs
the module compiled for dynamic shapes (or the module itself with compile=False), never a
graph that was not checked.

The graphs of one module share one memory pool, and the outputs are copied out of it after
each replay, so a later replay never changes what a caller holds; calls run one at a time
(the dispatcher serialises them: static buffers).

The steady per-call path is C: PaddedCall's base type, _C.PaddedReplay (src/ext/padded.c),
serves a call of a ready bucket (a bucket recorded at build, or one whose first call matched)
when its tensors are plain torch.Tensor arguments of the recorded dtype, device and rank: it
finds the bucket whose range holds the call's sizes, copies the call in, launches the bucket's
graph through its _C.GraphReplay (or runs the target on the buffers, graph=False), cuts the
outputs back and copies them out, and counts the call. Every other call comes back to
PaddedCall._slow here: first sight, recording, the proof's checks, calls outside the range, and
calls that do not fit the recording (another dtype, device or structure: the target runs them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .. import _C
from .._core._samples import Call, fresh
from .._core.correctness import MismatchError, check
from .._core.schema import Count, Flag
from .._core.shapes import Shapes, find_mask, length_inputs, mask_lengths, named_leaves, positions
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
    """max_graphs: buckets recorded per module, at build and on first sight together.
    max_graph_memory_mb: no new bucket is recorded once the graphs' memory passes this.
    max_batch, max_length: the declared upper end of the batch and length ranges (None: the
    learned one: twice the largest batch seen, rounded up to a bucket; the largest length).
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
    """What gets padded: input slots (indices among the call's flattened leaves), whether
    axis 0 is padded for each, whether axis 1 is; the same per output leaf; the ranges."""

    spec: Any
    tensors: list[int]
    batch: bool
    length: bool
    mask: int | None
    seq_inputs: set[int]
    out_batch: list[bool]
    out_length: list[bool]
    max_batch: int
    max_length: int
    step: int
    meta: dict[int, tuple[torch.dtype, torch.device, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    """Per input slot, the recorded dtype, device and shape (the padded axes' sizes vary)."""

    def key(self, b: int, n: int) -> tuple[int, int] | None:
        """The bucket (batch, length) of a call of batch b and length n, or None outside the
        range: the C type's rule (ext/padded_bucket.c), the one its per-call path serves by."""
        return _C.PaddedReplay._pad_key(b, n, self.batch, self.length, self.max_batch, self.max_length, self.step)

    def fits(self, leaves: list, spec: Any) -> bool:
        """Whether a call (its leaves and structure) is one the plan pads: the recorded
        structure, each input tensor of the recorded dtype, device and rank, with the recorded
        sizes but on the padded axes, one batch and one length among them."""
        if spec != self.spec:
            return False
        b = n = None
        for i in self.tensors:
            x = leaves[i]
            dtype, device, shape = self.meta[i]
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.device != device or x.dim() != len(shape):
                return False
            for axis, size in enumerate(x.shape):
                if axis == 0 and self.batch:
                    b = size if b is None else b
                    if size != b:
                        return False
                elif axis == 1 and i in self.seq_inputs:
                    n = size if n is None else n
                    if size != n:
                        return False
                elif size != shape[axis]:
                    return False
        return True

    def lower(self, key: tuple[int, int]) -> tuple[int, int]:
        """The smallest batch and length that fall into bucket `key` (the C type's rule)."""
        return _C.PaddedReplay._pad_lower(key[0], key[1], self.batch, self.length, self.step)


def _sizes(leaves: list, plan_tensors: list[int], mask: int | None) -> tuple[int, int]:
    first = leaves[plan_tensors[0]]
    b = int(first.shape[0]) if first.dim() else 1
    n = int(leaves[mask].shape[1]) if mask is not None else 0
    return b, n


def make_plan(samples: Sequence[Call], refs: Sequence[Any], names: Sequence[str | None],
              config: PaddedGraphBackendConfig) -> Plan:
    """The plan for `samples` (laid out alike) and the original's outputs `refs`; raises
    NothingToPad naming what varies and cannot be padded."""
    flats = [pytree.tree_flatten(s) for s in samples]
    spec = flats[0][1]
    if any(f[1] != spec for f in flats[1:]):
        raise NothingToPad("the recorded calls differ in structure; each structure is its own group")
    calls = [f[0] for f in flats]
    tensors = [i for i, leaf in enumerate(calls[0]) if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise NothingToPad("the calls pass no tensor")
    named = named_leaves(samples[0], names)[2]
    mask = find_mask(calls[0], tensors, named)  # an attention_mask argument, 2-d, of integers or booleans
    batch = all(c[i].dim() >= 1 for c in calls for i in tensors) and all(
        len({int(c[i].shape[0]) for i in tensors}) == 1 for c in calls)
    batch_sizes = {int(c[tensors[0]].shape[0]) for c in calls} if batch else set()
    seq_inputs = length_inputs(calls, tensors, mask)
    lengths = {int(c[mask].shape[1]) for c in calls} if mask is not None else set()
    pad_batch = len(batch_sizes) > 1 or (batch and config.max_batch is not None)
    pad_length = len(lengths) > 1 or (mask is not None and config.max_length is not None)
    for i in tensors:
        for axis in range(calls[0][i].dim()):
            if len({int(c[i].shape[axis]) for c in calls}) > 1 and not (
                    (axis == 0 and pad_batch) or (axis == 1 and pad_length and i in seq_inputs)):
                where = named.get(i, f"input tensor {tensors.index(i)}")
                raise NothingToPad(f"axis {axis} of {where} varies and is neither a batch axis shared by every "
                                   "input nor a length along an attention_mask")
    if not pad_batch and not pad_length:
        raise NothingToPad("no size varies among the recorded calls: nothing to pad")
    outs = [pytree.tree_leaves(r) for r in refs]
    out_batch, out_length = [], []
    for j, leaf in enumerate(outs[0]):
        if not isinstance(leaf, torch.Tensor):
            out_batch.append(False)
            out_length.append(False)
            continue
        sizes = [_sizes(c, tensors, mask) for c in calls]
        by_batch = pad_batch and leaf.dim() >= 1 and all(int(o[j].shape[0]) == s[0] for o, s in zip(outs, sizes))
        by_length = pad_length and leaf.dim() >= 2 and all(int(o[j].shape[1]) == s[1] for o, s in zip(outs, sizes))
        for axis in range(leaf.dim()):
            if len({int(o[j].shape[axis]) for o in outs}) > 1 and not (
                    (axis == 0 and by_batch) or (axis == 1 and by_length)):
                raise NothingToPad(f"axis {axis} of output {j} varies and follows neither the batch nor the length")
        out_batch.append(by_batch)
        out_length.append(by_length)
    most_b = max(batch_sizes) if batch_sizes else 1
    most_n = max(lengths) if lengths else 0
    max_batch = config.max_batch if config.max_batch is not None else batch_bucket(2 * most_b)
    max_length = config.max_length if config.max_length is not None else most_n
    step = length_step(max(max_length, most_n), config.length_buckets) if pad_length else 1
    meta = {i: (calls[0][i].dtype, calls[0][i].device, tuple(calls[0][i].shape)) for i in tensors}
    return Plan(spec, tensors, pad_batch, pad_length, mask if pad_length else None, seq_inputs if pad_length else set(),
                out_batch, out_length, max(max_batch, most_b), max(max_length, most_n), step, meta)


def length_step(longest: int, buckets: int) -> int:
    """A length bucket's step: the longest length cut into `buckets`, rounded up to a multiple of 8."""
    per = -(-longest // buckets)
    return max(8, -(-per // 8) * 8)


LOAD_GROWTH = 16
"""tt.load's bound on a file's padding: a length step (max_length / length_buckets) of at most
this many times the longest stored call's length (load_bound)."""


# ----------------------------------------------------------------- buckets


class _Bucket:
    """The static inputs of one bucket shape, its recording (or None), its outputs; its
    counters (hits, valid and served elements) are kept by the C part of PaddedCall."""

    __slots__ = ("key", "buffers", "graph", "replay", "outputs", "spec", "memory", "ok")

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.buffers: dict[int, torch.Tensor] = {}
        self.graph: Any = None
        self.replay: Any = None    # the graph as a _C.GraphReplay, which the C path launches
        self.outputs: list = []
        self.spec: Any = None
        self.memory = 0
        self.ok = True


def _slots(plan: Plan, sample: Call) -> list[tuple[int | str, bool, bool]] | None:
    """Per input tensor of the plan, (position or keyword name, batch, length): where the C
    path finds it in a call laid out as `sample`; None when a tensor sits inside a container
    argument or is not a plain torch.Tensor (then every call takes the Python path)."""
    args, kwargs = sample
    where: dict[int, int | str] = {}
    position = 0
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if type(value) is torch.Tensor:
            where[position] = key
        position += len(pytree.tree_leaves(value))
    if any(i not in where for i in plan.tensors):
        return None
    return [(where[i], plan.batch, i in plan.seq_inputs) for i in plan.tensors]


_launch_of = DeviceGraphBackend._launch
"""How a recorded graph is launched (the CUDA driver's exec handle, or replay()): the device
graph backend's rule, which reads nothing of its backend object."""


class _Checked:
    """The part of PaddedCall that checks padding against the original: each recorded call that
    gets padded and each bucket's most padding at the build (prove), a new bucket at its first
    call (_first_sight). Its state is PaddedCall's (plan, module, tolerance, own, buckets)."""

    def _first_sight(self, key: tuple[int, int], leaves: list, args: tuple, kwargs: dict) -> Any:
        """A call of a bucket not seen before: answered by the original; the new bucket serves
        later calls only if it answered this one the same."""
        with torch.no_grad():
            reference = self.module(*args, **kwargs)
        try:
            bucket = self._record(key, leaves)
        except Exception as exc:  # a capture that fails: the bucket is not served
            logger.warning("torch-tweak: no graph for a new bucket %s: %s", key, exc)
            bucket = _Bucket(key)
            bucket.ok = False
            self.buckets[key] = bucket
            self.refused += 1
            return reference
        if bucket is None:
            self.outside += 1
            return reference
        b, n = _sizes(leaves, self.plan.tensors, self.plan.mask)
        try:
            check(self._run(bucket, leaves, b, n, hit=False), reference, self.tolerance,
                  where="a new bucket's first call", own=self.own)
        except MismatchError as exc:
            bucket.ok = False
            self.refused += 1
            logger.warning("torch-tweak: a new bucket %s gave another answer than the original (%s); its calls run "
                           "the module compiled for dynamic shapes", key, exc)
            return reference
        self._ready(bucket)
        return reference

    # ---- the proof, at build
    def prove(self, samples: Sequence[Call]) -> None:
        """Checks each recorded call that gets padded, and for each bucket the samples use a
        call made from one of them that needs that bucket's most padding, against the
        original on the same unpadded call; raises PaddingRefused saying what failed."""
        plan = self.plan
        done: set[tuple[int, int]] = set()
        for sample in samples:
            leaves, _ = pytree.tree_flatten(sample)
            b, n = _sizes(leaves, plan.tensors, plan.mask)
            key = plan.key(b, n)
            if key is None:
                continue
            if key != (b, n):
                self._prove_one(leaves, b, n, key)
            if key in done:
                continue
            done.add(key)
            low_b, low_n = plan.lower(key)
            cut_b, cut_n = min(b, low_b), (min(n, low_n) if plan.length else n)
            if (cut_b, cut_n) != (b, n):
                self._prove_one(leaves, cut_b, cut_n, key)

    def _prove_one(self, leaves: list, cut_b: int, cut_n: int, key: tuple[int, int]) -> None:
        plan = self.plan
        cut = list(leaves)
        for i in plan.tensors:
            x = leaves[i]
            if plan.batch:
                x = x[:cut_b]
            if i in plan.seq_inputs:
                x = x[:, :cut_n]
            cut[i] = x.contiguous()
        args, kwargs = pytree.tree_unflatten(cut, plan.spec)
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


class PaddedCall(_C.PaddedReplay, _Checked):
    """The built callable. A call of a ready bucket is served by the C base type
    (_C.PaddedReplay: the bucket found from the call's sizes, the copies in, the replay, the
    cuts and copies out, the counters); any other call comes back here, to _slow: a new
    bucket's first sight, recording, a call outside the range or one that does not fit."""

    def __init__(self, module: torch.nn.Module, target: Callable[..., Any], plan: Plan,
                 config: PaddedGraphBackendConfig, device: torch.device, tolerance: float | None,
                 sample: Call | None = None, own: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.module = module
        self.target = target
        self.plan = plan
        self.config = config
        self.tolerance = tolerance
        self.own = own  # the original's own errors (correctness.Reference.own): the measured rule's allowance
        self.api = _DeviceApi(device) if config.graph else None
        self.pool = self.api.mod.graph_pool_handle() if self.api is not None else None
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.outside = 0    # calls outside the range, or past the caps, or not fitting: the dynamic target
        self.refused = 0    # first-sight buckets whose answer differed from the original's
        self.building = True
        self.slots = _slots(plan, sample) if sample is not None else None
        self._pad_layout(sample if self.slots is not None else None, self.slots or [],
                         list(zip(plan.out_batch, plan.out_length)), plan.length, target, pytree.tree_leaves)

    # ---- what status and print(result) show
    def describe(self) -> dict:
        counts = self._pad_counts()
        valid = sum(c[1] for c in counts.values())
        served = sum(c[2] for c in counts.values())
        d = {"buckets": {f"{b}x{n}" if self.plan.length else f"{b}": counts.get((b, n), (0, 0, 0))[0]
                         for (b, n), bucket in sorted(self.buckets.items()) if bucket.ok},
             "graphs": sum(1 for b in self.buckets.values() if b.graph is not None),
             "graph_memory_mb": round(sum(b.memory for b in self.buckets.values()) / 2**20, 1),
             "padding_waste": round(1 - valid / served, 3) if served else 0.0,
             "outside_range": self.outside, "refused_buckets": self.refused,
             "batch_range": (1, self.plan.max_batch) if self.plan.batch else None,
             "length_range": (1, self.plan.max_length) if self.plan.length else None}
        buckets = ", ".join(f"{k}: {n}" for k, n in d["buckets"].items())
        d["line"] = (f"buckets (calls) {buckets or 'none'}; padding waste {d['padding_waste']:.0%}; {d['graphs']} "
                     f"graphs, {d['graph_memory_mb']:.0f} MiB; {d['outside_range']} calls outside the range"
                     + (f"; {d['refused_buckets']} new buckets refused" if d["refused_buckets"] else ""))
        return d

    def reset_counts(self) -> None:
        """Counts start again from 0 (the calls of tuning itself are not the user's)."""
        super().reset_counts()
        self.outside = 0

    # ---- a call that the C path hands back
    def _slow(self, *args: Any, **kwargs: Any) -> Any:
        # one call at a time: the dispatcher serialises a backend that is not thread-safe
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not self.plan.fits(leaves, spec):  # another structure, dtype, device or size: not padded
            self.outside += 1
            return self.target(*args, **kwargs)
        b, n = _sizes(leaves, self.plan.tensors, self.plan.mask)
        key = self.plan.key(b, n)
        bucket = self.buckets.get(key) if key is not None else None
        if bucket is None and key is not None:
            if not self.building:
                return self._first_sight(key, leaves, args, kwargs)
            bucket = self._record(key, leaves)
        if bucket is None or not bucket.ok:
            self.outside += 1
            return self.target(*args, **kwargs)
        return self._run(bucket, leaves, b, n)

    def _run(self, bucket: _Bucket, leaves: list, b: int, n: int, hit: bool = True) -> Any:
        """The calls Python makes of a bucket (while it is recorded and checked, and those the C
        path cannot lay out): the copies in and the cuts out are the C type's (_pad_copy_in,
        _pad_cut), the one rule the per-call path serves by."""
        plan = self.plan
        bb, bn = bucket.key
        self._pad_copy_in([bucket.buffers[i] for i in plan.tensors], [leaves[i] for i in plan.tensors],
                          [(plan.batch, i in plan.seq_inputs) for i in plan.tensors], b, n, bb, bn)
        if bucket.graph is not None:
            bucket.graph.replay()
            produced = bucket.outputs
        else:
            args, kwargs = pytree.tree_unflatten(self._leaves_of(bucket, leaves), plan.spec)
            produced = pytree.tree_flatten(self.target(*args, **kwargs))[0]
        out = self._pad_cut(produced, list(zip(plan.out_batch, plan.out_length)), b, n, bb, bn)
        self._pad_count(bb, bn, int(hit), b * (n if plan.length else 1), bb * (bn if plan.length else 1))
        return pytree.tree_unflatten(out, bucket.spec)

    def _leaves_of(self, bucket: _Bucket, leaves: list) -> list:
        return [bucket.buffers.get(i, leaf) for i, leaf in enumerate(leaves)]

    def _ready(self, bucket: _Bucket) -> None:
        """The C path serves the bucket's calls from now on (when it can lay them out)."""
        if self.slots is None or (bucket.graph is not None and bucket.replay is None):
            return
        low_b, low_n = self.plan.lower(bucket.key)
        b, n = bucket.key
        self._pad_bucket(b, n, low_b, low_n if self.plan.length else 0,
                         [bucket.buffers[i] for i in self.plan.tensors], bucket.replay,
                         list(bucket.outputs) if bucket.replay is not None else None,
                         None if bucket.spec.is_leaf() else bucket.spec.unflatten)

    def _record(self, key: tuple[int, int], leaves: list) -> _Bucket | None:
        """A new bucket for `key`, its buffers filled from the call, recorded; None past the caps."""
        recorded = [b for b in self.buckets.values() if b.graph is not None]
        if self.config.graph and (len(recorded) >= self.config.max_graphs or
                                  sum(b.memory for b in recorded) >= self.config.max_graph_memory_mb * 2**20):
            return None
        plan = self.plan
        bucket = _Bucket(key)
        bb, bn = key
        for i in plan.tensors:
            x = leaves[i]
            shape = list(x.shape)
            if plan.batch:
                shape[0] = bb
            if i in plan.seq_inputs:
                shape[1] = bn
            with torch.inference_mode(False):  # a plain tensor, written also by calls outside inference mode
                buffer = torch.zeros(shape, dtype=x.dtype, device=x.device)
            b = int(x.shape[0]) if plan.batch else bb
            view = buffer[:b]
            if i in plan.seq_inputs:
                view = view[:, :int(x.shape[1])]
            view.copy_(x)
            if b < bb:
                _fill_unlike(buffer, b)
            bucket.buffers[i] = buffer
        args, kwargs = pytree.tree_unflatten(self._leaves_of(bucket, leaves), plan.spec)
        if self.api is None:
            bucket.spec = pytree.tree_flatten(self.target(*args, **kwargs))[1]
        else:
            self._capture(bucket, args, kwargs)
        self.buckets[key] = bucket
        if self.building:  # checked by prove() before the backend serves anything
            self._ready(bucket)
        return bucket

    def _capture(self, bucket: _Bucket, args: tuple, kwargs: dict) -> None:
        """The bucket's graph, recorded in this module's pool ("thread_local": a first sight
        while other threads run their own work), and the memory it took."""
        api = self.api
        with torch.no_grad(), api.mod.device(api.index):
            warm_up(api, self.target, args, kwargs, self.config.warmup)
            before = api.mod.memory_reserved(api.device)
            graph, out = capture(api, self.target, args, kwargs, self.pool, "thread_local")
            bucket.memory = max(0, api.mod.memory_reserved(api.device) - before)
        bucket.graph = graph
        bucket.outputs, bucket.spec = pytree.tree_flatten(out)
        if self.slots is not None:
            bucket.replay = self._replayer(bucket, args, kwargs)

    def _replayer(self, bucket: _Bucket, args: tuple, kwargs: dict) -> Any:
        """The bucket's graph as a _C.GraphReplay on its buffers (whose launch the C path
        uses), or None when one cannot be made (then the bucket's calls take the Python path)."""
        api = self.api
        try:
            handle, replay = _launch_of(None, api, bucket.graph)  # type: ignore[arg-type]
            inputs = [(key, -1, bucket.buffers[i]) for i, (key, _, _) in zip(self.plan.tensors, self.slots or [])]
            return _C.GraphReplay(handle, api.index, _C.Signature(args, kwargs), inputs, list(bucket.outputs),
                                  self.module, rebuild=bucket.spec.unflatten, replay=replay, keep=[bucket.graph])
        except Exception as exc:  # noqa: BLE001 - the Python path still serves the bucket
            logger.warning("torch-tweak: bucket %s is replayed from Python: %s", bucket.key, exc)
            return None


def _fill_unlike(buffer: torch.Tensor, b: int) -> None:
    """A new bucket's padded rows (b:), filled unlike the call's rows. Served, they hold rows
    of earlier calls (ext/padded.c), anything at all: the proof and a new bucket's first call
    are checked with rows that move any statistic over the batch, so that a module whose
    valid rows depend on them fails there. Copies of a row of the call would not: a max or a
    min over the batch does not see a duplicate. Floating point: infinities of alternating
    sign, beyond every value of any call; other dtypes (token ids, masks: values the module
    takes; a value outside them could fail an index) the call's own rows reversed along their
    last axis, which a statistic over the batch of integer inputs (the largest id) does not
    see: such a module is not caught here."""
    valid, pad = buffer[:b], buffer[b:]
    if buffer.is_floating_point():
        signs = torch.arange(pad.numel(), device=buffer.device).reshape(pad.shape) % 2 * 2 - 1
        pad.copy_(signs * float("inf"))
        return
    source = valid.flip(-1) if valid.dim() >= 2 else valid.flip(0)
    rows = torch.arange(pad.shape[0], device=buffer.device) % b
    pad.copy_(source[rows])


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
        from .._core.signatures import forward_params
        if len(samples) < 1:
            raise NothingToPad("no recorded call")
        with torch.no_grad():
            refs = [module(*fresh(s)[0], **fresh(s)[1]) for s in samples]
        plan = make_plan(samples, refs, forward_params(module), self.config)
        target = (compile_module(module, samples, dynamic=None) if self.config.compile else module)
        call = PaddedCall(module, target, plan, self.config, device, self.check_tolerance(), samples[0],
                          self.own_errors)
        for sample in samples:
            call(*sample[0], **sample[1])
        call.prove(samples)
        call.building = False
        return call

    def for_shapes(self, shapes: Shapes) -> "PaddedGraphBackend":
        """A fresh copy whose max_batch and max_length are the declared maxima, where its config
        left them None (a value set on the config wins)."""
        clone = self.fresh()
        for field, declared in (("max_batch", shapes.batch), ("max_length", shapes.length)):
            if declared is not None and getattr(clone.config, field) is None:
                setattr(clone.config, field, declared[1])
        return clone

    def load_bound(self, module: torch.nn.Module, samples: Sequence[Call], model: torch.nn.Module) -> str | None:
        """A file's max_length within the model's positions, and its length step (max_length
        / length_buckets) within LOAD_GROWTH times the longest stored call: a padded call at
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
        if step > LOAD_GROWTH * longest:
            return (f"max_length={cfg.max_length} with length_buckets={cfg.length_buckets} pads to steps of {step} "
                    f"positions; the bound is {LOAD_GROWTH} x the longest stored call ({longest} positions)")
        return None

    def describe(self) -> dict | None:
        """The buckets, their hits, the padding waste, the graphs and their memory; None unbuilt."""
        return self.callable.describe() if isinstance(self.callable, PaddedCall) else None


register(PaddedGraphBackend, devices=("cuda", "xpu"), defaults={"cuda": 3})
