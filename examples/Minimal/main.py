"""The smallest tweak: a two-layer MLP on the CPU, tuned with Torch Eager and Torch Inductor."""

import torch
from torch import nn

import torch_tweak as tt

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
dataset = [torch.randn(16, 64) for _ in range(4)]

result = tt.tweak(model, dataset)
print(result)

x = torch.randn(16, 64)
with torch.no_grad():
    y = model(x)  # the tuned model runs as before
print("output", tuple(y.shape), "selected depth", result.selected_depth)
