"""tweak's own decode step for the decoders people ship: transformers' Llama, Qwen2, Mistral and
Qwen3 causal LMs read as they are, and one decode step of theirs run by fused_kernels.py's work.

``FusedDecoder.of(model)`` reads a model (or says why it does not serve it): per layer its
RMSNorms, q/k/v projections (read by one product launch: the three weights as the model holds
them, no copy, nothing new in its state_dict), o projection, gate/up projections (one launch),
down projection; the final norm and the output projection (tied to the input embedding or not).
The model's weights are referenced, never copied or changed.

``decoder.step(tokens, position, cache)`` is one decode step of a batch: the embedding of
`tokens` ([batch] int64), per layer the norm and the q/k/v product, the rotary embedding on q and
the new k (from a table of the model's own rotary module: its rope scaling and attention
scaling), the new k and v written into transformers' StaticCache at `position` (a 0-d int64
tensor on the device; one position for every row), attention over positions <= position with
grouped key/value heads, the o product and the residual, the norm and the gate/up product,
silu(gate) * up, the down product and the residual; then the final norm and the output
projection: the logits, [batch, vocab] in the model's dtype. The prefill is the model's own
forward into the same cache (``decoder.prefill``).

The work of a step (``Step``) is made once per cache: its buffers (preallocated: a step
allocates nothing with the Triton kernels and reads nothing back to the host, so it can be
recorded in one device graph), the rotary table for the cache's length, and for the Triton
kernels each shape's block sizes, measured on the card before the first step. A cache holds a
batch bucket (1, 2, 4 or 8 rows: ``bucket``); a batch of fewer rows runs in its bucket, the
padded rows computed and ignored.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ..._core import settings
from ..._core.model_state import snapshot, weights_moved, weights_of
from .fused_kernels import Attention, Product, kernels as make_kernels

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
            "Qwen3ForCausalLM": "qwen3"}
"""The transformers classes FusedDecoder reads, with their modeling module's name."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

DYNAMIC_ROPE = ("dynamic", "longrope")
"""Rope types whose frequencies depend on the longest position of a call: their table is made
position by position, as the decode steps call the rotary module."""


_LOCK = threading.RLock()
"""Held while a step's work or a rotary table is made (steps of several threads on one decoder)."""


def bucket(batch: int) -> int | None:
    """The bucket a batch of `batch` rows runs in, or None past the largest."""
    return next((b for b in settings.FUSED_BUCKETS if batch <= b), None)


@dataclasses.dataclass(eq=False)
class Layer:
    """One decoder layer's work."""

    qkv: Product
    attention: Attention
    o: Product
    gate_up: Product
    down: Product


def _plain_weight(t: Any) -> bool:
    """A plain dense tensor of a served dtype (not a quantized weight or a tensor subclass)."""
    return type(t) in (nn.Parameter, torch.Tensor) and type(t.data) is torch.Tensor and t.dtype in DTYPES \
        and t.layout == torch.strided and not t.is_quantized and t.is_contiguous()


def _linears(modules: list[Any], where: str) -> str | None:
    for m in modules:
        if type(m) is not nn.Linear:
            return f"{where}: a {type(m).__name__} where an nn.Linear is read (quantized or replaced)"
        if not _plain_weight(m.weight) or (m.bias is not None and not _plain_weight(m.bias)):
            return f"{where}: a weight that is not a plain contiguous tensor of bf16, fp16 or fp32"
    if len({m.bias is None for m in modules}) > 1:
        return f"{where}: biases on some of the projections read together and not on others"
    return None


def _config_problem(model: nn.Module, family: str) -> str | None:
    config = model.config
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"the activation {getattr(config, 'hidden_act', None)!r} (silu is served)"
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) is not None or any(t != "full_attention" for t in types):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        return "a quantized model"
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        return "a mixture of experts"
    return None


