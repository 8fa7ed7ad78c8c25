"""tweak's own decode loop, behind a transformers model's ``generate()``.

Most of a generated token's time on a fast device is spent outside the model: transformers'
loop prepares the inputs, runs the logits processors and the stopping criteria (which read
the device every step), and keeps its books on the cache. For the calls people make of a
decoder-only model (greedy or sampling, the common logits processors, several end-of-sequence
ids, left-padded batches; docs/generate.md has the table), this module runs the same steps
itself:

- the prompt (prefill) goes through the model as the user's code would call it, so a tuned
  model serves it with its tuned backends; on a static cache the loop keeps between calls (a
  CUDA device), a prompt shape's prefill is recorded as a device graph of the untuned forward
  at its second call and replayed after (prefill.RecordedPrefill: the same kernels, checked
  bit for bit at recording);
- every decode step feeds the previous token and chooses the next as transformers does:
  transformers' own logits processors for the call (SERVED_PROCESSORS) on the sequence so
  far (a sampling call with temperature, top-k and top-p on CUDA: the same processed scores
  from the top scores alone, sampling.TopSampler), then the argmax, or a draw of
  ``torch.multinomial``, with the cache the user's call
  would have used (a ``DynamicCache``, or a ``StaticCache`` when the call asks for
  ``cache_implementation="static"``, sized by transformers' own rule), the position ids and
  the attention masks (one per layer type where the model has several) made as transformers
  makes them;
- with a static cache on a device with graphs (CUDA), a greedy decode step with no
  processing (forward, argmax, the next input and the token's place in the output) is
  recorded once as a device graph and replayed per token by the extension's loop
  (``_C.replay_steps``: no Python runs per token); the stopping rule is read every
  ``CHECK_EVERY`` steps, and tokens after an end-of-sequence are replaced by the pad token
  exactly as transformers does;
- when transformers itself would compile the decode steps (a static cache on CUDA without
  ``disable_compile=True``), the ``compiled`` loop runs every decode step through the very
  compiled forward transformers uses (``model.get_compiled_call``), so its kernels, and its
  tokens, are those of the untuned call; only transformers' per-token bookkeeping goes.

Any other call (beams, a processor it does not know, a streamer, stopping criteria, a cache
passed in, an encoder-decoder model...) runs transformers' ``generate`` unchanged; the reason
is logged once and counted (``DecodeLoop.fallbacks``). tt.tweak keeps a loop only when it gave
exactly the tokens of the untuned ``generate`` on every recorded call (a sampling call under
the same seed: same_draws) and measured faster end to end (see docs/generate.md).
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
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import _C
from . import prefill, sampling
from .module import install as install_wrapper, installed, uninstall as uninstall_wrapper

logger = logging.getLogger("torch_tweak")

LOOPS = ("loop", "graph", "compiled", "tuned")
"""The decode loops tweak tries: steps run one by one through the model; each step a device
graph replay of the untuned forward (CUDA and a static cache only); each step through
transformers' own compiled forward (calls transformers compiles: the untuned tokens are
then those of its compiled kernels); each step through transformers' forward compiled again
with transformers' settings plus Inductor's coordinate descent tuning (tuned_settings: on
CUDA a one-row matrix product, each linear layer of a batch-1 step, becomes a reduction
kernel tuned for the memory's bandwidth instead of a cuBLAS product; other kernels, so its
tokens are checked against the untuned call's like any candidate's). Two step graphs of
Inductor kernels were tried and dropped: a separate build of an eager call (its tokens
differed from the untuned eager model's within a few steps), and transformers' compiled
forward built again without Inductor's own graphs and recorded with the argmax (the
compiled tokens, but no faster than the compiled loop: its kernels alone take 1.50 ms a
token on the Llama-1B shape, bench/results/decode-anatomy.md)."""

COMPILED_LOOPS = frozenset({"compiled", "tuned"})
"""The loops whose decode steps run a compiled forward: only for calls transformers compiles
(transformers_compiles), and the model's modules are then left untuned."""

GRAPH_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                              "MinPLogitsWarper"})
"""The processors a recorded step runs: those that read only the scores (never the sequence so
far, whose length grows, nor its length), so the same recorded work serves every step."""

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
    # key: the values the loop serves (None: any value transformers accepts)
    "max_new_tokens": None, "max_length": None, "eos_token_id": None, "pad_token_id": None,
    "bos_token_id": None, "decoder_start_token_id": None, "transformers_version": None,
    "_from_model_config": None, "_commit_hash": None, "temperature": None, "top_k": None, "top_p": None,
    "min_p": None, "max_cache_len": None, "disable_compile": None, "compile_config": None,
    "repetition_penalty": None, "no_repeat_ngram_size": None, "bad_words_ids": None, "sequence_bias": None,
    "min_new_tokens": None, "min_length": None, "num_return_sequences": None,
    "do_sample": (False, True), "num_beams": (1,), "use_cache": (True,),
    "cache_implementation": (None, "dynamic", "static"), "return_dict_in_generate": (False,),
    "output_attentions": (False,), "output_hidden_states": (False,), "output_scores": (False,),
    "output_logits": (False,),
}
"""Generation settings the loop serves, with the values it serves. Sampling parameters
(temperature, top_k, top_p, min_p) are ignored by transformers when do_sample is False, and so
here. The logits processors the settings ask for are transformers' own (built by its
``_get_logits_processor``), and the loop serves a call only when each is one of SERVED_PROCESSORS."""

