"""A decode loop's prefill: the prompt through the model (Prefills), and on a cache kept
between calls, the prompt shape's prefill recorded as a device graph at its PREFILL_RECORD_AFTER-th
call and replayed after (RecordedPrefill; docs/generate.md says what a user sees of it).

The prefill runs the untuned model's eager forward, as transformers' generate() does, so that
the first logits and the cache are the untuned call's bit for bit; eagerly that is one launch
per kernel (about 20 ms of a 208 ms Llama-1B-shape call on the H200, for a 32-token prompt:
bench/results/generate.md). RecordedPrefill records that forward, with the cache's reset, and
replays it: the same kernels in the same order. It keeps the graph only when one replay gives
the eager prefill's logits and the prompt's part of the cache, bit for bit.

Recording is tracing, to transformers: its mask functions cannot read the cache's length then,
and build an explicit causal mask where the eager forward, having read that the cache is empty,
passes none and lets the attention kernel mask (SDPA's is_causal): other kernels, other bits
(every recording of Phi-3 and Mistral failed its check for it on the H200). So while it records,
the recording thread is not tracing to transformers' mask functions, and the cache gives its
query offset as a Python 0, as the eager forward read it (masks_as_eager).

A replay cannot redo Python: the host-side state of the cache and its layers (a sliding
window's count) is recorded as the recorded run's reset left it and as its forward left it. A
call's cache not in the second is reset on the host first and must then be in the first (else
Stale: that shape runs eagerly from then on); after the replay it is set to the second, as the
eager prefill leaves it. Nor can a graph follow the weights to new tensors: their addresses are
read before every replay, and a recording whose weights moved is dropped (Moved) and made again
at the shape's next calls. On a device without graphs (RECORDS) the same buffers run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..._core import settings
from ..._core.model_state import weights_moved, weights_of
from .call import Greedy
from .inputs import StepInputs
from .model import bounded, logits_of, plain_model, record_graph, replay

logger = logging.getLogger("torch_tweak")

RECORDS = frozenset({"cuda"})
"""The device types whose prefills are recorded as device graphs (elsewhere run eagerly)."""


class Stale(Exception):
    """The cache's host-side state after a reset is not what it was when the prefill was
    recorded: the recorded forward's Python may have decided otherwise from it."""


class Moved(Exception):
    """A weight or buffer of the model is another tensor than at recording (replaced, or the
    model moved): the graph would read the old memory. The recording is dropped; the shape may
    be recorded again."""


class Mismatch(Exception):
    """The recorded prefill's replay did not give the eager run's logits and cache."""


def _holders(cache: Any) -> list:
    return [cache] + list(getattr(cache, "layers", None) or ())


def host_state(cache: Any) -> tuple:
    """The plain values (ints, floats, bools, strings, None) the cache and each of its layers
    keep on the host: what a replay of device work cannot change."""
    return tuple(tuple(sorted((k, v) for k, v in vars(obj).items() if v is None or isinstance(v, (bool, int, float, str))))
                 for obj in _holders(cache))


def set_host_state(cache: Any, state: tuple) -> None:
    """The cache's and its layers' plain values set to `state` (host_state's)."""
    for obj, values in zip(_holders(cache), state):
        vars(obj).update(values)


class _Patch:
    """transformers' mask functions' own is_tracing, while recordings are in progress."""
    own: Any = None
    recordings = 0


_PATCH = _Patch()
_PATCHING = threading.Lock()
_MASKS = threading.local()  # depth: this thread's recordings in progress


def _is_tracing(tensor: Any = None) -> bool:
    if getattr(_MASKS, "depth", 0):  # this thread records a prefill: its forward is eager
        return False
    own = _PATCH.own
    return own(tensor) if own is not None else False


