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
reference the Triton kernels are checked against. The Triton kernels' launch settings are
chosen per shape on the card by measurement (fused_tuning.py: a short list of candidates per
shape, compiled at once, timed with CUDA events); under the interpreter a fixed config runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import fused_tuning
from .fused_tuning import Config


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

    def prepare_all(self, jobs: list[tuple]) -> None:
        """Nothing to choose."""


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


def _product_key(p: Product, x: torch.Tensor) -> tuple:
    return ("product", p.n, p.k, len(p.weights), p.norm is not None, p.glu, p.residual, p.biases is not None,
            str(x.dtype))


def _attention_key(a: Attention, x: torch.Tensor, keys: torch.Tensor) -> tuple:
    return ("attention", a.heads, a.kv_heads, a.head_dim, int(keys.shape[2]), str(x.dtype))


class TritonKernels:
    """The step's work as fused_triton.py's kernels. `prepare_all` chooses each shape's config
    before any step runs (fused_tuning.choose: it launches on scratch buffers, never the
    caller's) and makes the split forms' scratch; a step then only launches, so it can be
    recorded in a device graph. One instance per step: the split forms' partial sums and
    counters are its own, shared by the launches of one shape (one after another on a stream)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        problem = triton_problem(device)
        if problem is not None:
            raise RuntimeError(problem)
        from . import fused_triton

        self.k = fused_triton
        self.device = device
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        self.configs: dict[tuple, Config] = {}  # id(spec) x rows -> config
        self.scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.unused = (torch.zeros(1, dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.int32,
                                                                                       device=device))

    def prepare(self, spec: Any, x: torch.Tensor, out: torch.Tensor, *attention: Any) -> None:
        """Chooses the config of `spec` for these buffers' rows (on scratch copies)."""
        self.prepare_all([(spec, x, out, *attention)])

    def prepare_all(self, jobs: list[tuple]) -> None:
        """Chooses the config of each job's spec ((spec, x, out) for a product; (spec, qkv, out,
        keys, values, cos, sin, position, length) for the attention) at its buffers' rows: the
        jobs of one shape (a model's layers) measured together, on scratch copies of the first's
        buffers and each job's own weights."""
        groups: dict[tuple, list[tuple]] = {}
        for job in jobs:
            key = _product_key(job[0], job[1]) if isinstance(job[0], Product) else _attention_key(job[0], job[1],
                                                                                                   job[3])
            groups.setdefault((key, job[1].shape[0]), []).append(job)
        shapes = [self._shape(key, rows, group) for (key, rows), group in groups.items()]
        chosen = fused_tuning.choose(shapes, self.device, self.k.INTERPRETED)
        for group, config in zip(groups.values(), chosen):
            for job in group:
                self.configs[(id(job[0]), job[1].shape[0])] = config
            self._reserve(group[0], config)

    def _shape(self, key: tuple, rows: int, group: list[tuple]) -> fused_tuning.Shape:
        specs = [job[0] for job in group]
        first = group[0]
        if isinstance(first[0], Product):
            p = first[0]
            configs = fused_tuning.product_configs(rows, p.n, p.k, self.sms)

            def make_product() -> Callable[[Config, bool], None]:
                xs, outs = first[1].clone(), first[2].clone()

                def run(c: Config, warm: bool) -> None:
                    for spec in specs[:1] if warm else specs:
                        self._product(spec, xs, outs, c, warm)
                return run
            return fused_tuning.Shape(key, rows, configs, len(specs), make_product)
        a, qkv, out, keys, values, cos, sin, position, _ = first
        configs = fused_tuning.attention_configs(int(keys.shape[2]), rows * a.heads, self.sms)

        def make_attention() -> Callable[[Config, bool], None]:
            middle = torch.full_like(position, keys.shape[2] // 2)  # a call's positions: from its prompt to the end
            scratch = (keys.clone(), values.clone(), cos, sin, middle, None)
            outs = out.clone()

            def run(c: Config, warm: bool) -> None:
                for spec in specs[:1] if warm else specs:
                    self._attention(spec, qkv, outs, *scratch, c, warm)
            return run
        return fused_tuning.Shape(key, rows, configs, len(specs), make_attention)

    def _reserve(self, job: tuple, config: Config) -> None:
        """The split form's scratch for the chosen config, made before any step (not while one
        is recorded)."""
        if config.split > 1:
            if isinstance(job[0], Product):
                self._product_scratch(job[0], job[1].shape[0], config)
            else:
                self._attention_scratch(job[0], job[1].shape[0], config)

    def _config(self, spec: Any, rows: int) -> Config:
        found = self.configs.get((id(spec), rows))
        if found is not None:
            return found
        return fused_tuning.fixed("product" if isinstance(spec, Product) else "attention", rows, self.k.INTERPRETED)

    def product(self, p: Product, x: torch.Tensor, out: torch.Tensor) -> None:
        self._product(p, x, out, self._config(p, x.shape[0]))

    def attention(self, a: Attention, qkv: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor, length: torch.Tensor | None) -> None:
        self._attention(a, qkv, out, keys, values, cos, sin, position, length, self._config(a, qkv.shape[0]))

    def _product_scratch(self, p: Product, rows: int, c: Config) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 partial sums [split, rows, n], int32 counters, one per program of a part: zero
        between launches); the unused pair where the config does not split."""
        if c.split == 1:
            return self.unused
        lanes = 1 if c.dot else rows
        blocks = sum(-(-int(w.shape[0]) // c.block_n) for w in p.weights)
        key = ("product", rows, p.n, c.split, lanes * blocks)
        if key not in self.scratch:
            self.scratch[key] = (torch.empty(c.split, rows, p.n, dtype=torch.float32, device=self.device),
                                 torch.zeros(lanes * blocks, dtype=torch.int32, device=self.device))
        return self.scratch[key]

    def _attention_scratch(self, a: Attention, rows: int, c: Config) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 partials [programs, split, block_d + 2]: a slice's output, max and sum; int32
        counters, one per program); the unused pair where the config does not split."""
        if c.split == 1:
            return self.unused
        programs, width = rows * a.heads, _pow2(a.head_dim) + 2
        key = ("attention", programs, c.split, width)
        if key not in self.scratch:
            self.scratch[key] = (torch.empty(programs, c.split, width, dtype=torch.float32, device=self.device),
                                 torch.zeros(programs, dtype=torch.int32, device=self.device))
        return self.scratch[key]

    def _product(self, p: Product, x: torch.Tensor, out: torch.Tensor, c: Config, warm: bool = False) -> None:
        rows = x.shape[0]
        ws = list(p.weights) + [p.weights[0]] * (3 - len(p.weights))
        bs = list(p.biases) + [p.biases[0]] * (3 - len(p.biases)) if p.biases is not None else ws
        ns = [int(w.shape[0]) for w in ws]
        blocks = [-(-n // c.block_n) for n in ns[:len(p.weights)]]
        parts, counts = self._product_scratch(p, rows, c)
        pstrides = (parts.stride(0), parts.stride(1)) if parts.dim() == 3 else (0, 0)
        grid = (sum(blocks), c.split if c.dot else rows * c.split)
        args = (x, x.stride(0), p.norm if p.norm is not None else x, p.eps, *ws, *bs, *ns, blocks[0],
                blocks[1] if len(blocks) > 1 else 0, out, out.stride(0), out, out.stride(0), parts, *pstrides, counts,
                rows)
        settings = dict(K=p.k, GROUPS=len(p.weights), NORM=p.norm is not None, GLU=p.glu, RESIDUAL=p.residual,
                        BIAS=p.biases is not None, DOT=c.dot, PRECISION="ieee" if x.dtype == torch.float32 else None,
                        UPCAST=self.k.INTERPRETED, BLOCK_M=max(16, _pow2(rows)) if c.dot else 1, BLOCK_N=c.block_n,
                        BLOCK_K=c.block_k, SPLIT=c.split, num_warps=c.warps, **_stages(c))
        self._launch(self.k.product_kernel, grid, args, settings, warm)

    def _attention(self, a: Attention, qkv: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                   length: torch.Tensor | None, c: Config, warm: bool = False) -> None:
        batch = qkv.shape[0]
        parts, counts = self._attention_scratch(a, batch, c)
        args = (qkv, qkv.stride(0), cos, sin, position, keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
                values.stride(0), values.stride(1), values.stride(2), a.q_norm if a.q_norm is not None else qkv,
                a.k_norm if a.k_norm is not None else qkv, a.eps, a.scale,
                length if length is not None else position, out, out.stride(0), parts, counts)
        settings = dict(H=a.heads, KV=a.kv_heads, G=a.heads // a.kv_heads, D=a.head_dim, L=int(keys.shape[2]),
                        QK_NORM=a.q_norm is not None, LENGTH=length is not None, BLOCK_D=_pow2(a.head_dim),
                        BLOCK_L=c.block_l, SPLIT=c.split, RUNTIME=not self.k.INTERPRETED, num_warps=c.warps,
                        **_stages(c))
        self._launch(self.k.attention_kernel, (batch * a.heads, c.split), args, settings, warm)

    @staticmethod
    def _launch(kernel: Any, grid: tuple, args: tuple, settings: dict, warm: bool) -> None:
        if warm:  # compiled (asynchronously under fused_tuning.compile_all), not launched
            kernel.warmup(*args, grid=grid, **settings)
        else:
            kernel[grid](*args, **settings)


def _stages(c: Config) -> dict:
    return {"num_stages": c.stages} if c.stages else {}


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
