"""The Triton kernels of tweak's own decode step (fused_triton.py), each checked on the CPU under
Triton's interpreter against its torch reference (fused_kernels.TorchKernels: the model's own
arithmetic): the grouped product with its prologues and epilogue, at every batch bucket, both
inner paths (tl.dot on rows padded to 16, and the broadcast sum), blocks that do not divide the
shapes; the attention with grouped heads (a group of 3, not a power of two), Qwen3's per-head
norms, the first and last positions of the cache. Skipped where Triton is not installed
(scripts/setup.sh installs it for the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from torch_tweak._runtime import fused_kernels, fused_triton
from torch_tweak._runtime.fused_kernels import Attention, Config, Product, TorchKernels

needs_triton = pytest.mark.skipif(fused_triton.triton is None,
                                  reason="Triton is not installed (scripts/setup.sh installs it for the CPU)")


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernels run: compiled on CUDA, else under Triton's interpreter on the CPU."""


def interpreted():
    """fused_triton's kernels: on a machine without CUDA, made for Triton's interpreter (conftest.py
    sets TRITON_INTERPRET=1 before anything imports Triton)."""
    if DEVICE.type == "cpu" and not fused_triton.INTERPRETED:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set (conftest.py sets it)")
    return fused_kernels.TritonKernels(DEVICE)


@pytest.fixture(scope="module")
def triton_kernels():
    return interpreted()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few units in the last place of the dtype: the kernels round once where the
    model rounds after each op, and sum in another order."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def weights(n: tuple[int, ...], k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ws = tuple((torch.randn(m, k, generator=g) / k ** 0.5).to(DEVICE, dtype) for m in n)
    bs = tuple(torch.randn(m, generator=g).to(DEVICE, dtype) for m in n) if bias else None
    return ws, bs


PRODUCTS = {
    "qkv": dict(n=(48, 24, 24), norm=True, bias=True),  # Qwen2's: norm, three weights with biases
    "o": dict(n=(40,), residual=True),
    "gate_up": dict(n=(56, 56), norm=True),
    "down": dict(n=(40,), glu=True, residual=True),
    "lm_head": dict(n=(100,), norm=True),
}


SLOW = pytest.mark.slow  # the interpreter takes a second or more per case: one case per kernel runs fast


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SLOW)])
@pytest.mark.parametrize("config", [Config(16, 32), pytest.param(Config(32, 64, True), marks=SLOW)])
@pytest.mark.parametrize("kind", ["qkv", *(pytest.param(k, marks=SLOW) for k in ("o", "gate_up", "down", "lm_head"))])
def test_each_product_is_its_torch_reference(triton_kernels, kind, config, dtype):
    """K = 72 (not a multiple of either block: 3 and 2 blocks), rows 1, 3 (bucket 4) and 8; the
    broadcast sum (blocks of 16 x 32) and tl.dot on rows padded to 16 (32 x 64)."""
    spec = PRODUCTS[kind]
    k = 72
    ws, bs = weights(spec["n"], k, dtype, spec.get("bias", False))
    g = torch.Generator().manual_seed(1)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    p = Product(ws, bs, norm if spec.get("norm") else None, 1e-5, spec.get("glu", False), spec.get("residual", False))
    for rows in (1, 3, 8):
        x = torch.randn(rows, 2 * k if p.glu else k, generator=g).to(DEVICE, dtype)
        start = torch.randn(rows, p.n, generator=g).to(DEVICE, dtype)
        want, got = start.clone(), start.clone()
        TorchKernels().product(p, x, want)
        triton_kernels._product(p, x, got, config)
        close(got, want, dtype)


