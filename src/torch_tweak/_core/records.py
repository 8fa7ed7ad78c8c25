"""One record per tuned model: what torch-tweak keeps of it beside the model, in one place.

A Record holds the wrappers installed in the model (by path), the depth its last tweak (or
tt.load) kept, the shapes it declared, the correctness rule it was judged by and, when its kept
figure was measured on a busy machine, what tt.tweak said of it. tt.wrap, tt.tweak, tt.tune and
tt.load write it; tt.status, tt.save (through plan.plan_of), the tuning cache and tt.unwrap read
it. tweak's decode loop is kept on the model itself (its ``generate``), where transformers calls
it.

The records are one weak table keyed by the model, not attributes of it: a model that a tweak
kept untuned has no wrapper, and so copies and pickles as a plain model does (torch.save,
copy.deepcopy), with nothing of torch-tweak in it; a tuned one refuses both in its wrapped
modules' classes (_runtime/module.py: their wrappers, C dispatchers and compiled backends
have no copy). A record lives as long as its model: it goes with it when the model is
collected, and tt.unwrap takes the wrappers out of it, leaving what the last tweak decided
(tt.save of an unwrapped model writes no module).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from .correctness import Rule
from .shapes import Shapes


@dataclasses.dataclass(eq=False)
class Record:
    """What torch-tweak keeps of one tuned model.

    wrappers: {path: TunedModule} of the wrappers installed in it (torch_tweak._runtime.module).
    depth: the depth its last tweak (or tt.load) kept, None when it stayed untuned; decided:
    whether one did (tt.save then writes that outcome, even an untuned one). shapes: the ranges
    tt.tweak's shapes= (or the file) declared for the kept depth. rule: the correctness rule its
    tuning (or tt.load) judged by. busy: the kept figure's outcome when it was measured on a
    busy machine (tt.status shows it), else None."""

    wrappers: dict[str, Any] = dataclasses.field(default_factory=dict)
    depth: int | None = None
    decided: bool = False
    shapes: Shapes | None = None
    rule: Rule = dataclasses.field(default_factory=Rule)
    busy: str | None = None

    def keep(self, depth: int | None, shapes: Shapes | None, rule: Rule) -> None:
        """What a tweak or a load decided: the depth kept, its declared shapes, the rule it was
        judged by."""
        self.depth, self.decided, self.shapes, self.rule = depth, True, shapes, rule


_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, Record]" = weakref.WeakKeyDictionary()
"""model -> its record: the only table keyed by models (tests/test_records.py checks it)."""


def of(model: torch.nn.Module) -> Record | None:
    """The model's record, None when torch-tweak never tuned or wrapped it."""
    return _RECORDS.get(model)


def made(model: torch.nn.Module) -> Record:
    """The model's record, made empty when it has none."""
    found = _RECORDS.get(model)
    if found is None:
        found = _RECORDS[model] = Record()
    return found
