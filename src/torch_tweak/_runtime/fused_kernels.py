"""The two kinds of work of tweak's own decode step (fused_step.py), each in two implementations
behind one interface: torch ops (``TorchKernels``: the CPU path, and on CUDA the cuBLAS
candidate, which Inductor can also compile) and Triton kernels (``TritonKernels``,
fused_triton.py's, on CUDA or under TRITON_INTERPRET=1 on the CPU).

- a **product** (``Product``): x @ W.T (+ bias) for the rows of a batch bucket, with up to three
  weights read by one launch (q/k/v, gate/up), an optional prologue (the RMS norm of x, or
  silu(gate) * up) and an optional residual added;
- the **attention** of one layer (``Attention``): rotary embedding on the new key and the
  queries (after Qwen3's per-head norms), the key and value written into the layer's static
  cache at the position, attention over positions 0..position with grouped key/value heads.

The torch implementation is the model's own arithmetic, op for op (transformers' RMSNorm,
rotate_half, F.linear, SDPA over the cache with a boolean mask), so on the CPU it is the
reference the Triton kernels are checked against. The Triton kernels' block sizes are chosen
per shape on the card by measurement (CUDA events, a short list of configs: ``choose``); under
the interpreter a fixed small config runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass(eq=False)
class Product:
    """One product launch: `weights` (one to three [n_g, k] tensors, contiguous, the model's own)
    read by one launch into consecutive columns of the output; `biases` (one per weight, or
    None); `norm` (the RMS norm's weight applied to x first, with `eps`) or `glu` (x holds
    [gate | up], each k wide: silu(gate) * up is the input); `residual` (the output is the
    residual plus the product, written in place into it)."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor, ...] | None = None
    norm: torch.Tensor | None = None
    eps: float = 1e-6
    glu: bool = False
    residual: bool = False

    @property
    def k(self) -> int:
        return int(self.weights[0].shape[1])

    @property
    def n(self) -> int:
        return sum(int(w.shape[0]) for w in self.weights)


@dataclasses.dataclass(eq=False)
class Attention:
    """One layer's attention: `heads` query heads over `kv_heads` key/value heads of `head_dim`,
    scores scaled by `scale`; Qwen3's per-head norms (`q_norm`, `k_norm` weights, `eps`)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Qwen2, Qwen3, Mistral), op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchKernels:
    """The step's work as torch ops: the model's own arithmetic (module docs)."""

    name = "torch"

    def product(self, p: Product, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = product(x) (out[:, :n] of an output at least n wide; with p.residual, out is also
        the residual)."""
        if p.glu:
            gate, up = x[:, :p.k], x[:, p.k:2 * p.k]
            x = F.silu(gate) * up
        if p.norm is not None:
            x = rms_norm(x, p.norm, p.eps)
        if p.residual:
            out.copy_(out + F.linear(x, p.weights[0], None if p.biases is None else p.biases[0]))
            return
        col = 0
        for i, w in enumerate(p.weights):
            n = int(w.shape[0])
            out[:, col:col + n] = F.linear(x, w, None if p.biases is None else p.biases[i])
            col += n

    def attention(self, a: Attention, qkv: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, length: torch.Tensor | None) -> None:
        """out[b] = attention of row b's queries (qkv[b]: [q | k | v]) over the cache's positions
        0..position, after the new key and value are written at `position`; `length` (the
        cache layer's own count, or None) set to position + 1."""
        batch, d = qkv.shape[0], a.head_dim
        q = qkv[:, :a.heads * d].view(batch, 1, a.heads, d)
        k = qkv[:, a.heads * d:(a.heads + a.kv_heads) * d].view(batch, 1, a.kv_heads, d)
        v = qkv[:, (a.heads + a.kv_heads) * d:].view(batch, 1, a.kv_heads, d).transpose(1, 2)
        if a.q_norm is not None:
            q, k = rms_norm(q, a.q_norm, a.eps), rms_norm(k, a.k_norm, a.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [batch, heads, 1, d]
        where = position.view(1)
        c, s = cos.index_select(0, where)[None, None], sin.index_select(0, where)[None, None]
        q, k = (q * c) + (rotate_half(q) * s), (k * c) + (rotate_half(k) * s)
        keys.index_copy_(2, where, k)
        values.index_copy_(2, where, v)
        if length is not None:
            length.copy_(position + 1)
        groups = a.heads // a.kv_heads
        full = keys.shape[2]
        kk = keys[:, :, None].expand(batch, a.kv_heads, groups, full, d).reshape(batch, a.heads, full, d)
        vv = values[:, :, None].expand(batch, a.kv_heads, groups, full, d).reshape(batch, a.heads, full, d)
        mask = (torch.arange(full, device=qkv.device) <= position).view(1, 1, 1, full)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=a.scale)
        out.copy_(o.transpose(1, 2).reshape(batch, a.heads * d))

    def prepare(self, p: Any, *args: Any) -> None:
        """Nothing to choose: torch picks its own kernels."""


@dataclasses.dataclass(frozen=True)
class Config:
    """A Triton kernel's launch settings: a product's (block_n, block_k, dot) or the
    attention's block_l; and the warps of a program."""

    block_n: int = 0
    block_k: int = 0
    dot: bool = False
    block_l: int = 0
    warps: int = 4


def product_configs(rows: int) -> list[Config]:
    """The configs measured for a product of `rows` rows (one batch bucket) on a card."""
    if rows <= 2:
        return [Config(8, 256), Config(16, 256), Config(16, 512, warps=8), Config(32, 128), Config(32, 256),
                Config(64, 128)]
    plain = [Config(8, 128), Config(16, 128)] if rows >= 8 else [Config(8, 256), Config(16, 128)]
    return plain + [Config(16, 128, True), Config(32, 128, True), Config(64, 64, True), Config(32, 256, True, warps=8)]


ATTENTION_CONFIGS = [Config(block_l=16, warps=2), Config(block_l=32, warps=4), Config(block_l=64, warps=4)]
"""The attention kernel's configs measured on a card."""


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` here, or None."""
    try:
        from . import fused_triton
    except Exception as exc:  # a broken install
        return f"Triton could not be imported ({type(exc).__name__}: {exc})"
    if fused_triton.triton is None:
        return "Triton is not installed"
    if device.type != "cuda" and not fused_triton.INTERPRETED:
        return "Triton kernels run on CUDA (or on the CPU where TRITON_INTERPRET=1 was set before their first use)"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _fixed(key: tuple) -> Config:
    """The config under the interpreter: large blocks (the interpreter's time goes by programs
    and operations, not by bytes), and the dot path for buckets of 4 and more, so both paths
    run. (fused_kernels' tests run every kernel with small blocks too.)"""
    if key[0] == "attention":
        return Config(block_l=64)
    return Config(64, 128, key[1] >= 4)


def _interpreted() -> bool:
    from . import fused_triton

    return fused_triton.INTERPRETED


CHOSEN: dict[tuple, Config] = {}
"""The config measured best per card and shape, for the process (a second decoder of the same
shapes measures nothing)."""


def choose(key: tuple, configs: list[Config], launch: Callable[[Config], None], device: torch.device) -> Config:
    """The fastest of `configs` for one kernel shape (`key`), timed with CUDA events on scratch
    buffers (`launch` runs one config): 3 warm-up launches, then the median of 5 rounds of 10.
    A config that does not build or run on the card (too many registers) is skipped."""
    if device.type != "cuda" or _interpreted():
        return _fixed(key)
    full = (torch.cuda.get_device_name(device),) + key
    if full in CHOSEN:
        return CHOSEN[full]
    best, best_ms = None, float("inf")
    for config in configs:
        try:
            ms = _time(lambda: launch(config), device)
        except Exception:  # out of resources for this card: not a candidate
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise RuntimeError(f"no Triton config ran for {key}")
    CHOSEN[full] = best
    return best


def _time(fn: Callable[[], None], device: torch.device) -> float:
    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        rounds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / 10)
    return sorted(rounds)[len(rounds) // 2]


class TritonKernels:
    """The step's work as fused_triton.py's kernels. `prepare` chooses each shape's config
    before any step runs (it launches on scratch buffers, never the caller's); a step then only
    launches, so it can be recorded in a device graph."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        problem = triton_problem(device)
        if problem is not None:
            raise RuntimeError(problem)
        from . import fused_triton

        self.k = fused_triton
        self.configs: dict[int, Config] = {}  # id(spec) x rows -> config

    def prepare(self, spec: Any, x: torch.Tensor, out: torch.Tensor, *attention: Any) -> None:
        """Chooses the config of `spec` for these buffers' rows (on scratch copies)."""
        rows = x.shape[0]
        if isinstance(spec, Product):
            key = ("product", rows, spec.n, spec.k, len(spec.weights), spec.norm is not None, spec.glu,
                   spec.residual, spec.biases is not None, str(x.dtype))
            xs, outs = x.clone(), out.clone()
            chosen = choose(key, product_configs(rows), lambda c: self._product(spec, xs, outs, c), x.device)
        else:
            keys, values, cos, sin, position, _ = attention
            key = ("attention", rows, spec.heads, spec.kv_heads, spec.head_dim, keys.shape[2], str(x.dtype))
            scratch = (keys.clone(), values.clone(), cos, sin, position.clone(), None)
            outs = out.clone()
            chosen = choose(key, ATTENTION_CONFIGS, lambda c: self._attention(spec, x, outs, *scratch, c), x.device)
        self.configs[(id(spec), rows)] = chosen

    def _config(self, spec: Any, rows: int) -> Config:
        found = self.configs.get((id(spec), rows))
        return found if found is not None else _fixed(("product" if isinstance(spec, Product) else "attention", rows))

    def product(self, p: Product, x: torch.Tensor, out: torch.Tensor) -> None:
        self._product(p, x, out, self._config(p, x.shape[0]))

    def attention(self, a: Attention, qkv: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, length: torch.Tensor | None) -> None:
        self._attention(a, qkv, out, keys, values, cos, sin, position, length, self._config(a, qkv.shape[0]))

    def _product(self, p: Product, x: torch.Tensor, out: torch.Tensor, c: Config) -> None:
        rows = x.shape[0]
        ws = list(p.weights) + [p.weights[0]] * (3 - len(p.weights))
        bs = list(p.biases) + [p.biases[0]] * (3 - len(p.biases)) if p.biases is not None else ws
        ns = [int(w.shape[0]) for w in ws]
        blocks = [-(-n // c.block_n) for n in ns[:len(p.weights)]]
        precision = "ieee" if x.dtype == torch.float32 else None
        self.k.product_kernel[(sum(blocks),)](
            x, x.stride(0), p.norm if p.norm is not None else x, p.eps, *ws, *bs, *ns, blocks[0],
            blocks[1] if len(blocks) > 1 else 0, out, out.stride(0), out, out.stride(0), rows, K=p.k,
            GROUPS=len(p.weights), NORM=p.norm is not None, GLU=p.glu, RESIDUAL=p.residual,
            BIAS=p.biases is not None, DOT=c.dot, PRECISION=precision, UPCAST=self.k.INTERPRETED,
            BLOCK_M=max(16, _pow2(rows)) if c.dot else _pow2(rows), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            num_warps=c.warps)

    def _attention(self, a: Attention, qkv: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                   length: torch.Tensor | None, c: Config) -> None:
        batch = qkv.shape[0]
        groups = a.heads // a.kv_heads
        qn = a.q_norm if a.q_norm is not None else qkv
        kn = a.k_norm if a.k_norm is not None else qkv
        self.k.attention_kernel[(batch * a.kv_heads,)](
            qkv, qkv.stride(0), cos, sin, position, keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), qn, kn, a.eps, a.scale,
            length if length is not None else position, out, out.stride(0), H=a.heads, KV=a.kv_heads, G=groups,
            D=a.head_dim, L=keys.shape[2], QK_NORM=a.q_norm is not None, LENGTH=length is not None,
            BLOCK_G=_pow2(groups), BLOCK_D=_pow2(a.head_dim), BLOCK_L=c.block_l, num_warps=c.warps)


TORCH = TorchKernels()
"""The torch ops (stateless: one for every step, so Inductor's compile of one serves all)."""


def kernels(name: str, device: torch.device) -> TorchKernels | TritonKernels:
    """The implementation called `name` ("torch" or "triton") for `device`; raises RuntimeError
    with the reason where Triton cannot run."""
    if name == "torch":
        return TORCH
    if name == "triton":
        return TritonKernels(device)
    raise ValueError(f"kernels must be 'torch' or 'triton', not {name!r}")