def _module_problem(model: nn.Module, family: str) -> str | None:
    """Why the model's modules are not those of its transformers family as shipped, or None."""
    module = f"transformers.models.{family}.modeling_{family}"
    prefix = type(model).__name__[:-len("ForCausalLM")]
    expected = {"DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding", "Model"}
    for path, m in model.named_modules():
        name = type(m).__name__
        if type(m).__module__ == module and name.startswith(prefix) and name[len(prefix):] in expected:
            continue
        if type(m) in (nn.Linear, nn.Embedding, nn.ModuleList, nn.SiLU, nn.Dropout) or m is model or \
                type(m).__name__ == "SiLUActivation":
            continue
        return f"the module {path or 'model'} is a {type(m).__module__}.{name}, not the model's own"
    return None


def _hook_problem(model: nn.Module) -> str | None:
    """Hooks the step would not run: any forward hook but transformers' own output capturing
    (installed by a call with output_hidden_states, recording only when asked), torch's global
    module hooks, accelerate's dispatch hooks (a model spread over devices or offloaded)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "global forward hooks (the step would not run them)"
    for path, m in model.named_modules():
        hooks = list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values())
        if any(getattr(h, "__module__", "") != "transformers.utils.output_capturing" for h in hooks) or \
                hasattr(m, "_hf_hook"):
            return f"forward hooks on {path or 'the model'} (the step would not run them)"
    return None


def problem(model: nn.Module) -> str | None:
    """Why FusedDecoder does not serve `model`, or None."""
    family = FAMILIES.get(type(model).__name__)
    if family is None or not type(model).__module__.startswith("transformers."):
        return f"a {type(model).__name__} (served: transformers' {', '.join(FAMILIES)})"
    from ..module import installed, is_wrapped

    if installed(model) or any(is_wrapped(m) for m in model.modules()):
        return "modules tuned by torch-tweak are installed in the model"
    if model.training:
        return "the model is in train mode (call model.eval())"
    return _config_problem(model, family) or _module_problem(model, family) or _hook_problem(model)


def _layer(layer: nn.Module, where: str) -> Layer | str:
    a, m = layer.self_attn, layer.mlp
    qkv, mlp = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
    problem_ = _linears(qkv, f"{where} q/k/v") or _linears([a.o_proj], f"{where} o") or \
        _linears(mlp, f"{where} gate/up") or _linears([m.down_proj], f"{where} down")
    if problem_ is not None:
        return problem_
    heads = a.q_proj.weight.shape[0] // a.head_dim
    kv = a.k_proj.weight.shape[0] // a.head_dim
    if heads % kv or a.head_dim % 2:
        return f"{where}: {heads} query heads over {kv} key/value heads of {a.head_dim}"
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)

    def biases(mods: list) -> tuple | None:
        return None if mods[0].bias is None else tuple(x.bias for x in mods)

    norm_eps = layer.input_layernorm.variance_epsilon
    return Layer(
        Product(tuple(x.weight for x in qkv), biases(qkv), layer.input_layernorm.weight, norm_eps),
        Attention(heads, kv, a.head_dim, float(a.scaling), None if q_norm is None else q_norm.weight,
                  None if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.variance_epsilon),
        Product((a.o_proj.weight,), biases([a.o_proj]), residual=True),
        Product(tuple(x.weight for x in mlp), biases(mlp), layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon),
        Product((m.down_proj.weight,), biases([m.down_proj]), glu=True, residual=True))


class FusedDecoder:
    """A served model read for tweak's own decode step (module docs). Make one with `of`."""

    def __init__(self, model: nn.Module, layers: list[Layer], final: Product) -> None:
        self.model = model
        self.layers = layers
        self.final = final
        self.embed = model.get_input_embeddings().weight
        self.rotary = model.model.rotary_emb
        self.weight_dtype = self.embed.dtype
        self.weight_device = self.embed.device
        self.vocab = int(final.weights[0].shape[0])
        self.weights = weights_of(model)  # what the step reads of the model, by address
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._steps: "weakref.WeakKeyDictionary[Any, dict[str, Step]]" = weakref.WeakKeyDictionary()
        self._compiled: dict[tuple, Any] = {}  # Inductor's step per options (Step.compile)

    @classmethod
    def of(cls, model: nn.Module) -> "FusedDecoder | str":
        """The model read for the step, or why it is not served (its family, settings or modules)."""
        found = problem(model)
        if found is not None:
            return found
        layers = []
        for i, layer in enumerate(model.model.layers):
            read = _layer(layer, f"layer {i}")
            if isinstance(read, str):
                return read
            layers.append(read)
        head, norm = model.get_output_embeddings(), model.model.norm
        problem_ = _linears([head], "the output projection")
        if problem_ is None and head.bias is not None:
            problem_ = "an output projection with a bias"
        params = list(model.parameters())
        if problem_ is None and len({(t.device, t.dtype) for t in params}) != 1:
            problem_ = "weights on several devices or of several dtypes"
        if problem_ is None and any(t.device.type == "meta" or not _plain_weight(t) for t in params):
            problem_ = "weights on the meta device, or not plain contiguous tensors"
        if problem_ is not None:
            return problem_
        return cls(model, layers, Product((head.weight,), None, norm.weight, norm.variance_epsilon))

    def device_problem(self, device: torch.device) -> str | None:
        """Why a call's inputs on `device` are not served (the weights are elsewhere), or None."""
        if device != self.weight_device:
            return f"inputs on {device}, the model's weights on {self.weight_device}"
        return None

    def vocab_size(self) -> int:
        return self.vocab

    def moved(self) -> bool:
        """Whether a weight was replaced or moved since the model was read (read it again)."""
        return weights_moved(self.weights)

    def table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([length, head_dim], the model's dtype) for positions 0..length-1, from the
        model's own rotary module; its state (a dynamic rope's frequencies) put back after."""
        key = (length, str(device))
        with _LOCK:  # a dynamic rope's module changes while its table is made
            return self._table(key, length, device)

    def _table(self, key: tuple, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._tables:
            x = torch.zeros(1, dtype=self.weight_dtype, device=device)
            state = snapshot(self.rotary)
            try:
                with torch.no_grad():
                    if getattr(self.rotary, "rope_type", "default") in DYNAMIC_ROPE:
                        parts = [self.rotary(x, torch.tensor([[p]], device=device)) for p in range(length)]
                        cos, sin = torch.cat([c for c, _ in parts], 1), torch.cat([s for _, s in parts], 1)
                    else:
                        cos, sin = self.rotary(x, torch.arange(length, device=device)[None])
            finally:
                state.restore()
            self._tables[key] = (cos[0].contiguous(), sin[0].contiguous())
        return self._tables[key]

    def cache(self, batch: int, length: int) -> Any:
        """A transformers StaticCache of `length` positions for a batch of `batch` rows: its
        bucket's rows, on the model's device, laid out before any prefill."""
        from transformers import StaticCache

        rows = bucket(batch)
        if rows is None or batch < 1:
            raise ValueError(f"a batch of {batch}: the fused step serves 1 to {settings.FUSED_BUCKETS[-1]} rows")
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        a = self.layers[0].attention
        early = getattr(cache, "early_initialization", None)
        if callable(early):  # else the prefill lays it out
            early(rows, a.kv_heads, a.head_dim, self.weight_dtype, self.weight_device)
        return cache

    def prefill(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The prompt `ids` ([batch, length], no padding) through the model's own forward into
        `cache` (emptied first; the rows past the batch get token 0); the last position's
        logits of the batch's rows ([batch, vocab])."""
        rows = _cache_rows(cache)
        if ids.shape[0] > rows:
            raise ValueError(f"a batch of {ids.shape[0]} rows for a cache of {rows}")
        padded = ids.new_zeros(rows, ids.shape[1])
        padded[:ids.shape[0]] = ids
        cache.reset()
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(rows, -1)
        with torch.no_grad():
            out = self.model(input_ids=padded, position_ids=positions, use_cache=True, **{name: cache})
        return out.logits[:ids.shape[0], -1]

    def runner(self, cache: Any, kernels: str = "torch") -> "Step":
        """The step's work on `cache` (made at its first use) with the kernels called `kernels`:
        "torch" (torch ops: on CUDA cuBLAS's products), "inductor" (the same ops compiled by
        Inductor with coordinate descent tuning: Step.compile) or "triton" (fused_triton.py's)."""
        with _LOCK:
            return self._runner(cache, kernels)

    def _runner(self, cache: Any, kernels: str) -> "Step":
        per_cache = self._steps.setdefault(cache, {})
        if kernels not in per_cache:
            step = Step(self, cache, "torch" if kernels == "inductor" else kernels)
            if kernels == "inductor":
                step.compile()
            per_cache[kernels] = step
        return per_cache[kernels]

    def step(self, tokens: torch.Tensor, position: torch.Tensor, cache: Any, kernels: str = "torch") -> torch.Tensor:
        """One decode step (module docs): the logits of `tokens` ([batch] int64) at `position`."""
        return self.runner(cache, kernels)(tokens, position)


