"""Model factories the command-line tests build models from."""

import torch
from torch import nn


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def not_a_module():
    return 42


def exits():
    import sys

    sys.exit(0)