@contextlib.contextmanager
def masks_as_eager(cache: Any) -> Iterator[None]:
    """Around the recording of a prefill that starts from an emptied cache: transformers' mask
    functions decide as in the eager forward (see the module's docs). Other threads are not
    affected: they see the mask functions' own test of tracing. Where transformers has neither
    hook, nothing is changed, and a recording whose masks differ fails its check as before."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    offset = "get_query_offset" in dir(type(cache)) and "get_query_offset" not in vars(cache)  # not set already
    with _PATCHING:  # read under the lock: a recording that ends meanwhile puts transformers' own back
        own = getattr(masking_utils, "is_tracing", None)
        if own is not None and _PATCH.own is None and own is not _is_tracing:
            _PATCH.own = own
            masking_utils.is_tracing = _is_tracing
        if _PATCH.own is not None:
            _PATCH.recordings += 1
    if offset:
        cache.get_query_offset = lambda *args, **kwargs: 0
    _MASKS.depth = getattr(_MASKS, "depth", 0) + 1
    try:
        yield
    finally:
        _MASKS.depth -= 1
        if offset:
            vars(cache).pop("get_query_offset", None)
        with _PATCHING:
            if _PATCH.own is not None:
                _PATCH.recordings -= 1
                if _PATCH.recordings == 0:
                    masking_utils.is_tracing = _PATCH.own
                    _PATCH.own = None


def prompt_part(cache: Any, prompt: int) -> list[torch.Tensor]:
    """Copies of the prompt's positions of every layer's keys and values (batch x heads x
    length x head size): what a prefill writes."""
    out = []
    for layer in getattr(cache, "layers", None) or ():
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                out.append(t[:, :, :prompt].clone())
    return out


class RecordedPrefill:
    """One prompt shape's prefill on one static cache, recorded as a device graph.

    `run` resets the cache and runs the prompt held in `ids` (a buffer the caller made for this
    prefill) through the model, returning the logits; `context` is entered around every run
    (the untuned model). A call copies its prompt into `ids` and replays the graph; the logits
    returned are the graph's own output, overwritten by the next replay."""

    def __init__(self, run: Callable[[], torch.Tensor], ids: torch.Tensor, cache: Any,
                 context: Callable[[], Any], model: torch.nn.Module) -> None:
        self.ids = ids
        self.cache = cache
        self.weights = weights_of(model)  # what the graph reads of the model, by address
        self.replays = 0
        # run holds what the graph reads besides ids and the cache (the position ids, the
        # attention mask): kept as long as the graph, so that their memory is never reused
        self._run = run
        self._context = context
        device = ids.device
        prompt = ids.shape[1]

        def recording() -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            stack.enter_context(context())
            stack.enter_context(masks_as_eager(cache))
            return stack

        self.graph, self.logits = (record_graph(run, device, warmups=2, context=recording)
                                   if device.type in RECORDS else (None, None))
        with context():
            expected = run().clone()
        expected_cache = prompt_part(cache, prompt)
        self.after = host_state(cache)  # as the eager prefill leaves it
        cache.reset()
        self.before = host_state(cache)  # as a reset leaves it
        got = self._replay()
        set_host_state(cache, self.after)
        if got.shape != expected.shape or not torch.equal(got, expected):
            raise Mismatch("its replay's logits are not the eager prefill's")
        for a, b in zip(prompt_part(cache, prompt), expected_cache):
            if not torch.equal(a, b):
                raise Mismatch("its replay's cache is not the eager prefill's")

    def _replay(self) -> torch.Tensor:
        self.replays += 1
        if self.graph is None:
            with self._context():
                return self._run()
        replay(self.graph, self.ids.device)
        assert self.logits is not None
        return self.logits

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits of the prompt `ids` (the recorded shape), the cache filled with it from
        empty and its host-side state set as the eager prefill sets it; Stale where a reset
        does not leave the cache's host-side state as at recording."""
        if weights_moved(self.weights):
            raise Moved("a weight or buffer of the model is another tensor than when the prefill was recorded")
        if host_state(self.cache) != self.after:  # a count on the host (a sliding window's): reset as eagerly
            self.cache.reset()
            if host_state(self.cache) != self.before:
                raise Stale("the cache keeps state on the host that its reset does not set back as at recording")
        self.ids.copy_(ids)
        logits = self._replay()
        set_host_state(self.cache, self.after)
        return logits

    @staticmethod
    def eligible(batch: int, prompt: int, padded: bool) -> bool:
        """Whether a prompt of this shape is recorded: not padded (its mask is the call's), at
        most PREFILL_TOKENS tokens."""
        return not padded and batch * prompt <= settings.PREFILL_TOKENS


