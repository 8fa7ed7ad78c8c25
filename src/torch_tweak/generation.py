"""tweak's own greedy decode loop, behind a transformers model's ``generate()``.

Most of a generated token's time on a fast device is spent outside the model: transformers'
loop prepares the inputs, runs the logits processors and the stopping criteria (which read
the device every step), and keeps its books on the cache. For the plainest and most common
call, greedy decoding of a decoder-only model with no logits processing, this module runs
the same steps itself:

- the prompt (prefill) goes through the model as the user's code would call it, so a tuned
  model serves it with its tuned backends;
- every decode step feeds the previous token and takes the argmax of the last logits, as
  transformers does, with the cache the user's call would have used (a ``DynamicCache``, or
  a ``StaticCache`` when the call asks for ``cache_implementation="static"``, sized by
  transformers' own rule);
- with a static cache on a device with graphs (CUDA), a whole decode step (forward, argmax,
  the next input and the token's place in the output) is recorded once as a device graph and
  replayed per token by the extension's loop (``_C.replay_steps``: no Python runs per token);
  the stopping rule is read every ``CHECK_EVERY`` steps, and tokens after an end-of-sequence
  are replaced by the pad token exactly as transformers does;
- when transformers itself would compile the decode steps (a static cache on CUDA without
  ``disable_compile=True``), the ``compiled`` loop runs every decode step through the very
  compiled forward transformers uses (``model.get_compiled_call``), so its kernels, and its
  tokens, are those of the untuned call; only transformers' per-token bookkeeping goes.

Any other call (sampling, beams, a logits processor, a streamer, a cache passed in, padding in
the prompt, an encoder-decoder model...) runs transformers' ``generate`` unchanged; the
reason is logged once and counted (``DecodeLoop.fallbacks``). tt.tweak keeps a loop only when
it gave exactly the tokens of the untuned ``generate`` on every recorded call and measured
faster end to end (see docs/generate.md).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import inspect
import logging
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from . import _C
from .module import install as install_wrapper, installed, uninstall as uninstall_wrapper

logger = logging.getLogger("torch_tweak")

LOOPS = ("loop", "graph", "compiled")
"""The decode loops tweak tries: steps run one by one through the model; each step a device
graph replay of the untuned forward (CUDA and a static cache only); each step through
transformers' own compiled forward (calls transformers compiles: the untuned tokens are
then those of its compiled kernels, which no other build reproduces). A step graph of a
separate Inductor build was tried too and dropped: its tokens differed from the untuned
eager model's within a few steps on the benchmarked decoders (bench/results/generate.md)."""

CHECK_EVERY = 16
"""Graph replays between two reads of the stopping rule (each read waits for the device)."""

MAX_CHECK_NEW_TOKENS = 256
"""The most new tokens a stored generate() call of a decode loop's check may ask for (tt.load
refuses a file that asks more; tt.save stores a longer call with this many)."""

MAX_CHECK_TOKENS = 1 << 16
"""The most tokens, batch x (prompt + new tokens), a stored generate() call of a decode loop's
check may decode (tt.load refuses a file that asks more; tt.save leaves such a call out)."""

LOOP_CHECK_SECONDS = 300.0
"""The time a loaded decode loop's check may take in all (the untuned generate() runs and the
loop's own): past it the check stops and generate() stays transformers' own."""

_GENERATE_OPTIONS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                     "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                     "use_model_defaults", "custom_generate", "tokenizer", "assistant_tokenizer")
"""generate()'s own parameters: any of them given (not None) means a call the loop leaves alone."""

_ALLOWED = {
    # key: the values the loop serves (None: any value)
    "max_new_tokens": None, "max_length": None, "eos_token_id": None, "pad_token_id": None,
    "bos_token_id": None, "decoder_start_token_id": None, "transformers_version": None,
    "_from_model_config": None, "_commit_hash": None, "temperature": None, "top_k": None, "top_p": None,
    "max_cache_len": None, "disable_compile": None, "compile_config": None,
    "do_sample": (False,), "num_beams": (1,), "num_return_sequences": (1,), "use_cache": (True,),
    "cache_implementation": (None, "dynamic", "static"), "return_dict_in_generate": (False,),
    "output_attentions": (False,), "output_hidden_states": (False,), "output_scores": (False,),
    "output_logits": (False,),
}
"""Generation settings that leave greedy decoding as plain argmax, with the values that do.
Sampling parameters (temperature, top_k, top_p) are ignored by transformers when do_sample is
False, and so here."""