def _cache_rows(cache: Any) -> int:
    layer = cache.layers[0]
    keys = getattr(layer, "keys", None)
    return int(keys.shape[0]) if isinstance(keys, torch.Tensor) else 0


def cache_problem(decoder: FusedDecoder, cache: Any) -> str | None:
    """Why the step cannot run on `cache`, or None: a StaticCache laid out for the model."""
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "StaticCache" or layers is None or len(layers) != len(decoder.layers):
        return f"a {type(cache).__name__} (a transformers StaticCache of {len(decoder.layers)} layers is served)"
    for i, (layer, spec) in enumerate(zip(layers, decoder.layers)):
        if type(layer).__name__ != "StaticLayer":
            return f"cache layer {i} is a {type(layer).__name__} (a StaticLayer is served)"
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return f"cache layer {i} is not laid out yet (make it with decoder.cache, or prefill it)"
        a = spec.attention
        rows = keys.shape[0]
        shape = (rows, a.kv_heads, keys.shape[2], a.head_dim)
        if bucket(rows) != rows or tuple(keys.shape) != shape or tuple(values.shape) != shape or \
                keys.dtype != decoder.weight_dtype or values.dtype != decoder.weight_dtype or keys.device != decoder.weight_device or \
                not keys.is_contiguous() or not values.is_contiguous():
            return f"cache layer {i} holds {tuple(keys.shape)} {keys.dtype} on {keys.device}, not a bucket of {shape}"
    return None


