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


class _Sleepy(nn.Module):
    """10 ms of Python in its forward that a converted model (OpenVINO traces the tensor
    operations) does not run: a gain of about 100x, which no load of the machine hides, so
    the command's save path runs whatever else the machine does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        import time

        time.sleep(0.01)
        return self.body(x)


def sleepy() -> nn.Module:
    torch.manual_seed(0)
    return _Sleepy()