@dataclasses.dataclass
class Greedy:
    """One generate() call the loop serves."""

    input_ids: torch.Tensor
    max_new: int
    eos: tuple[int, ...]
    pad: int | None
    static: bool
    max_cache_len: int | None
    config: Any = None  # the call's GenerationConfig (what transformers' compile rule reads)


def _config_class(model: nn.Module) -> Any:
    config = getattr(model, "generation_config", None)
    return None if config is None else type(config)


def greedy_call(model: nn.Module, args: tuple, kwargs: dict) -> Greedy | str:
    """The call as plain greedy decoding, or why the loop leaves it to transformers."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model"
    config_class = _config_class(model)
    if config_class is None:
        return "the model has no generation_config"
    kwargs = dict(kwargs)
    if len(args) > 1:
        return "positional arguments after the inputs"
    ids = args[0] if args else kwargs.pop("inputs", None)
    if ids is None:
        ids = kwargs.pop("input_ids", None)
    elif "input_ids" in kwargs:
        return "the inputs given twice"
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        return "inputs that are not a 2-D tensor of token ids"
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return "an empty prompt"
    for name in _GENERATE_OPTIONS:
        if kwargs.pop(name, None) is not None:
            return f"generate's {name}"
    given = kwargs.pop("generation_config", None)
    config = copy.deepcopy(given if given is not None else model.generation_config)
    mask = kwargs.pop("attention_mask", None)
    try:
        unused = config.update(**kwargs)
    except Exception as exc:  # transformers refuses the settings: its generate says why
        return f"settings transformers refuses ({type(exc).__name__})"
    if unused:
        return "model arguments " + ", ".join(sorted(unused))
    try:
        config.validate()
    except Exception:
        return "settings transformers refuses"
    for key, value in config.to_diff_dict().items():
        if key not in _ALLOWED:
            return f"the generation setting {key}={value!r}"
        allowed = _ALLOWED[key]
        if allowed is not None and value not in allowed:
            return f"the generation setting {key}={value!r}"
    if config.do_sample or (config.num_beams or 1) != 1 or config.use_cache is False:
        return "sampling, beams or no cache"
    prompt = ids.shape[1]
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt
    if not isinstance(max_new, int) or max_new < 1:
        return "no new token to generate"
    eos = config.eos_token_id
    eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # what transformers does, with a warning of its own
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape) or not bool(mask.all()):
            return "an attention mask with padding"
    elif config.pad_token_id is not None and config.pad_token_id not in eos and bool((ids == config.pad_token_id).any()):
        return "the pad token in the prompt (transformers masks it)"
    static = config.cache_implementation == "static"
    return Greedy(ids, int(max_new), eos, pad, static, config.max_cache_len, config)


def call_kind(call: Greedy) -> tuple[int, bool]:
    """What a decode loop's speed depends on beyond the model: the batch size and the cache
    (static or dynamic). A loop serves only the kinds it was measured on."""
    return int(call.input_ids.shape[0]), bool(call.static)


def new_cache(model: nn.Module, static: bool, length: int) -> Any:
    """A new cache as generate() makes one: a StaticCache of `length` positions, or a
    DynamicCache (a static cache allocates its tensors on first use)."""
    dynamic_class, static_class = _cache_classes(model)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return static_class(config=config, max_cache_len=length) if static else dynamic_class(config=config)


def probe_cache(model: nn.Module, call: Greedy) -> Any:
    """A cache of the kind the call uses, for transformers_compiles to look at."""
    return new_cache(model, call.static, call.input_ids.shape[1] + call.max_new)


def transformers_compiles(model: nn.Module, call: Greedy, cache: Any) -> bool:
    """Whether transformers' generate() would run this call's decode steps through its
    compiled forward (its own rule, asked of the model: a compileable cache, a device it
    compiles on, no disable_compile...)."""
    if not call.static or call.config is None:
        return False
    rule = getattr(model, "_valid_auto_compile_criteria", None)
    if rule is None or not callable(getattr(model, "get_compiled_call", None)):
        return False
    try:
        return bool(rule({"cache": cache, "past_key_values": cache}, call.config))
    except Exception:  # a transformers whose rule reads other arguments: not a call the loop compiles
        return False


def _cache_arg(model: nn.Module) -> str | None:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def _cache_classes(model: nn.Module) -> tuple[Any, Any]:
    """transformers' DynamicCache and StaticCache, from the module the model's class lives in."""
    import transformers  # only reached for a transformers model, which has imported it

    return transformers.DynamicCache, transformers.StaticCache


class _Plain:
    """Inside the block the model is as it was before any tuning: its tuned modules are taken
    out and put back after, in the mode they were in. What a device graph records must not
    itself replay graphs, and Inductor must see plain modules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.wrappers = list(installed(model).values())
        self.active: list[bool] = []

    def __enter__(self) -> None:
        self.active = [w.tt_active for w in self.wrappers]
        for w in reversed(self.wrappers):
            uninstall_wrapper(self.model, w)

    def __exit__(self, *exc: Any) -> None:
        for w, active in zip(self.wrappers, self.active):
            install_wrapper(self.model, w)
            if active:
                w.tt_activate()