class Step:
    """The decode step's work on one cache (module docs): buffers, tables, kernels."""

    def __init__(self, decoder: FusedDecoder, cache: Any, kernels: str) -> None:
        found = cache_problem(decoder, cache)
        if found is not None:
            raise ValueError(found)
        if decoder.moved():
            raise ValueError("a weight of the model was replaced or moved since it was read: read it again")
        self.decoder = decoder
        self.kernels = make_kernels(kernels, decoder.weight_device)
        keys = cache.layers[0].keys
        self.rows, self.length = int(keys.shape[0]), int(keys.shape[2])
        dev, dt, a = decoder.weight_device, decoder.weight_dtype, decoder.layers[0].attention
        self.tokens = torch.zeros(self.rows, dtype=torch.int64, device=dev)
        self.position = torch.zeros((), dtype=torch.int64, device=dev)
        hidden = decoder.embed.shape[1]
        self.hidden = torch.zeros(self.rows, hidden, dtype=dt, device=dev)
        self.qkv = torch.zeros(self.rows, decoder.layers[0].qkv.n, dtype=dt, device=dev)
        self.attn = torch.zeros(self.rows, a.heads * a.head_dim, dtype=dt, device=dev)
        self.gate_up = torch.zeros(self.rows, decoder.layers[0].gate_up.n, dtype=dt, device=dev)
        self.logits = torch.zeros(self.rows, decoder.vocab, dtype=dt, device=dev)
        self.cos, self.sin = decoder.table(self.length, dev)
        self.caches = [(layer.keys, layer.values, _length_of(layer)) for layer in cache.layers]
        self.compiled_step: Any = None
        self._prepare()

    @torch.no_grad()
    def _prepare(self) -> None:
        """The kernels' choices for every shape (the layers of one shape measured together), on
        scratch buffers, before any step runs."""
        jobs: list[tuple] = []
        for layer, (keys, values, _) in zip(self.decoder.layers, self.caches):
            jobs += [(layer.qkv, self.hidden, self.qkv),
                     (layer.attention, self.qkv, self.attn, keys, values, self.cos, self.sin, self.position, None),
                     (layer.o, self.attn, self.hidden), (layer.gate_up, self.hidden, self.gate_up),
                     (layer.down, self.gate_up, self.hidden)]
        jobs.append((self.decoder.final, self.hidden, self.logits))
        self.kernels.prepare_all(jobs)

    def buffers(self) -> tuple:
        """What a step reads and writes besides the model's weights, in run_step's order."""
        return (self.tokens, self.position, self.hidden, self.qkv, self.attn, self.gate_up, self.logits, self.cos,
                self.sin, self.caches)

    @torch.no_grad()
    def forward(self) -> torch.Tensor:
        """One step from the `tokens` and `position` buffers; returns the `logits` buffer."""
        if self.compiled_step is not None:
            return self.compiled_step(*self.buffers())
        return run_step(self.kernels, self.decoder, *self.buffers())

    def compile(self, **options: Any) -> None:
        """The torch ops' step compiled by Inductor: coordinate descent tuning unless `options` say
        otherwise, Inductor's own device graphs off (the caller records the step), static shapes.
        One compiled function per decoder and options: the steps of other caches of the same
        shapes reuse its compile (the buffers are its arguments)."""
        if self.kernels.name != "torch":
            raise ValueError("only the torch ops' step is compiled")
        settings = {"coordinate_descent_tuning": True, "triton.cudagraphs": False, **options}
        key = tuple(sorted(settings.items()))
        compiled = self.decoder._compiled.get(key)
        if compiled is None:
            decoder, kernels = self.decoder, self.kernels

            def traced(*buffers: Any) -> torch.Tensor:
                return run_step(kernels, decoder, *buffers, tracing=True)

            compiled = self.decoder._compiled[key] = torch.compile(traced, fullgraph=True, dynamic=False,
                                                                   options=settings)
        self.compiled_step = compiled

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The logits ([batch, vocab]) of `tokens` ([batch] int64, batch <= the bucket) at
        `position` (0-d int64): a view of the step's buffer, written over by the next step."""
        batch = tokens.shape[0]
        if tokens.dim() != 1 or not 1 <= batch <= self.rows:
            raise ValueError(f"tokens of shape {tuple(tokens.shape)}: a [batch] tensor of 1 to {self.rows} rows")
        if position.device.type == "cpu" and not 0 <= int(position) < self.length:  # on a device: not read
            raise ValueError(f"position {int(position)} of a cache of {self.length} positions")
        self.tokens[:batch].copy_(tokens)
        self.position.copy_(position)
        return self.forward()[:batch]