SERVED_PROCESSORS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"})
"""transformers' logits processors the loop runs inside its decode step, unchanged: each is
device tensor work whose only host-side decisions read shapes, never values, so running it
needs no read of the device per token (the loop keeps the sequence so far as transformers
does, so their results are transformers' own, bit for bit)."""

SAMPLING_SEED = 0
"""The seed of the random generators while a sampling generate() call is checked (the untuned
call and the loop's, each in a fork of the generators' state: the caller's state is kept)."""


@dataclasses.dataclass
class Greedy:
    """One generate() call the loop serves (greedy or sampling, despite the name)."""

    input_ids: torch.Tensor  # expanded by num_return_sequences, as transformers expands it
    max_new: int
    eos: tuple[int, ...]
    pad: int | None
    static: bool
    max_cache_len: int | None
    config: Any = None  # the call's GenerationConfig (what transformers' compile rule reads)
    sample: bool = False  # do_sample: the next token drawn by torch.multinomial, as transformers draws it
    processors: Any = None  # transformers' LogitsProcessorList for the call; None when it is empty
    mask: torch.Tensor | None = None  # the 2-D attention mask transformers passes on (None: no padding)


def _config_class(model: nn.Module) -> Any:
    config = getattr(model, "generation_config", None)
    return None if config is None else type(config)


def greedy_call(model: nn.Module, args: tuple, kwargs: dict) -> Greedy | str:
    """The call as the loop serves it (greedy or sampling, with the logits processors
    SERVED_PROCESSORS names, read as transformers reads it), or why the loop leaves it to
    transformers."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if _config_class(model) is None:
        return "the model has no generation_config"
    read = _inputs(args, dict(kwargs))
    if isinstance(read, str):
        return read
    ids, kwargs = read
    given = kwargs.pop("generation_config", None)
    mask = kwargs.pop("attention_mask", None)
    # transformers' rule, read before its defaults fill the settings: no max_length anywhere
    # means 20 new tokens (capped by the model's positions), not 20 in all
    default_length = kwargs.get("max_length") is None and getattr(given, "max_length", None) is None \
        and getattr(model.generation_config, "max_length", None) is None
    config = _settings(model, given, kwargs)
    if isinstance(config, str):
        return config
    prompt = ids.shape[1]
    max_new = _new_tokens(model, config, prompt, default_length)
    if not isinstance(max_new, int) or max_new < 1:
        return "no new token to generate"
    eos = config.eos_token_id
    eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # what transformers does, with a warning of its own
    # the attention mask as transformers' generate() makes it: the one given, or one inferred
    # from pad tokens in the prompt; none at all when it has no zero
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape) or mask.device != ids.device:
            return "an attention mask that is not a tensor of the inputs' shape and device"
    elif pad is not None and pad not in eos and bool((ids == pad).any()):
        mask = ids.ne(pad).long()
    if mask is not None and bool((mask == 1).all()):
        mask = None
    copies = config.num_return_sequences or 1
    if copies > 1:
        ids = ids.repeat_interleave(copies, dim=0)
        mask = None if mask is None else mask.repeat_interleave(copies, dim=0)
    config.max_length = prompt + int(max_new)
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + prompt  # transformers' _prepare_generated_length
    processors = _processors(model, config, ids, mask)
    if isinstance(processors, str):
        return processors
    static = config.cache_implementation == "static"
    return Greedy(ids, int(max_new), eos, pad, static, config.max_cache_len, config, bool(config.do_sample),
                  processors, mask)


def _inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict] | str:
    """(the prompt's token ids, the other keywords) of a generate() call, or why the loop
    does not take it."""
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
    return ids, kwargs


def _settings(model: nn.Module, given: Any, kwargs: dict) -> Any:
    """The call's generation config as transformers reads it (the model's settings, its global
    defaults, the call's), or why the loop leaves the call to transformers."""
    prepare = getattr(model, "_prepare_generation_config", None)
    try:
        if callable(prepare):  # transformers' own: the model's settings, then its global defaults, then the call's
            config, unused = prepare(given, **kwargs)
        else:
            config = copy.deepcopy(given if given is not None else model.generation_config)
            unused = config.update(**kwargs)
    except Exception as exc:  # transformers refuses the settings: its generate says why
        return f"settings transformers refuses ({type(exc).__name__})"
    if unused:
        return "model arguments " + ", ".join(sorted(unused))
    try:
        config.validate()
    except Exception:
        return "settings transformers refuses"
    defaults = getattr(config, "_get_default_generation_params", dict)()
    for key, value in config.to_diff_dict().items():
        allowed = _ALLOWED.get(key, ())
        if key in _ALLOWED and (allowed is None or value in allowed):
            continue
        if key in defaults and value == defaults[key]:
            continue  # transformers' global default: no change to decoding
        return f"the generation setting {key}={value!r}"
    mode = getattr(config, "get_generation_mode", None)
    mode = str(getattr(mode(), "value", mode())) if callable(mode) else ""
    if mode and mode not in ("greedy_search", "sample"):
        return f"the generation mode {mode}"
    if (config.num_beams or 1) != 1 or config.use_cache is False:
        return "beams or no cache"
    return config


def _new_tokens(model: nn.Module, config: Any, prompt: int, default_length: bool) -> Any:
    """How many tokens the call generates, as transformers' generate() counts them."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if default_length and callable(getattr(model, "_prepare_generation_config", None)):
        total = config.max_length + prompt
        positions = getattr(model.config, "max_position_embeddings", None)
        return (total if positions is None else min(total, positions)) - prompt
    return config.max_length - prompt


def _processors(model: nn.Module, config: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> Any:
    """transformers' own logits processors for the call (None when there is none), built as its
    generate() builds them, or why the loop leaves the call to transformers."""
    special = getattr(model, "_prepare_special_tokens", None)
    build = getattr(model, "_get_logits_processor", None)
    if not callable(special) or not callable(build):
        return "a transformers whose generate() builds its logits processors differently"
    try:
        from transformers import LogitsProcessorList

        # None: transformers' own warnings about a missing mask are not said twice
        special(config, None, device=ids.device, batch_size=ids.shape[0])
        processors = build(generation_config=config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
                           prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=ids.device,
                           model_kwargs={"attention_mask": mask})
    except Exception as exc:  # its generate() says why, when it is called
        return f"logits processors transformers does not build here ({type(exc).__name__})"
    for processor in processors:
        name = type(processor).__name__
        if name not in SERVED_PROCESSORS or not type(processor).__module__.startswith("transformers."):
            return f"the logits processor {name}"
    return processors if len(processors) else None


@contextlib.contextmanager
def same_draws(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Inside the block, a sampling generate() call draws what any other call of it draws: the
    random generators are seeded with SAMPLING_SEED in a fork of their state (the caller's state
    is put back after). A greedy call runs as it is."""
    given = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    sample = kwargs.get("do_sample", getattr(given, "do_sample", False))
    if not sample:
        yield
        return
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    cuda = isinstance(ids, torch.Tensor) and ids.device.type == "cuda"
    with torch.random.fork_rng(devices=[ids.device] if cuda else []):
        torch.manual_seed(SAMPLING_SEED)
        yield


def plain_causal(model: nn.Module) -> bool:
    """Whether every attention layer of `model` takes one boolean causal mask over the whole
    static cache (SDPA, no sliding window, no chunks, transformers' own mask functions): the
    mask the loop then makes itself, with no read of the device (a graph step needs it)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or hasattr(model, "create_masks_for_generate"):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


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


def tuned_settings(config: Any) -> dict | None:
    """torch.compile's arguments for the "tuned" loop: transformers' compile config (its
    CompileConfig, as its get_compiled_call passes it) with Inductor's coordinate descent
    tuning added to its mode's options, or None when the config does not compile with Inductor
    (the option is Inductor's)."""
    try:
        settings = dict(config.to_dict())
    except Exception:  # not a CompileConfig
        return None
    if settings.get("backend", "inductor") != "inductor":
        return None
    mode = settings.pop("mode", None)
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode)) if mode else {}  # no mode: no mode's options (not every mode's)
    options.update(settings.get("options") or {})
    options["coordinate_descent_tuning"] = True
    settings["options"] = options
    return settings