_PLAIN_STEP = (("input_ids", ("tensor", "torch.int64", 2)), ("cache", ("cache",)), ("use_cache", ("value", True)),
               ("return_dict", ("value", True)))
DEFAULT_LAYOUTS = {
    "dynamic": {"prefill": _PLAIN_STEP, "decode": _PLAIN_STEP},
    "static": {"prefill": _PLAIN_STEP,
               "decode": _PLAIN_STEP[:2] + (("attention_mask", ("tensor", "torch.bool", 4)),) + _PLAIN_STEP[2:]},
}
"""The arguments the loop passes the model when it knows no better, per cache: what
transformers passes a decoder for one sequence. tt.tweak gives the loop the layout the
workload's own generate() calls used (Workload.layouts), so that the calls fit the
signatures tuned on them."""


def describe_argument(value: Any) -> tuple:
    """One argument of a forward call as a layout holds it (plain JSON)."""
    from ._samples import kv_cache_class

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.dim())
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    if kv_cache_class(value) is not None:
        return ("cache",)
    return ("other", type(value).__name__)


class LayoutError(Exception):
    """A forward call the loop cannot lay out as the workload's generate() did."""


def lay_out(layout: tuple, cache_arg: str, ids: torch.Tensor, cache: Any, start: Any, total: int | None,
            mask: Callable[[], torch.Tensor] | None) -> dict:
    """The keyword arguments of one forward call as `layout` says. start: the position of
    ids' first token (an int, or a 0-d tensor inside a device graph); total: the length of the
    sequence so far (a 2-D attention mask's width); mask: makes the 4-D boolean mask."""
    batch, width = ids.shape
    kwargs: dict[str, Any] = {}
    for key, spec in layout:
        kind = spec[0]
        if key in ("input_ids",) and kind == "tensor":
            kwargs[key] = ids
        elif key == cache_arg and kind == "cache":
            kwargs[key] = cache
        elif key == "position_ids" and kind == "tensor" and spec[2] == 2:
            kwargs[key] = (torch.arange(width, device=ids.device) + start).view(1, width).expand(batch, width)
        elif key == "attention_mask" and kind == "tensor" and spec[2] == 2 and total is not None:
            kwargs[key] = torch.ones(batch, total, dtype=getattr(torch, spec[1].split(".")[-1]), device=ids.device)
        elif key == "attention_mask" and kind == "tensor" and spec[2] == 4 and spec[1] == "torch.bool" \
                and mask is not None:
            kwargs[key] = mask()
        elif kind == "value":
            kwargs[key] = spec[1]
        else:
            raise LayoutError(f"the argument {key} ({'/'.join(map(str, spec))})")
    return kwargs


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out["logits"]
    return logits


