"""Lines other packages print because of a call of ours and that tell the user nothing.

Each is dropped only while our call runs, only on the logger that prints it, and only when
its text says it is that line: anything else those packages say still shows.

- transformers: ``torch.jit.trace`` (OpenVINO's conversion) reads every attribute of a
  module it traces, and reading ``loss_function`` of a transformers model logs
  "`loss_type=None` was set in the config but it is unrecognized" once per process: no
  loss is computed, so the line is about nothing the user did.

A backend's own file keeps the lines of its packages (backends/torchao.py: TORCHAO_IMPORT,
backends/onnxruntime.py: ONNX_EXPORT) and drops them with ``dropped`` here.

And advice other packages give in an error that a message of ours passes on (without_advice):
torch's functional_call, refusing a model whose weights are tied, ends "Consider using
tie_weights=False", its own argument, which a user reads as advice to untie the model.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

TIED_ADVICE = re.compile(r"\.?\s*Consider using tie_weights=False\.?")
TIED_MEANING = ("; the model's weights are tied (one tensor under two names), as its checkpoint has them: "
                "nothing to change, the fixed rule checks this signature instead")


def without_advice(text: str) -> str:
    """`text` (an error of another package that a message of ours passes on) without advice that
    is not the user's to take: torch's "Consider using tie_weights=False" becomes what it means."""
    if TIED_ADVICE.search(text) is None:
        return text
    return TIED_ADVICE.sub("", text) + TIED_MEANING


class _Drop(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record that cannot format is not ours to judge
            return True
        return not any(fragment in text for fragment in self.fragments)


@contextlib.contextmanager
def dropped(drops: dict[str, tuple[str, ...]]) -> Iterator[None]:
    """Inside the block, {logger name: text fragments}: a record of that logger whose text
    holds one of its fragments is dropped."""
    added = []
    try:
        for name, fragments in drops.items():
            logger, drop = logging.getLogger(name), _Drop(fragments)
            logger.addFilter(drop)
            added.append((logger, drop))
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)


BUILD = {"transformers.modeling_utils": ("`loss_type=",)}
"""What a backend's build makes other packages say (Backend.prepare)."""