def compile_config(model: nn.Module, call: Greedy) -> Any:
    """The compile config transformers' get_compiled_call uses for the call: the call's, else
    the model's default."""
    config = getattr(call.config, "compile_config", None)
    if config is None:
        default = getattr(model, "_default_compile_config", None)
        config = default() if callable(default) else None
    return config


def compiled_by_transformers(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether transformers' generate() runs this call's decode steps through its compiled
    forward. Its first such call compiles that forward, and on the H200 the first call's
    tokens are not those of its later calls (Llama-1B shape, bf16, prompt 512: every later
    call, and the compiled loop, left the first call's tokens at new token 100;
    bench/first_call_study.py), so the untuned tokens of such a call are read from a later
    call (Workload._warm_tokens, apply_loop)."""
    call = greedy_call(model, args, kwargs)
    return not isinstance(call, str) and transformers_compiles(model, call, probe_cache(model, call))


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


def plain_model(model: nn.Module) -> "_Plain":
    """A context inside which `model` is as it was before any tuning (see _Plain)."""
    return _Plain(model)


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
    from .._core._samples import kv_cache_class

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
    sequence so far (a 2-D attention mask's width); mask: makes the 4-D boolean mask (or the dict
    of them per layer type, as the model takes it)."""
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
        elif key == "attention_mask" and mask is not None and (
                (kind == "tensor" and spec[2] == 4 and spec[1] == "torch.bool") or spec == ("other", "dict")):
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
    """One decode step recorded as a device graph, for one static cache (batch, length): the
    untuned forward with the workload's layout, the choice of the next token (the argmax, or
    GRAPH_PROCESSORS and a draw), the next input and the token's place in the output."""

    def __init__(self, loop: "DecodeLoop", cache: Any, batch: int, length: int, device: torch.device,
                 prompt: Greedy) -> None:
        self.cache = cache
        self.length = length
        self.token = torch.zeros(batch, 1, dtype=prompt.input_ids.dtype, device=device)
        self.tokens = torch.zeros(batch, length + 1, dtype=prompt.input_ids.dtype, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(length, device=device)
        shape = (batch, 1, 1, length)

        def mask() -> Any:
            return loop.mask_form((self.arange <= self.position).view(1, 1, 1, length).expand(shape))

        forward = loop.model

        def step() -> None:
            kwargs = lay_out(loop.layouts["decode"], loop.cache_arg, self.token, cache, self.position, None, mask)
            nxt = loop._choose(prompt, _logits(forward(**kwargs)), None)
            self.token.copy_(nxt.view(batch, 1))
            self.tokens.index_copy_(1, self.step, nxt.view(batch, 1))
            self.step.add_(1)
            self.position.add_(1)

        @contextlib.contextmanager
        def plain() -> Any:
            with _Plain(loop.model), _decoding(loop.model):
                yield

        # the warm-up runs write a step into the cache: the caller resets it afterwards
        self.graph, _ = sampling.record_graph(step, device, warmups=3, context=plain)
        self.weights = prefill.weights_of(loop.model)  # what the graph reads of the model, by address

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

    def __init__(self, model: nn.Module, kind: str, layouts: dict | None = None, top_sampler: bool = False) -> None:
        if kind not in LOOPS:
            raise ValueError(f"kind must be one of {', '.join(LOOPS)}, not {kind!r}")
        self.model = model
        self.kind = kind
        self.top_sampler = top_sampler  # a sampling call's scores from sampling.TopSampler where it serves
        self.given = layouts
        self.layouts = layouts if layouts is not None else DEFAULT_LAYOUTS["dynamic"]
        self.cache_arg = next((k for k, spec in self.layouts["decode"] if spec[0] == "cache"), None)
        if self.cache_arg is None or layouts is None:
            self.cache_arg = _cache_arg(model)
        self.original = type(model).generate.__get__(model)
        self._mask_types: tuple | None = None  # the layer types a dict of masks is keyed by (mask_form)
        self.captured: list[torch.Tensor] | None = None  # set by distribution_difference: the processed scores
        # teacher forcing (forcing.teacher_forced): each step's token is taken from `forcing` ([batch, steps])
        # instead of chosen, and its raw logits kept in `forced_logits` (processed scores in `captured`)
        self.forcing: torch.Tensor | None = None
        self.forced_logits: list[torch.Tensor] = []
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._takes_positions = "position_ids" in params
        self._takes_mask = "attention_mask" in params
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.calls = 0
        self.resampled = 0  # calls made again with transformers' processors (sampling.TopSampler.overflowed)
        self._checks: list[tuple[tuple, dict, torch.Tensor]] = []
        self.kinds: frozenset | None = None  # the call kinds served (call_kind); None: every kind
        self._graphs: dict[tuple, _StepGraph] = {}
        self.unrecorded_steps: dict[tuple, str] = {}  # a step whose recording failed: why (run step by step)
        self._caches: dict[tuple, Any] = {}  # the compiled loop's static caches, per shape
        self.record_draws = True  # a top-k sampler's choice of the next token recorded (sampling.RecordedDraw)
        self._draws: dict[tuple, sampling.RecordedDraw] = {}  # the recorded draws, the newest last
        self.unrecorded: dict[tuple, str] = {}  # a draw whose recording failed: why (its calls run eagerly)
        self.record_prefills = True  # a kept cache's prefill recorded per prompt shape (prefill.RecordedPrefill)
        self._prefills: dict[tuple, prefill.RecordedPrefill] = {}  # the recorded prefills, the newest last
        self._prefill_calls: dict[tuple, int] = {}  # calls per prompt shape not recorded yet (prefill.RECORD_AFTER)
        self.unrecorded_prefills: dict[tuple, str] = {}  # a prefill not recorded or not replayed: why
        self._lock = threading.Lock()
        self._previous_len: int = -1
        self.eager = False  # set by uncompiled(): the compiled loop's steps run the plain forward
        self._tuned: tuple[Any, Callable] | None = None  # the "tuned" loop's (compile config, compiled forward)
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
        top = ", top-k sampler" if self.top_sampler else ""
        return f"<torch-tweak decode loop ({self.kind}{top}) of {type(self.model).__name__}.generate>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = greedy_call(self.model, args, kwargs)
        why = call if isinstance(call, str) else \
            self.unmeasured(call) or self.layout_problem(call) or self.graph_problem(call) or self.tuned_problem(call)
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
        for phase in ("prefill", "decode"):
            for key, spec in self.layouts[phase]:
                if not (key in ("attention_mask", "position_ids") or spec[0] == "value"
                        or (key == "input_ids" and spec[0] == "tensor") or (key == self.cache_arg and spec[0] == "cache")):
                    return f"the argument {key} ({'/'.join(map(str, spec))}) of the {phase} calls"
        return None

    def graph_problem(self, call: Greedy) -> str | None:
        """Why a graph loop cannot record this call's decode step, or None. A recorded step
        replays fixed work: the argmax or a draw after processors that read only the scores
        (GRAPH_PROCESSORS), no padding, and masks the loop makes itself (plain_causal: a sliding
        window's static cache keeps its place in Python). A call with no static cache or not on
        CUDA runs its steps one by one."""
        if self.kind != "graph" or not self.records(call):
            return None
        other = [type(p).__name__ for p in (call.processors or ()) if type(p).__name__ not in GRAPH_PROCESSORS]
        if other:
            return f"logits processing that reads the sequence so far ({', '.join(other)}), which a graph loop " \
                   "does not record"
        if call.mask is not None:
            return "padding in the prompt, which the graph loop does not record"
        if not plain_causal(self.model):
            return "attention other than one causal mask (a sliding window, chunks, not SDPA): the graph loop " \
                   "does not record it"
        return None

    def tuned_problem(self, call: Greedy) -> str | None:
        """Why the tuned loop cannot build its forward for this call (a compile config that
        does not compile with Inductor), or None."""
        if self.kind != "tuned" or not call.static:
            return None
        config = compile_config(self.model, call)
        if (self._tuned is not None and self._tuned[0] == config) or tuned_settings(config) is not None:
            return None  # built for this config already, or buildable
        return "a compile config whose backend is not Inductor, whose option the tuned loop adds"

    def records(self, call: Greedy) -> bool:
        """Whether this loop records the call's decode step as a device graph."""
        return self.kind == "graph" and call.static and call.input_ids.device.type == "cuda"

    def mask_form(self, mask: torch.Tensor) -> Any:
        """The loop's own causal mask in the form the model takes: one tensor, or one per
        layer type when the model's config names them (transformers' create_masks_for_generate)."""
        if self._mask_types is None:
            config = self.model.config.get_text_config(decoder=True) \
                if hasattr(self.model.config, "get_text_config") else self.model.config
            types = getattr(config, "layer_types", None)
            self._mask_types = () if types is None else tuple(sorted(set(types)))
        return {t: mask for t in self._mask_types} if self._mask_types else mask

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
        # the graph loop's step runs one by one where its processed scores are read (the check
        # of a sampling call's distribution)
        graphs = self.captured is None and self.forcing is None and self.records(call)
        # what is kept between calls is kept per grad mode: a cache made in inference mode
        # cannot be written outside it
        mode = torch.is_inference_mode_enabled()
        kept: tuple | None = None  # the key of a cache kept between calls (reset by _first_logits)
        step = (batch, length, device, ids.dtype, mode, self._sampling_key(call))
        entry = self._step_graph(call, step) if graphs else None
        graphs = entry is not None
        if entry is not None:
            kept = ("graph",) + step
            cache = entry.cache
        elif self.kind in COMPILED_LOOPS and call.static:
            # one cache per shape, reset between calls: its tensors keep their addresses, so the
            # compiled forward's device graphs replay instead of recording again
            kept = ("cache", batch, length, device, ids.dtype, mode)
            cache = self._caches.get(kept[1:])
            if cache is None:
                cache = self._caches[kept[1:]] = new_cache(self.model, True, length)
        else:
            cache = new_cache(self.model, call.static, length)
        compiled = self.kind in COMPILED_LOOPS and not self.eager and transformers_compiles(self.model, call, cache)
        logits = self._prefill(call, cache) if kept is None else self._first_logits(call, cache, kept)
        if graphs:
            def finished(n: int) -> bool:
                self._in_time()
                return eos is not None and bool(_finished(entry.tokens[:, :n], eos).all())

            first = self._choose(call, logits, ids if call.processors is not None else None)
            tokens = entry.run(first, prompt, call.max_new, finished)
        else:
            sampler = self._sampler(call, logits.shape[-1]) if self.top_sampler else None
            state = sampling.rng_state(device) if sampler is not None else None
            mark = None if self.captured is None else len(self.captured)
            forced = len(self.forced_logits)
            tokens = self._steps(logits, cache, call, eos, length, compiled, sampler)
            if sampler is not None and sampler.overflowed():
                # a step the sampler could not serve: the call again, from the same generator
                # state, with transformers' processors (what the first run captured is dropped)
                self.resampled += 1
                if mark is not None:
                    del self.captured[mark:]
                del self.forced_logits[forced:]
                sampling.set_rng_state(device, state)
                if kept is not None:
                    logits = self._first_logits(call, cache, kept)
                else:
                    cache = new_cache(self.model, call.static, length)
                    logits = self._prefill(call, cache)
                tokens = self._steps(logits, cache, call, eos, length, compiled, None)
        return torch.cat([ids, _stop(tokens, eos, call.pad)], dim=1)

    def _step_graph(self, call: Greedy, key: tuple) -> _StepGraph | None:
        """The recorded decode step of the call's shape and settings (`key`), recorded at its
        first call; None where its recording failed (said once: such calls run step by step)."""
        entry = self._graphs.get(key)
        if entry is not None and prefill.weights_moved(entry.weights):
            # a weight replaced or moved since the recording (model.to, a new Parameter): the
            # graph would read the old memory, so the step is recorded again on the new
            del self._graphs[key]
            entry = None
        if entry is None and key not in self.unrecorded_steps:
            batch, length, device = key[:3]
            cache = new_cache(self.model, call.static, length)
            try:
                self._prefill(call, cache)  # lays the cache out before the step is recorded
                entry = _StepGraph(self, cache, batch, length, device, call)
            except Exception as exc:  # this shape's calls run step by step
                if not self.unrecorded_steps:
                    logger.warning("torch-tweak: the graph loop could not record its decode step for batch %d (%s: "
                                   "%s); such calls run step by step", batch, type(exc).__name__, exc)
                _bounded(self.unrecorded_steps, key, f"{type(exc).__name__}: {exc}")
                return None
            self._graphs[key] = entry
        return entry

    def _sampler(self, call: Greedy, vocab: int) -> "sampling.TopSampler | sampling.RecordedDraw | None":
        """The sampler of a call's choices (None where it does not serve): recorded as a device
        graph once per batch, vocabulary and settings (sampling.RecordedDraw), but where the
        loop's processed scores are read (the distribution check) or record_draws is off."""
        batch, device = call.input_ids.shape[0], call.input_ids.device
        sampler = sampling.TopSampler.of(call.processors, call.sample, device)
        if sampler is None or self.captured is not None or not self.record_draws:
            return sampler
        key = sampling.RecordedDraw.key(sampler, batch, vocab, device)
        if key in self.unrecorded:
            return sampler
        draw = self._draws.pop(key, None)
        if draw is None:
            if len(self._draws) >= sampling.RECORDED_DRAWS:
                self._draws.pop(next(iter(self._draws)))
            try:
                draw = sampling.RecordedDraw(sampler, batch, vocab, device)
            except Exception as exc:  # the call is served eagerly, and so are later ones of this shape
                self.unrecorded[key] = f"{type(exc).__name__}: {exc}"
                logger.warning("torch-tweak: the decode loop could not record its sampler's choice for batch %d "
                               "(%s); such calls choose their tokens kernel by kernel", batch, self.unrecorded[key])
                sampler.flag = None  # RecordedDraw gave it a buffer of its own
                return sampler
        self._draws[key] = draw  # the newest last
        draw.reset()
        return draw

    @staticmethod
    def _sampling_key(call: Greedy) -> tuple:
        """What of a call's choice of the next token a recorded step bakes in: whether it draws,
        and each processor's settings (its plain attributes)."""
        processors = tuple((type(p).__name__, tuple(sorted((k, v) for k, v in vars(p).items()
                                                           if isinstance(v, (bool, int, float, str)))))
                           for p in (call.processors or ()))
        return (call.sample, processors)

    def _positions(self, call: Greedy) -> torch.Tensor | None:
        """The prompt's position ids as transformers' generate() makes them (from the attention
        mask when there is one), or None when the forward takes none."""
        if not self._takes_positions:
            return None
        mask = call.mask
        if mask is None and self._takes_mask:  # transformers counts them from a mask of ones: one row per sequence
            mask = torch.ones(call.input_ids.shape, dtype=torch.long, device=call.input_ids.device)
        if mask is not None:
            return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return torch.arange(call.input_ids.shape[1], dtype=torch.long, device=call.input_ids.device).unsqueeze(0)

    def _attention(self, call: Greedy, cache: Any, mask: torch.Tensor | None, positions: torch.Tensor | None,
                   width: int, first: bool) -> Any:
        """The attention mask transformers' prepare_inputs_for_generation passes the forward: for
        a static cache, transformers' own mask functions (one mask, or one per layer type) on the
        2-D mask so far; otherwise that 2-D mask (None: no padding)."""
        if not call.static:
            return mask
        from transformers import masking_utils

        make = getattr(self.model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
        batch = call.input_ids.shape[0]
        # the cache's argument is `cache` in newer transformers, `past_key_values` before (5.17)
        try:
            named = "cache" if "cache" in inspect.signature(make).parameters else "past_key_values"
        except (TypeError, ValueError):
            named = "cache"
        out = make(config=self.model.config,
                   inputs_embeds=torch.empty((batch, width, 0), dtype=self.model.dtype, device=call.input_ids.device),
                   attention_mask=mask, position_ids=positions, block_sequence_ids=None,
                   token_type_ids=None, mm_token_type_ids=None, is_first_iteration=first, **{named: cache})
        if isinstance(out, dict):
            return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    def _kwargs(self, phase: str, ids: torch.Tensor, cache: Any, positions: torch.Tensor | None,
                attention: Any) -> dict:
        """One forward call's keyword arguments, in the order of the layout recorded from the
        workload's own generate() (so that they fit the signatures tuned on them), with the
        position ids and the attention mask transformers would pass."""
        kwargs: dict[str, Any] = {}
        for key, spec in self.layouts[phase]:
            if key == "input_ids" and spec[0] == "tensor":
                kwargs[key] = ids
            elif key == self.cache_arg and spec[0] == "cache":
                kwargs[key] = cache
            elif key == "position_ids":
                if positions is not None:
                    kwargs[key] = positions
            elif key == "attention_mask":
                if attention is not None:
                    kwargs[key] = attention
            elif spec[0] == "value":
                kwargs[key] = spec[1]
            else:
                raise LayoutError(f"the argument {key} ({'/'.join(map(str, spec))})")
        if positions is not None and "position_ids" not in kwargs:
            kwargs["position_ids"] = positions
        if attention is not None and "attention_mask" not in kwargs:
            kwargs["attention_mask"] = attention
        return kwargs

    def _first_logits(self, call: Greedy, cache: Any, kept: tuple) -> torch.Tensor:
        """The prompt's logits on a cache kept between calls (`kept`: its key), the cache reset
        first: from the prompt shape's recorded prefill where there is one (made at the
        shape's RECORD_AFTER-th call, prefill.RecordedPrefill), else eagerly. A prefill that
        cannot be recorded or replayed is said once and runs eagerly from then on."""
        batch, prompt = call.input_ids.shape
        key = kept + (prompt,)
        recorded = self._prefills.pop(key, None) if self.record_prefills else None
        if recorded is None and self.record_prefills and key not in self.unrecorded_prefills and \
                prefill.RecordedPrefill.eligible(batch, prompt, call.mask is not None):
            calls = self._prefill_calls.pop(key, 0) + 1
            if calls < prefill.RECORD_AFTER:
                _bounded(self._prefill_calls, key, calls)
            else:
                try:
                    recorded = self._record_prefill(call, cache)
                except Exception as exc:  # this shape's prefills run eagerly
                    self._unrecorded_prefill(key, batch, prompt, f"{type(exc).__name__}: {exc}")
        if recorded is not None:
            try:
                logits = recorded(call.input_ids)
            except prefill.Moved:  # dropped: recorded again at the shape's next calls
                pass
            except prefill.Stale as exc:
                self._unrecorded_prefill(key, batch, prompt, str(exc))
            else:
                while len(self._prefills) >= prefill.PREFILL_GRAPHS:
                    self._prefills.pop(next(iter(self._prefills)))
                self._prefills[key] = recorded  # the newest last
                return logits
        cache.reset()
        return self._prefill(call, cache)

    def _record_prefill(self, call: Greedy, cache: Any) -> prefill.RecordedPrefill:
        """The call's prefill on `cache` recorded: the untuned forward on a buffer of the prompt,
        with the position ids and attention mask of a prompt with no padding (they depend only
        on its shape), the cache reset first."""
        ids = call.input_ids.clone()
        positions = self._positions(call)
        cache.reset()
        attention = self._attention(call, cache, None, positions, ids.shape[1], True)
        kwargs = self._kwargs("prefill", ids, cache, positions, attention)
        model = self.model

        def run() -> torch.Tensor:
            cache.reset()
            return _logits(model(**kwargs))

        return prefill.RecordedPrefill(run, ids, cache, lambda: _Plain(model), model)

    def _unrecorded_prefill(self, key: tuple, batch: int, prompt: int, why: str) -> None:
        if not self.unrecorded_prefills:
            logger.warning("torch-tweak: the decode loop could not record its prefill for a prompt of %d x %d "
                           "tokens (%s); such prompts run eagerly", batch, prompt, why)
        _bounded(self.unrecorded_prefills, key, why)

    def _prefill(self, call: Greedy, cache: Any) -> torch.Tensor:
        """The prompt through the model; returns its logits."""
        ids = call.input_ids
        positions = self._positions(call)
        attention = self._attention(call, cache, call.mask, positions, ids.shape[1], True)
        return _logits(self.model(**self._kwargs("prefill", ids, cache, positions, attention)))

    def _steps(self, logits: torch.Tensor, cache: Any, call: Greedy, eos: torch.Tensor | None, length: int,
               compiled: bool, sampler: "sampling.TopSampler | sampling.RecordedDraw | None" = None) -> torch.Tensor:
        """Every new token after the prefill's `logits`, step by step, as transformers' decoding
        loop makes them: its logits processors on the sequence so far, then the argmax or a draw
        of torch.multinomial from the softmax, with finished sequences fed the pad token. With
        `compiled`, the steps run transformers' compiled forward (the one its generate() would
        call: compiled once per model and compile config, kept on the model), the arguments
        contiguous as transformers lays them out, so that its guards hold and nothing compiles
        again. No step reads the device, but the stopping rule every CHECK_EVERY steps. A
        `sampler` processes the scores in place of the processors (sampling.TopSampler)."""
        model = self.model
        forward = self.compiled_forward(call) if compiled else model
        ids = call.input_ids
        batch, prompt = ids.shape
        device = ids.device
        seq = ids if call.processors is not None else None  # the sequence so far, for the processors
        mask = call.mask
        positions = self._positions(call)
        last = None if positions is None else positions[..., -1:]
        own = call.static and call.mask is None and plain_causal(model)
        arange = torch.arange(length, device=device) if own else None
        unfinished = torch.ones(batch, dtype=torch.long, device=device) if eos is not None else None
        tokens = torch.empty(batch, call.max_new, dtype=ids.dtype, device=device)
        nxt = self._choose(call, logits, seq, sampler)
        done = 0
        with _decoding(model):
            while True:
                if unfinished is not None:
                    nxt = nxt * unfinished + call.pad * (1 - unfinished)
                    unfinished = unfinished & ~torch.isin(nxt, eos)
                tokens[:, done] = nxt
                done += 1
                if seq is not None:
                    seq = torch.cat([seq, nxt[:, None]], dim=-1)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
                if done >= call.max_new:
                    break
                self._in_time()
                if unfinished is not None and done % CHECK_EVERY == 0 and not bool(unfinished.any()):
                    break
                position = prompt + done - 1  # the place in the cache of the token fed now
                step_positions = None if last is None else last + done
                if own:
                    attention = self.mask_form((arange <= position).view(1, 1, 1, length).expand(batch, 1, 1, length))
                else:
                    attention = self._attention(call, cache, mask, step_positions, 1, False)
                kwargs = self._kwargs("decode", nxt.view(batch, 1), cache, step_positions, attention)
                if compiled:  # contiguous as transformers makes them (a dict of masks too): its guards hold
                    kwargs = {k: _contiguous(v) for k, v in kwargs.items()}
                # the logits are read (copied) before the next call reuses the output's memory
                nxt = self._choose(call, _logits(forward(**kwargs)), seq, sampler)
        return tokens[:, :done]

    def compiled_forward(self, call: Greedy) -> Callable:
        """The compiled forward a compiled loop's steps run: transformers' own (the "compiled"
        loop: compiled once per model and compile config, kept on the model), or the "tuned"
        loop's build of the same forward with tuned_settings (kept on the loop, built again when
        the call's compile config changes, as transformers does)."""
        if self.kind == "compiled":
            return self.model.get_compiled_call(getattr(call.config, "compile_config", None))
        config = compile_config(self.model, call)
        if self._tuned is None or self._tuned[0] != config:
            settings = tuned_settings(config)
            if settings is None:
                raise RuntimeError("the call's compile config does not compile with Inductor, whose option the "
                                   "tuned loop adds")
            self._tuned = (config, torch.compile(self.model.__call__, **settings))
        return self._tuned[1]

    def _choose(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
                sampler: "sampling.TopSampler | sampling.RecordedDraw | None" = None) -> torch.Tensor:
        """The next token from a forward's logits, as transformers' _sample chooses it (under
        teacher forcing: the forced token, the logits kept)."""
        if self.forcing is not None:
            return self._forced(call, logits, seq, sampler)
        if call.processors is None and not call.sample:
            return logits[:, -1, :].argmax(-1)
        if isinstance(sampler, sampling.RecordedDraw):
            return sampler(logits[:, -1])
        if sampler is not None:
            scores = sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32))
        else:
            scores = self._process(call, logits, seq)
        if self.captured is not None:
            self.captured.append(scores.clone())
        if call.sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def _forced(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
                sampler: "sampling.TopSampler | sampling.RecordedDraw | None") -> torch.Tensor:
        """Teacher forcing: the step's raw logits (and, while captured, its processed scores:
        the top-k sampler's where it serves the call) kept, the forced token returned (past the
        forced ones, the argmax)."""
        step = len(self.forced_logits)
        self.forced_logits.append(logits[:, -1].detach().to(copy=True, dtype=torch.float32))
        if self.captured is not None:
            if isinstance(sampler, sampling.TopSampler):
                self.captured.append(sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32)))
            else:
                self.captured.append(self._process(call, logits, seq))
        if step < self.forcing.shape[1]:
            return self.forcing[:, step].to(logits.device)
        return logits[:, -1].argmax(-1)

    @staticmethod
    def _process(call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None) -> torch.Tensor:
        """The processed next-token scores: the last logits in float32 through transformers'
        processors for the call, given the sequence so far."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        if call.processors is not None:
            scores = call.processors(seq, scores)
        return scores


DISTRIBUTION_BOUND = 1e-6
"""The largest total variation distance between the loop's processed next-token distribution
and transformers' at any step of a sampling call checked at tuning (distribution_difference).
The two run the same processors on the same scores, so they are equal bit for bit where the
logits are; the bound only leaves room for a softmax's last bit."""