class _StepGraph:
    """One decode step recorded as a device graph, for one static cache (batch, length)."""

    def __init__(self, loop: "DecodeLoop", cache: Any, batch: int, length: int, device: torch.device,
                 prompt: Greedy) -> None:
        self.cache = cache
        self.length = length
        self.token = torch.zeros(batch, 1, dtype=prompt.input_ids.dtype, device=device)
        self.tokens = torch.zeros(batch, length + 1, dtype=prompt.input_ids.dtype, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(length, device=device)
        forward = loop.model
        shape = (batch, 1, 1, length)

        def mask() -> torch.Tensor:
            return (self.arange <= self.position).view(1, 1, 1, length).expand(shape)

        def step() -> None:
            kwargs = lay_out(loop.layouts["decode"], loop.cache_arg, self.token, cache, self.position, None, mask)
            out = forward(**kwargs)
            nxt = _logits(out)[:, -1, :].argmax(-1)
            self.token.copy_(nxt.view(batch, 1))
            self.tokens.index_copy_(1, self.step, nxt.view(batch, 1))
            self.step.add_(1)
            self.position.add_(1)

        # the warm-up runs write a step into the cache: the caller resets it afterwards. They
        # run on the stream the step is then recorded on, so that what a library makes per
        # stream on first use (cuBLAS's workspace) exists before the recording starts
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), _Plain(loop.model):
            for _ in range(3):
                step()
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream), _Plain(loop.model):
            step()
        torch.cuda.current_stream(device).wait_stream(stream)

    def run(self, first: torch.Tensor, prompt_len: int, max_new: int, finished: Callable[[int], bool]) -> torch.Tensor:
        """Tokens 1..max_new-1 after `first`; returns the tokens buffer's first `max_new` columns
        (or fewer when `finished` says every sequence ended)."""
        self.token.copy_(first.view(-1, 1))
        self.tokens[:, 0].copy_(first)
        self.step.fill_(1)
        self.position.fill_(prompt_len)
        done = _C.replay_steps(self.graph.replay, 1, max_new, CHECK_EVERY, finished)
        return self.tokens[:, :done]


