"""The engine's callbacks for one tweak (enter, activate, deactivate and leave a cut; the
module search's are tuning.ModuleSearch's) and the engine's log lines."""

from __future__ import annotations

import logging

import torch
from torch import nn

from .. import _C
from .._runtime.inspecting import ModuleTree
from .._runtime.module import TunedModule, install, make_wrapper, uninstall
from .._view.progress import Progress
from .._view.report import ModuleResults, module_result
from ..backends.strategy import Strategy, default_strategy
from .tuning import ModuleSearch, absorb, model_class_name, record, release

logger = logging.getLogger("torch_tweak")


def engine_log(level: int, text: str) -> None:
    """The engine's lines: per-depth results at INFO, a depth skipped or not kept at WARNING."""
    logger.log(logging.WARNING if level else logging.INFO, text)


class Session:
    """The engine's callbacks for one tweak: enter, activate and leave a cut; the module
    search's are ``search`` (tuning.ModuleSearch)."""

    def __init__(self, model: nn.Module, tree: ModuleTree, run_dataset, strategy: Strategy | None,
                 device: torch.device, measure: dict | None, progress: Progress, depths: list[int]) -> None:
        self.model = model
        self.tree = tree
        self.run_dataset = run_dataset
        self.strategy = strategy
        self.device = device
        self.measure = measure
        self.progress = progress
        self.depths = depths
        self.wrappers: dict[int, TunedModule] = {}
        self.entered: list[int] = []
        self.shown: set[int] = set()
        self.depth = -1
        self.measuring = False  # a depth's end-to-end measurement was announced
        self.applied = False    # the kept depth is entered again: what follows is the confirmation
        self.model_class = model_class_name(model)
        self.on_measure = None  # called with the depth before its first measurement (a workload's TTFT)
        self.refuse = ""  # why no depth can be tuned (each is then skipped with it)
        self.run_edges = None  # runs the calls at the declared shapes' ends (tt.tweak's shapes=)
        self.search = ModuleSearch(lambda node: self.wrappers[node],
                                   lambda node: strategy if strategy is not None else default_strategy(device),
                                   device, progress, self.model_class, done=self.tuned)

    def enter(self, nodes: list[int], tune: list[bool]) -> None:
        depth = max(self.tree.tree.depth(n) for n in nodes) if nodes else 0
        self.depth = depth
        self.progress.end_phase()
        if depth in self.shown:
            self.applied = True
        else:
            self.shown.add(depth)
            position = self.depths.index(depth) + 1 if depth in self.depths else len(self.depths)
            self.progress.start_depth(depth, position, len(self.depths), len(nodes), sum(tune))
        if self.refuse:
            raise RuntimeError(self.refuse)
        try:
            for node in nodes:
                wrapper = self.wrappers.get(node)
                if wrapper is None:
                    wrapper = make_wrapper(self.model, self.tree.tree.path(node))
                    self.wrappers[node] = wrapper
                install(self.model, wrapper)
                self.entered.append(node)
            fresh = [self.wrappers[n] for n, t in zip(nodes, tune) if t]
            if fresh:
                self.progress.step("", f"recording {len(fresh)} modules")
                record(fresh, self.run_dataset, self.run_edges, self.model)
        except BaseException:
            self.leave()
            raise

    def tuned(self, node: int) -> None:
        """The engine's search of this module is done (ModuleSearch.done)."""
        wrapper = self.wrappers[node]
        release(wrapper)
        chosen = wrapper.tt_backend.name if wrapper.tt_backend is not None else None
        self.progress.finish_module(wrapper.tt_name, f"chose {chosen}" if chosen else "keeps its forward")

    def activate(self) -> None:
        first = not self.applied and not self.measuring
        if first:
            self.measuring = True
            self.progress.phase(f"depth {self.depth}: measuring the whole model")
        for node in self.entered:
            self.wrappers[node].tt_activate()
        if first and self.on_measure is not None:
            self.on_measure(self.depth)

    def deactivate(self) -> None:
        """The entered cut back to the original forward, still wrapped: the untuned side of
        the engine's side-by-side confirmation."""
        if not self.measuring:
            self.measuring = True
            self.progress.phase(f"depth {self.depth}: measuring it side by side with the untuned model")
        for node in self.entered:
            self.wrappers[node].tt_deactivate()

    def leave(self) -> None:
        self.measuring = False
        self.progress.end_phase()
        for node in reversed(self.entered):
            uninstall(self.model, self.wrappers[node])
        self.entered.clear()

    def module_results(self, engine: "_C.Result", kept_depth: int | None) -> ModuleResults:
        """The engine's result per module, read into the wrappers (see tuning.absorb) and into
        the ModuleResults the user reads."""
        results = ModuleResults()
        results.kept_depth = kept_depth
        for report in engine.modules:
            node = report["node"]
            wrapper = self.wrappers[node]
            absorb(wrapper, report)
            signatures = [(g.text, g.key, g.report, g.unstorable) for g in wrapper.tt_signatures]
            results[wrapper.tt_name] = module_result(report, signatures)
        return results
