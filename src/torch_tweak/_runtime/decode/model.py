"""The model's side of a decode loop, as transformers' generate() makes it: its caches
(``Caches``: transformers' length rule, the caches kept per shape), whether transformers
compiles a call's steps and with what settings, the model as it was before tuning
(``plain_model``), and its work recorded as a device graph and replayed (``record_graph``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..._core import settings
from ..module import install as install_wrapper, installed, uninstall as uninstall_wrapper
from .call import Greedy, greedy_call


def new_cache(model: nn.Module, static: bool, length: int) -> Any:
    """A new cache as generate() makes one: a StaticCache of `length` positions, or a
    DynamicCache (a static cache allocates its tensors on first use)."""
    dynamic_class, static_class = _cache_classes(model)
    config = text_config(model)
    return static_class(config=config, max_cache_len=length) if static else dynamic_class(config=config)


def text_config(model: nn.Module) -> Any:
    """The config of the model's decoder (its text config where it has several)."""
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


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
    bench/studies/first_call_study.py), so the untuned tokens of such a call are read from a later
    call (Workload._warm_tokens, apply_loop)."""
    call = greedy_call(model, args, kwargs)
    return not isinstance(call, str) and transformers_compiles(model, call, probe_cache(model, call))


class Caches:
    """A loop's caches beyond one call: transformers' rule for a static cache's length (never
    shorter than an earlier call's) and the caches kept between calls, one per shape (a
    compiled forward's device graphs read their tensors in place)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kept: dict[tuple, Any] = {}  # a compiled loop's static caches, per shape
        self._previous_len = -1

    def static_length(self, call: Greedy) -> int:
        """transformers' rule: prompt + new tokens - 1, never shorter than an earlier call's,
        at least generation_config.max_cache_len."""
        length = call.input_ids.shape[1] + call.max_new - 1
        if call.max_cache_len is not None:
            length = max(length, call.max_cache_len)
        length = max(length, self._previous_len)
        self._previous_len = length
        return length

    def kept_cache(self, key: tuple, length: int) -> Any:
        """The static cache kept for `key` (made at its first call): reset between calls, its
        tensors keep their addresses."""
        cache = self.kept.get(key)
        if cache is None:
            cache = self.kept[key] = new_cache(self.model, True, length)
        return cache


def cache_arg_of(model: nn.Module) -> str | None:
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


@contextlib.contextmanager
def plain_model(model: nn.Module) -> Iterator[None]:
    """Inside the block the model is as it was before any tuning: its tuned modules are taken
    out and put back after, in the mode they were in. What a device graph records must not
    itself replay graphs, and Inductor must see plain modules."""
    wrappers = list(installed(model).values())
    active = [w.tt_active for w in wrappers]
    for w in reversed(wrappers):
        uninstall_wrapper(model, w)
    try:
        yield
    finally:
        for w, on in zip(wrappers, active):
            install_wrapper(model, w)
            if on:
                w.tt_activate()


def logits_of(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out["logits"]
    return logits


def bounded(table: dict, key: tuple, value: Any) -> None:
    """table[key] = value, the oldest entry dropped past LOOP_KEPT_KEYS."""
    table.pop(key, None)
    if len(table) >= settings.LOOP_KEPT_KEYS:
        table.pop(next(iter(table)))
    table[key] = value


def decode_context(model: nn.Module) -> Any:
    """What transformers' decoding loop enters around its decode steps (after the prefill):
    for a mixture of experts on a GPU, another experts kernel (_optimize_model_for_decode)."""
    decoding = getattr(model, "_optimize_model_for_decode", None)
    return decoding() if callable(decoding) else contextlib.nullcontext()


@contextlib.contextmanager
def own_blas_workspace() -> Any:
    """Around a capture on CUDA: cuBLAS's workspaces are dropped before and after it, so that
    the capture allocates its own inside the graph's memory pool, which lives as long as the
    graph. A workspace made outside the pool (by a warm-up on the same stream) would be freed
    while the graph still writes to it by the next code that drops them: torch.compile's own
    device graphs do, before and after each of their recordings. Dropping them after the
    capture keeps eager work from sharing the graph's workspace."""
    drop = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if drop is not None:
        drop()
    try:
        yield
    finally:
        if drop is not None:
            drop()


def record_graph(fn: Callable[[], Any], device: torch.device, warmups: int,
                 context: Callable[[], Any] = contextlib.nullcontext) -> tuple[Any, Any]:
    """`fn` recorded as a device graph on `device`, whichever device is current; returns the graph
    and what the recorded call returned. The warm-up calls run first on the stream the graph is
    recorded on, so that what is made on first use (lazy state, a library's plans) exists
    before the recording starts; every call runs inside `context()`. Their draws come
    from a fork of the generators: the caller's are as they were, so recording takes no random
    numbers from the call. The capture is thread-local: another thread's work on the device
    (another model's calls) goes on meanwhile instead of failing. The graph's cuBLAS workspace
    is its own, in its memory pool (own_blas_workspace). The loop records its prefill, its
    sampler's draw and the graph loop's step with it."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.random.fork_rng(devices=[device]):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), context():
            for _ in range(warmups):
                fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with own_blas_workspace(), \
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"), context():
            out = fn()
        torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


def replay(graph: Any, device: torch.device) -> None:
    """One replay of a graph record_graph recorded on `device`, whichever device is current (a
    replay launches on the current device's stream)."""
    if device.index == torch.cuda.current_device():
        graph.replay()
    else:
        with torch.cuda.device(device):
            graph.replay()