class DecodeLoop:
    """tweak's greedy decode loop, installed as the model's ``generate`` (an attribute of the
    instance: ``tt.unwrap`` removes it). ``kind`` is one of LOOPS."""

    def __init__(self, model: nn.Module, kind: str, layouts: dict | None = None) -> None:
        if kind not in LOOPS:
            raise ValueError(f"kind must be one of {', '.join(LOOPS)}, not {kind!r}")
        self.model = model
        self.kind = kind
        self.given = layouts
        self.layouts = layouts if layouts is not None else DEFAULT_LAYOUTS["dynamic"]
        self.cache_arg = next((k for k, spec in self.layouts["decode"] if spec[0] == "cache"), None)
        if self.cache_arg is None or layouts is None:
            self.cache_arg = _cache_arg(model)
        self.original = type(model).generate.__get__(model)
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.calls = 0
        self._checks: list[tuple[tuple, dict, torch.Tensor]] = []
        self.kinds: frozenset | None = None  # the call kinds served (call_kind); None: every kind
        self._graphs: dict[tuple, _StepGraph] = {}
        self._caches: dict[tuple, Any] = {}  # the compiled loop's static caches, per shape
        self._lock = threading.Lock()
        self._previous_len: int = -1
        self.eager = False  # set by uncompiled(): the compiled loop's steps run the plain forward
        self.deadline: float | None = None  # a time.monotonic() value: set while apply_loop checks it

    def _in_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError(f"its check took longer than {LOOP_CHECK_SECONDS:g} s (LOOP_CHECK_SECONDS)")

    _tt_decode_loop = True  # what tt.unwrap looks for

    @property
    def checks(self) -> list[tuple[tuple, dict, torch.Tensor]]:
        """The generate() calls the loop was measured and checked on, (args, kwargs, untuned
        tokens): what tt.save keeps. Once set, the loop serves only calls of their kinds
        (call_kind): a kind no measurement showed faster runs transformers' generate()."""
        return self._checks

    @checks.setter
    def checks(self, checks: list[tuple[tuple, dict, torch.Tensor]]) -> None:
        self._checks = list(checks)
        kinds = set()
        for args, kwargs, _ in self._checks:
            call = greedy_call(self.model, args, kwargs)
            if not isinstance(call, str):
                kinds.add(call_kind(call))
        self.kinds = frozenset(kinds) if self._checks else None

    def __reduce__(self) -> Any:
        raise TypeError("a model with torch-tweak's decode loop cannot be pickled: save it with tt.save(model, "
                        "path), or call tt.unwrap(model) first")

    def __repr__(self) -> str:
        return f"<torch-tweak decode loop ({self.kind}) of {type(self.model).__name__}.generate>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = greedy_call(self.model, args, kwargs)
        why = call if isinstance(call, str) else self.unmeasured(call) or self.layout_problem(call)
        if why is not None:
            if why not in self.fallbacks:
                logger.warning("torch-tweak: generate() ran transformers' own loop for %s; further such calls "
                               "are counted in the model's decode loop (.fallbacks)", why)
            self.fallbacks[why] += 1
            return self.original(*args, **kwargs)
        # one call at a time: the step graphs, the compiled loop's caches and the cache-length
        # rule are shared by every call of the model
        with self._lock, torch.no_grad():
            self.calls += 1
            return self.decode(call)

    def unmeasured(self, call: Greedy) -> str | None:
        """Why the loop leaves a call of a kind tweak did not measure to transformers (it might
        be slower there: the loop is kept for the kinds it was measured faster on), or None."""
        if self.kinds is None or call_kind(call) in self.kinds:
            return None
        batch, static = call_kind(call)
        measured = ", ".join(f"batch {b} with a {'static' if s else 'dynamic'} cache" for b, s in sorted(self.kinds))
        return (f"a call tweak did not measure (batch {batch} with a {'static' if static else 'dynamic'} cache; "
                f"measured: {measured}): tune with a workload that makes such calls")

    def layout_problem(self, call: Greedy) -> str | None:
        """Why the loop cannot make this call's forward calls as its layouts say, or None."""
        if self.cache_arg is None:
            return "the model's forward takes no cache"
        if self.given is None:
            self.layouts = DEFAULT_LAYOUTS["static" if call.static else "dynamic"]
            if self.cache_arg != "cache":
                self.layouts = {phase: tuple((self.cache_arg if k == "cache" else k, spec) for k, spec in layout)
                                for phase, layout in self.layouts.items()}
        ids = call.input_ids[:, :1]
        for phase in ("prefill", "decode"):
            mask = (lambda: ids) if phase == "decode" and call.static else None
            try:
                lay_out(self.layouts[phase], self.cache_arg, ids, None, 0, 1, mask)
            except LayoutError as exc:
                return f"{exc} of the {phase} calls"
        return None


    # -------------------------------------------------------------- decoding
    def _static_length(self, call: Greedy) -> int:
        # transformers' rule: prompt + new tokens - 1, never shorter than an earlier call's,
        # at least generation_config.max_cache_len
        length = call.input_ids.shape[1] + call.max_new - 1
        if call.max_cache_len is not None:
            length = max(length, call.max_cache_len)
        length = max(length, self._previous_len)
        self._previous_len = length
        return length

    def decode(self, call: Greedy) -> torch.Tensor:
        ids = call.input_ids
        batch, prompt = ids.shape
        device = ids.device
        eos = torch.tensor(call.eos, dtype=ids.dtype, device=device) if call.eos else None
        length = self._static_length(call) if call.static else 0
        graphs = self.kind == "graph" and call.static and device.type == "cuda"
        if graphs:
            key = (batch, length, device, ids.dtype)
            entry = self._graphs.get(key)
            if entry is None:
                cache = new_cache(self.model, call.static, length)
                self._prefill(ids, cache)  # lays the cache out before the step is recorded
                entry = _StepGraph(self, cache, batch, length, device, call)
                self._graphs[key] = entry
            cache = entry.cache
            cache.reset()
        elif self.kind == "compiled" and call.static:
            # one cache per shape, reset between calls: its tensors keep their addresses, so the
            # compiled forward's device graphs replay instead of recording again
            key = (batch, length, device, ids.dtype)
            cache = self._caches.get(key)
            if cache is None:
                cache = self._caches[key] = new_cache(self.model, True, length)
            else:
                cache.reset()
        else:
            cache = new_cache(self.model, call.static, length)
        compiled = self.kind == "compiled" and not self.eager and transformers_compiles(self.model, call, cache)
        first = self._prefill(ids, cache)
        if graphs:
            def finished(n: int) -> bool:
                self._in_time()
                return eos is not None and bool(_finished(entry.tokens[:, :n], eos).all())

            tokens = entry.run(first, prompt, call.max_new, finished)
        elif compiled:
            tokens = self._compiled_steps(first, cache, call, prompt, eos, length)
        else:
            tokens = self._steps(first, cache, call, prompt, eos, length)
        return torch.cat([ids, _stop(tokens, eos, call.pad)], dim=1)

    def _prefill(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(**lay_out(self.layouts["prefill"], self.cache_arg, ids, cache, 0, ids.shape[1], None))
        return _logits(out)[:, -1, :].argmax(-1)

    def _steps(self, first: torch.Tensor, cache: Any, call: Greedy, prompt: int,
               eos: torch.Tensor | None, length: int) -> torch.Tensor:
        tokens = [first]
        nxt = first
        batch = first.shape[0]
        arange = torch.arange(length, device=first.device) if call.static else None
        unfinished = torch.ones(batch, dtype=torch.bool, device=first.device)
        for step in range(1, call.max_new):
            self._in_time()
            if eos is not None:
                unfinished &= ~torch.isin(nxt, eos)
                if not bool(unfinished.any()):
                    break
                nxt = torch.where(unfinished, nxt, torch.full_like(nxt, call.pad))
            position = prompt + step - 1

            def mask() -> torch.Tensor:
                return (arange <= position).view(1, 1, 1, -1).expand(batch, 1, 1, arange.numel())

            kwargs = lay_out(self.layouts["decode"], self.cache_arg, nxt.view(batch, 1), cache, position,
                             position + 1, mask if arange is not None else None)
            out = self.model(**kwargs)
            nxt = _logits(out)[:, -1, :].argmax(-1)
            tokens.append(nxt)
        return torch.stack(tokens, dim=1)

    def _compiled_steps(self, first: torch.Tensor, cache: Any, call: Greedy, prompt: int,
                        eos: torch.Tensor | None, length: int) -> torch.Tensor:
        """The decode steps through transformers' compiled forward, the one its generate()
        would call (compiled once per model and compile config, and kept on the model). The
        arguments are laid out as transformers lays them out, contiguous as its are, so that
        the compiled forward's guards hold and nothing compiles again. The stopping rule is
        read every CHECK_EVERY steps; tokens past an end-of-sequence are padded after."""
        forward = self.model.get_compiled_call(getattr(call.config, "compile_config", None))
        batch = first.shape[0]
        arange = torch.arange(length, device=first.device)
        tokens = torch.empty(batch, call.max_new, dtype=first.dtype, device=first.device)
        tokens[:, 0] = first
        nxt = first
        done = 1
        while done < call.max_new:
            self._in_time()
            if eos is not None and done % CHECK_EVERY == 0 and bool(_finished(tokens[:, :done], eos).all()):
                break
            position = prompt + done - 1

            def mask() -> torch.Tensor:
                return (arange <= position).view(1, 1, 1, length).expand(batch, 1, 1, length)

            kwargs = lay_out(self.layouts["decode"], self.cache_arg, nxt.view(batch, 1), cache, position,
                             position + 1, mask)
            out = forward(**{k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
            nxt = _logits(out)[:, -1, :].argmax(-1)  # read before the next call reuses the output's memory
            tokens[:, done] = nxt
            done += 1
        return tokens[:, :done]


def _finished(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Per sequence: whether an end-of-sequence token is among `tokens`."""
    return torch.isin(tokens, eos).any(dim=1)


def _stop(tokens: torch.Tensor, eos: torch.Tensor | None, pad: int | None) -> torch.Tensor:
    """transformers' stopping rule on tokens decoded past it: after a sequence's first
    end-of-sequence token, pad; the output ends at the step where the last sequence ended."""
    if eos is None or tokens.shape[1] == 0:
        return tokens
    hit = torch.isin(tokens, eos)
    ended = hit.cumsum(dim=1) > 0
    after = ended.clone()
    after[:, 1:] = ended[:, :-1]
    after[:, 0] = False
    tokens = torch.where(after, torch.full_like(tokens, pad if pad is not None else 0), tokens)
    if bool(ended[:, -1].all()):
        last = int(hit.float().argmax(dim=1).max())  # the step at which the last sequence ended
        tokens = tokens[:, :last + 1]
    return tokens


@dataclasses.dataclass
class LoopPlan:
    """A decode loop as a Plan keeps it: its kind, the layouts of its forward calls (None: the
    defaults) and the generate() calls it is checked on before it is installed again (tt.load,
    the tuning cache), each with the untuned tokens it gave where it was tuned. The check
    compares the loop with the untuned generate() run here, never with those stored tokens
    (a file's word); each call is bounded (MAX_CHECK_NEW_TOKENS, MAX_CHECK_TOKENS)."""

    kind: str
    layouts: dict | None
    checks: list[tuple[tuple, dict, torch.Tensor]]


def plan_loop(model: nn.Module) -> LoopPlan | None:
    """The loop installed on `model` as a Plan keeps it, its check calls bounded: a call asking
    more than MAX_CHECK_NEW_TOKENS new tokens is kept with that many (greedy tokens are a
    prefix of a longer call's), one decoding more than MAX_CHECK_TOKENS is left out."""
    loop = loop_of(model)
    if loop is None:
        return None
    checks = []
    for args, kwargs, tokens in loop.checks:
        call = greedy_call(model, args, kwargs)
        if not isinstance(call, str) and call.max_new > MAX_CHECK_NEW_TOKENS:
            kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
            kwargs["max_new_tokens"] = MAX_CHECK_NEW_TOKENS
            tokens = tokens[:, :call.input_ids.shape[1] + MAX_CHECK_NEW_TOKENS]
        if check_bounds(model, args, kwargs) is None:
            checks.append((args, kwargs, tokens))
    return LoopPlan(loop.kind, loop.given, checks)


def check_bounds(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why a stored generate() call cannot check a decode loop on `model`: not plain greedy
    decoding the loop serves, or asking more than MAX_CHECK_NEW_TOKENS new tokens or
    MAX_CHECK_TOKENS tokens in all; None when it can."""
    call = greedy_call(model, args, kwargs)
    if isinstance(call, str):
        return f"a stored generate() call is not one the loop serves ({call})"
    batch, prompt = call.input_ids.shape
    if call.max_new > MAX_CHECK_NEW_TOKENS:
        return (f"a stored generate() call asks for {call.max_new} new tokens, and a check may ask at most "
                f"{MAX_CHECK_NEW_TOKENS}")
    if batch * (prompt + call.max_new) > MAX_CHECK_TOKENS:
        return (f"a stored generate() call decodes {batch} x ({prompt} + {call.max_new}) tokens, and a check may "
                f"decode at most {MAX_CHECK_TOKENS}")
    return None


def prompt_length(args: tuple, kwargs: dict) -> int | None:
    """The prompt length of a generate() call (its inputs' second axis), or None."""
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def token_difference(i: int, got: Any, expected: torch.Tensor, prompt: int | None) -> str | None:
    """How generate call i's output differs from the tokens it must give (the first
    differing token, counted from the first new one), or None when they are the same."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return (f"generate call {i}: {tuple(expected.shape)} tokens expected, got "
                f"{tuple(getattr(got, 'shape', ()))}")
    differ = (got != expected).nonzero()
    if not differ.numel():
        return None
    row, col = (int(v) for v in differ[0])
    return (f"generate call {i}: token {col - (prompt or 0)} of sequence {row} is {int(got[row, col])}, "
            f"untuned {int(expected[row, col])}")


def apply_loop(model: nn.Module, plan: LoopPlan, seconds: float | None = None) -> str | None:
    """Installs the plan's loop when, on every stored call, it gives the tokens of the untuned
    generate() run here (transformers' own loop on the model with its tuned modules taken
    out, the loop not installed); else leaves generate() as it was and returns why. The
    tokens the plan stores are not trusted: a forged loop stores its own. Each call is bounded
    (check_bounds), and the whole check by `seconds` (default LOOP_CHECK_SECONDS)."""
    if not plan.checks:
        return "no stored generate() call to check it on"
    for args, kwargs, _ in plan.checks:
        problem = check_bounds(model, args, kwargs)
        if problem is not None:
            return problem
    limit = LOOP_CHECK_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + limit
    late = f"its check took longer than {limit:g} s (LOOP_CHECK_SECONDS)"
    untuned = []
    uninstall(model)
    try:
        with torch.no_grad(), _Plain(model):
            for args, kwargs, _ in plan.checks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return late
                untuned.append(model.generate(*args, **{**kwargs, "max_time": left}))
        if time.monotonic() > deadline:  # transformers' max_time stopped a run short
            return late
    except Exception as exc:
        return f"the untuned generate() failed on a stored call: {type(exc).__name__}: {str(exc)[:200]}"
    loop = DecodeLoop(model, plan.kind, plan.layouts)
    loop.checks = [(args, kwargs, tokens) for (args, kwargs, _), tokens in zip(plan.checks, untuned)]
    loop.deadline = deadline
    install(model, loop)
    problem = None
    try:
        with torch.no_grad():
            for i, (args, kwargs, tokens) in enumerate(loop.checks):
                got = model.generate(*args, **kwargs)
                if loop.fallbacks:
                    problem = f"generate call {i} is not one it serves ({next(iter(loop.fallbacks))})"
                else:
                    problem = token_difference(i, got, tokens, prompt_length(args, kwargs))
                if problem is not None:
                    break
    except Exception as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        loop.deadline = None
        if problem is not None or loop_of(model) is not loop:
            uninstall(model)  # whatever happened (an interrupt too), generate() is as it was
    loop.calls = 0
    loop.fallbacks.clear()
    return problem


def check_layouts(layouts: Any) -> dict | None:
    """Layouts read from a file, as plain tuples, or ValueError: only names, kinds and plain
    values, bounded."""
    if layouts is None:
        return None
    if type(layouts) is not dict or set(layouts) != {"prefill", "decode"}:
        raise ValueError("layouts name the prefill and decode calls")
    out = {}
    for phase, layout in layouts.items():
        if type(layout) is not list or len(layout) > 32:
            raise ValueError("a layout is a list of at most 32 arguments")
        items = []
        for item in layout:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not str or len(item[0]) > 64 \
                    or type(item[1]) is not list or not item[1] or len(item[1]) > 3:
                raise ValueError("an argument is [name, [kind, ...]]")
            spec = item[1]
            if spec[0] not in ("tensor", "value", "cache", "positional", "other") or \
                    not all(v is None or type(v) in (bool, int, float, str) for v in spec) or \
                    any(type(v) is str and len(v) > 64 for v in spec):
                raise ValueError("an argument's kind is a short plain value")
            items.append((item[0], tuple(spec)))
        out[phase] = tuple(items)
    return out


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Any:
    """Inside the block, the model's compiled loop (if any) runs its decode steps through the
    plain forward: for hooks that must not be traced into transformers' compiled forward."""
    loop = loop_of(model)
    if loop is None:
        yield
        return
    loop.eager = True
    try:
        yield
    finally:
        loop.eager = False


def arm(model: nn.Module) -> None:
    """Inference starts: the model's decode loop (if any) counts its calls and fallbacks from 0
    (tuning's own generate() calls are not counted)."""
    loop = loop_of(model)
    if loop is not None:
        loop.calls = 0
        loop.fallbacks.clear()


def loop_of(model: nn.Module) -> DecodeLoop | None:
    """The decode loop installed on `model`, or None."""
    loop = model.__dict__.get("generate")
    return loop if isinstance(loop, DecodeLoop) else None


def install(model: nn.Module, loop: DecodeLoop) -> None:
    object.__setattr__(model, "generate", loop)


def uninstall(model: nn.Module) -> None:
    if loop_of(model) is not None:
        del model.__dict__["generate"]


def can_generate(model: nn.Module) -> bool:
    """Whether `model` is a transformers model with a generate() the loop may stand behind."""
    generate = getattr(type(model), "generate", None)
    return callable(generate) and _config_class(model) is not None and _cache_arg(model) is not None