ATTENTION = {
    "llama": dict(heads=4, kv=2, d=16),
    "mha": dict(heads=2, kv=2, d=16),
    "group_of_3": dict(heads=6, kv=2, d=8),  # Qwen2.5-0.5B's 7 per group: not a power of two
    "qwen3": dict(heads=4, kv=2, d=16, norm=True),
}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SLOW)])
@pytest.mark.parametrize("kind", ["group_of_3", *(pytest.param(k, marks=SLOW) for k in ("llama", "mha", "qwen3"))])
def test_the_attention_is_its_torch_reference(triton_kernels, kind, dtype):
    """Rotary, the cache write, the attention and the layer's count at positions 0, 7 and 20
    (the last) of a 21-position cache, with blocks of 16 (two blocks, the second cut short)."""
    spec = ATTENTION[kind]
    g = torch.Generator().manual_seed(2)
    h, kv, d, length, rows = spec["heads"], spec["kv"], spec["d"], 21, 3
    norms = [(1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2)] if spec.get("norm") \
        else [None, None]
    a = Attention(h, kv, d, d ** -0.5, norms[0], norms[1], 1e-6)
    angle = torch.arange(length)[:, None] * (1e-2 ** (torch.arange(d // 2) / (d // 2)))[None]
    cos, sin = (torch.cat([f(angle)] * 2, 1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    for position in (0, 7, length - 1):
        qkv = torch.randn(rows, (h + 2 * kv) * d, generator=g).to(DEVICE, dtype)
        keys = torch.randn(rows, kv, length, d, generator=g).to(DEVICE, dtype)
        values = torch.randn(rows, kv, length, d, generator=g).to(DEVICE, dtype)
        zero = torch.zeros(rows, h * d, dtype=dtype, device=DEVICE)
        mine = [keys.clone(), values.clone(), zero.clone(), torch.tensor(0, device=DEVICE)]
        theirs = [keys.clone(), values.clone(), zero.clone(), torch.tensor(0, device=DEVICE)]
        pos = torch.tensor(position, device=DEVICE)
        TorchKernels().attention(a, qkv, theirs[2], theirs[0], theirs[1], cos, sin, pos, theirs[3])
        triton_kernels._attention(a, qkv, mine[2], mine[0], mine[1], cos, sin, pos, mine[3], Config(block_l=16))
        close(mine[0], theirs[0], dtype)  # the new key (rotated) written at the position, nothing else
        assert torch.equal(mine[1], theirs[1])  # the value as it is
        close(mine[2], theirs[2], dtype)
        assert int(mine[3]) == int(theirs[3]) == position + 1


@needs_triton
def test_the_triton_kernels_refuse_the_cpu_without_the_interpreter(monkeypatch, triton_kernels):
    monkeypatch.setattr(fused_triton, "INTERPRETED", False)
    problem = fused_kernels.triton_problem(torch.device("cpu"))
    assert problem is not None and "TRITON_INTERPRET=1" in problem
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_kernels.kernels("triton", torch.device("cpu"))


def test_without_triton_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(fused_triton, "triton", None)
    assert fused_kernels.triton_problem(torch.device("cuda")) == "Triton is not installed"
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        fused_kernels.kernels("cublas", torch.device("cpu"))


def test_the_configs_measured_on_a_card_are_a_short_list():
    """Every bucket gets a few configs, the larger buckets both inner paths."""
    for rows in (1, 2, 4, 8):
        configs = fused_kernels.product_configs(rows)
        assert 4 <= len(configs) <= 8
        assert any(c.dot for c in configs) == (rows >= 4)


@needs_triton
def test_a_position_past_the_cache_writes_nothing_of_it(triton_kernels):
    """No read of the device checks a position on CUDA: the kernel masks its writes instead."""
    g = torch.Generator().manual_seed(5)
    a = Attention(4, 2, 16, 0.25)
    qkv = torch.randn(1, 8 * 16, generator=g).to(DEVICE)
    keys, values = (torch.randn(1, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))
    before = keys.clone(), values.clone()
    cos, sin = torch.ones(8, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE)
    triton_kernels._attention(a, qkv, torch.zeros(1, 64, device=DEVICE), keys, values, cos, sin,
                              torch.tensor(8, device=DEVICE), None, Config(block_l=16))
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])


@needs_triton
@pytest.mark.slow  # about fifty compiles
def test_the_kernels_compile_for_an_h100_without_one():
    """tests/fused_compile.py in a child process without TRITON_INTERPRET: every variant the step
    launches on the Llama-1B and Qwen2.5-0.5B shapes, and every config measured, compiled by this
    Triton for sm_90 down to a cubin (the interpreter checks what they compute, not that the
    compiler takes them)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("fused_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "for sm_90" in done.stdout
