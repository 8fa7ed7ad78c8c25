"""Which generate() calls tweak's decode loop serves, read as transformers reads them.

A call is parsed once into a ``Greedy`` (its prompt, mask, settings and transformers' own logits
processors for it), or a reason the loop leaves it to transformers' generate(): a setting or a
processor the loop does not run (``_ALLOWED``, ``SERVED_PROCESSORS``), beams, a streamer, a cache
passed in. The bounds on a stored check call live here too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from ..._core import settings


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


def config_class(model: nn.Module) -> Any:
    config = getattr(model, "generation_config", None)
    return None if config is None else type(config)


def greedy_call(model: nn.Module, args: tuple, kwargs: dict) -> Greedy | str:
    """The call as the loop serves it (greedy or sampling, with the logits processors
    SERVED_PROCESSORS names, read as transformers reads it), or why the loop leaves it to
    transformers."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if config_class(model) is None:
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
        torch.manual_seed(settings.SAMPLING_SEED)
        yield


def call_kind(call: Greedy) -> tuple[int, bool]:
    """What a decode loop's speed depends on beyond the model: the batch size and the cache
    (static or dynamic). A loop serves only the kinds it was measured on."""
    return int(call.input_ids.shape[0]), bool(call.static)


def check_bounds(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why a stored generate() call cannot check a decode loop on `model`: not a call
    the loop serves, or asking more than MAX_CHECK_NEW_TOKENS new tokens or
    MAX_CHECK_TOKENS tokens in all; None when it can."""
    call = greedy_call(model, args, kwargs)
    if isinstance(call, str):
        return f"a stored generate() call is not one the loop serves ({call})"
    batch, prompt = call.input_ids.shape
    if call.max_new > settings.MAX_CHECK_NEW_TOKENS:
        return (f"a stored generate() call asks for {call.max_new} new tokens, and a check may ask at most "
                f"{settings.MAX_CHECK_NEW_TOKENS}")
    if batch * (prompt + call.max_new) > settings.MAX_CHECK_TOKENS:
        return (f"a stored generate() call decodes {batch} x ({prompt} + {call.max_new}) tokens, and a check may "
                f"decode at most {settings.MAX_CHECK_TOKENS}")
    return None


def prompt_length(args: tuple, kwargs: dict) -> int | None:
    """The prompt length of a generate() call (its inputs' second axis), or None."""
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