def distribution_difference(model: nn.Module, loop: DecodeLoop, args: tuple, kwargs: dict) -> str | None:
    """For a sampling call: how the loop's processed next-token distribution differs from
    transformers' processors' on the same prefixes (the untuned loop's output_scores, each
    step's softmax against the loop's), beyond DISTRIBUTION_BOUND; None when it does not, or
    for a greedy call (its tokens are compared exactly). Both runs draw under same_draws."""
    call = greedy_call(model, args, kwargs)
    if isinstance(call, str) or not call.sample:
        return None
    with same_draws(model, args, kwargs), torch.no_grad():
        reference = loop.original(*args, **{**kwargs, "return_dict_in_generate": True, "output_scores": True})
    loop.captured = []
    try:
        with same_draws(model, args, kwargs), torch.no_grad():
            model.generate(*args, **kwargs)
        captured = loop.captured
    finally:
        loop.captured = None
    expected = list(reference.scores)
    if len(captured) < len(expected):
        return f"the loop made {len(captured)} processed distributions, transformers {len(expected)}"
    for step, (mine, theirs) in enumerate(zip(captured, expected)):
        distance = 0.5 * (nn.functional.softmax(mine, dim=-1) - nn.functional.softmax(theirs.to(mine.device), dim=-1)
                          ).abs().sum(dim=-1).max()
        if not bool(distance <= DISTRIBUTION_BOUND):
            return (f"step {step}: the processed next-token distribution is {float(distance):.2e} (total variation) "
                    f"from transformers' processors', more than {DISTRIBUTION_BOUND:g}")
    return None