def run_step(k: Any, decoder: FusedDecoder, tokens: torch.Tensor, position: torch.Tensor, hidden: torch.Tensor,
             qkv: torch.Tensor, attn: torch.Tensor, gate_up: torch.Tensor, logits: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, caches: list, tracing: bool = False) -> torch.Tensor:
    """One decode step (the module's docs) with the kernels `k` on these buffers."""
    if tracing:  # Inductor: index_select's out= is not traced
        hidden.copy_(decoder.embed[tokens])
    else:
        torch.index_select(decoder.embed, 0, tokens, out=hidden)
    for layer, (keys, values, length) in zip(decoder.layers, caches):
        k.product(layer.qkv, hidden, qkv)
        k.attention(layer.attention, qkv, attn, keys, values, cos, sin, position, length)
        k.product(layer.o, attn, hidden)
        k.product(layer.gate_up, hidden, gate_up)
        k.product(layer.down, gate_up, hidden)
    k.product(decoder.final, hidden, logits)
    return logits


def _length_of(layer: Any) -> torch.Tensor | None:
    """The cache layer's own count of positions where it keeps one on the device (set to
    position + 1 by each step, so the model's own forward can continue the cache), else None."""
    length = getattr(layer, "cumulative_length", None)
    return length if isinstance(length, torch.Tensor) and length.dim() == 0 else None
