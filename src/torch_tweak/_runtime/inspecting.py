"""tt.inspect: the tree of modules the dataset actually calls."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import _C
from .._core._samples import Call, load_dataset, resolve_device


class ModuleTree:
    """The called modules of a model, with calls and time per module.

    ``print(tree)`` shows it; ``tree.cut(depth)`` gives the paths of a cut;
    ``tree.depths()`` the depths whose cuts are distinct.
    """

    def __init__(self, model: nn.Module, tree: "_C.Tree") -> None:
        self.model = model
        self.tree = tree

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    @property
    def paths(self) -> list[str]:
        return [self.tree.path(i) for i in range(len(self.tree))]

    def depth(self, path: str) -> int:
        index = self.tree.find(path)
        if index < 0:
            raise KeyError(f"{path!r} was not called by the dataset")
        return self.tree.depth(index)

    def cut(self, depth: int) -> list[str]:
        """The paths of the cut at `depth`."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        return [self.tree.path(i) for i in self.tree.cut(depth)]

    def depths(self, min_depth: int = 0, max_depth: int | None = None) -> list[int]:
        """The depths between min_depth and max_depth whose cuts are distinct and not empty."""
        return self.tree.distinct_depths(min_depth, -1 if max_depth is None else max_depth)

    def calls(self, path: str) -> int:
        return self.tree.calls(self.tree.find(path))

    def time_ms(self, path: str) -> float:
        return self.tree.time_ns(self.tree.find(path)) / 1e6

    def __len__(self) -> int:
        return len(self.tree)

    def __str__(self) -> str:
        return self.tree.format()

    def __repr__(self) -> str:
        return f"<ModuleTree of {type(self.model).__name__}: {len(self.tree)} called modules, depth {self.max_depth}>"


def trace(model: nn.Module, calls: Sequence[Call] | None, runner: Callable[[], Any] | None = None) -> "_C.Tree":
    """Runs every call once with hooks on every module; the tree of those that ran.

    A sample the model rejects raises ValueError naming the sample; the hooks are
    removed whatever happens, so the model is left as it was. runner: instead of `calls`,
    a callable that runs the model (a workload, see torch_tweak._runtime.workload). Code the model
    compiles (transformers' compiled forward for a static-cache generate(), say) runs eagerly
    meanwhile: dynamo would trace the hooks into it (a graph break at each) and compile it again.
    """
    names: dict[int, str] = {}
    for path, module in model.named_modules():
        names.setdefault(id(module), path)
    counts: dict[str, list[int]] = {}
    stack: list[int] = []
    handles = []

    def pre(module: nn.Module, args: Any) -> None:
        stack.append(time.perf_counter_ns())

    def post_of(path: str):
        def post(module: nn.Module, args: Any, output: Any) -> None:
            elapsed = time.perf_counter_ns() - stack.pop()
            entry = counts.setdefault(path, [0, 0])
            entry[0] += 1
            entry[1] += elapsed
        return post

    try:
        for path, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule) and path:
                continue
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post_of(path)))
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            if runner is not None:
                try:
                    runner()
                except Exception as exc:
                    raise ValueError(f"the workload failed ({type(exc).__name__}: {exc})") from exc
            for i, (args, kwargs) in enumerate(calls or ()):
                stack.clear()
                try:
                    model(*args, **kwargs)
                except Exception as exc:
                    raise ValueError(
                        f"sample {i} was rejected by the model ({type(exc).__name__}: {exc}); "
                        "check that each sample is one call of model(...) as you make it"
                    ) from exc
    finally:
        for handle in handles:
            handle.remove()
    counts.setdefault("", [len(calls or ()), 0])
    order = [p for p in dict.fromkeys(names.values()) if p in counts]  # the model's own order
    return _C.Tree([(path, counts[path][0], counts[path][1]) for path in order])


def inspect(model: nn.Module, dataset: Any, *, device: Any = None) -> ModuleTree:
    """The tree of modules `dataset` calls in `model`, with calls and time per module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    calls = load_dataset(dataset, resolve_device(model, device))
    return ModuleTree(model, trace(model, calls))