KEPT_KEYS = 64
"""The most prompt shapes a decode loop keeps a count or a reason for (the oldest dropped)."""


def _bounded(table: dict, key: tuple, value: Any) -> None:
    """table[key] = value, the oldest entry dropped past KEPT_KEYS."""
    table.pop(key, None)
    if len(table) >= KEPT_KEYS:
        table.pop(next(iter(table)))
    table[key] = value


def _contiguous(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, dict):
        return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def _decoding(model: nn.Module) -> Any:
    """What transformers' decoding loop enters around its decode steps (after the prefill):
    for a mixture of experts on a GPU, another experts kernel (_optimize_model_for_decode)."""
    decoding = getattr(model, "_optimize_model_for_decode", None)
    return decoding() if callable(decoding) else contextlib.nullcontext()


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
    top_sampler: bool = False  # DecodeLoop.top_sampler


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
    return LoopPlan(loop.kind, loop.given, checks, loop.top_sampler)


def check_bounds(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why a stored generate() call cannot check a decode loop on `model`: not a call
    the loop serves, or asking more than MAX_CHECK_NEW_TOKENS new tokens or
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


def untuned_difference(i: int, got: Any, untuned: Sequence[torch.Tensor], prompt: int | None) -> str | None:
    """None where generate call i's output equals one of the untuned runs' tokens (several
    where the untuned model does not repeat its own: Workload._warm_tokens), else how it
    differs from the first's."""
    problem = token_difference(i, got, untuned[0], prompt)
    if problem is not None and any(token_difference(i, got, other, prompt) is None for other in untuned[1:]):
        return None
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
