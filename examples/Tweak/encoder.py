"""A four-layer transformer encoder (pre-norm blocks), the model examples/Tweak tunes."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, d_model: int = 256, heads: int = 8, layers: int = 4, hidden: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d_model, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Encoder:
    """The encoder with random weights, in eval mode."""
    torch.manual_seed(seed)
    return Encoder().to(device=device, dtype=dtype).eval()


def samples(device: str = "cpu", dtype: torch.dtype = torch.float32, count: int = 4,
            batch: int = 8, seq: int = 64, d_model: int = 256, seed: int = 1) -> list[torch.Tensor]:
    """`count` random inputs of shape (batch, seq, d_model)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, d_model, generator=generator).to(device=device, dtype=dtype)
            for _ in range(count)]