class Prefills:
    """A loop's prefills: the prompt through the model, and on a cache kept between calls its
    prefill recorded per prompt shape (RecordedPrefill) and replayed."""

    def __init__(self, model: nn.Module, inputs: StepInputs) -> None:
        self.model = model
        self.inputs = inputs
        self.record = True  # a kept cache's prefill recorded per prompt shape
        self.recorded: dict[tuple, RecordedPrefill] = {}  # the newest last
        self.waiting: dict[tuple, int] = {}  # calls per prompt shape not recorded yet (PREFILL_RECORD_AFTER)
        self.unrecorded: dict[tuple, str] = {}  # a prefill not recorded or not replayed: why

    def run(self, call: Greedy, cache: Any) -> torch.Tensor:
        """The prompt through the model; returns its logits."""
        ids = call.input_ids
        positions = self.inputs.positions(call)
        attention = self.inputs.attention(call, cache, call.mask, positions, ids.shape[1], True)
        return logits_of(self.model(**self.inputs.kwargs("prefill", ids, cache, positions, attention)))

    def first_logits(self, call: Greedy, cache: Any, kept: tuple) -> torch.Tensor:
        """The prompt's logits on a cache kept between calls (`kept`: its key), the cache reset
        first: from the prompt shape's recorded prefill where there is one (made at the
        shape's PREFILL_RECORD_AFTER-th call), else eagerly. A prefill that cannot be recorded or
        replayed is said once and runs eagerly from then on."""
        batch, prompt = call.input_ids.shape
        key = kept + (prompt,)
        recorded = self.recorded.pop(key, None) if self.record else None
        if recorded is None and self.record and key not in self.unrecorded and \
                RecordedPrefill.eligible(batch, prompt, call.mask is not None):
            calls = self.waiting.pop(key, 0) + 1
            if calls < settings.PREFILL_RECORD_AFTER:
                bounded(self.waiting, key, calls)
            else:
                try:
                    recorded = self._recording(call, cache)
                except Exception as exc:  # this shape's prefills run eagerly
                    self._refused(key, batch, prompt, f"{type(exc).__name__}: {exc}")
        if recorded is not None:
            try:
                logits = recorded(call.input_ids)
            except Moved:  # dropped: recorded again at the shape's next calls
                pass
            except Stale as exc:
                self._refused(key, batch, prompt, str(exc))
            else:
                while len(self.recorded) >= settings.PREFILL_GRAPHS:
                    self.recorded.pop(next(iter(self.recorded)))
                self.recorded[key] = recorded  # the newest last
                return logits
        cache.reset()
        return self.run(call, cache)

    def _recording(self, call: Greedy, cache: Any) -> RecordedPrefill:
        """The call's prefill on `cache` recorded: the untuned forward on a buffer of the prompt,
        with the position ids and attention mask of a prompt with no padding (they depend only
        on its shape), the cache reset first."""
        ids = call.input_ids.clone()
        positions = self.inputs.positions(call)
        cache.reset()
        attention = self.inputs.attention(call, cache, None, positions, ids.shape[1], True)
        kwargs = self.inputs.kwargs("prefill", ids, cache, positions, attention)
        model = self.model

        def run() -> torch.Tensor:
            cache.reset()
            return logits_of(model(**kwargs))

        return RecordedPrefill(run, ids, cache, lambda: plain_model(model), model)

    def _refused(self, key: tuple, batch: int, prompt: int, why: str) -> None:
        if not self.unrecorded:
            logger.warning("torch-tweak: the decode loop could not record its prefill for a prompt of %d x %d "
                           "tokens (%s); such prompts run eagerly", batch, prompt, why)
        bounded(self.unrecorded, key, why)

    def figures(self) -> dict:
        """What tt.status says of the prefills: how many shapes replay a device graph, and why
        others run eagerly."""
        return {"recorded_prefills": sum(p.graph is not None for p in self.recorded.values()),
                "unrecorded_prefills": list(self.unrecorded.values())}
