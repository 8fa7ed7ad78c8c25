"""A backend whose isolated build hangs forever (a deadlock in a thread pool, as far as anyone can
tell), importable by a spawned child. The tuning process sets $TT_HANG_PARENT to its pid; there
the build returns the module as it is."""

from __future__ import annotations

import os
import time

from torch_tweak.backends import Backend


class Hangs(Backend):
    name = "Hangs"
    isolate_build = True

    def build(self, module, samples, device):
        if str(os.getpid()) != os.environ.get("TT_HANG_PARENT"):
            while True:
                time.sleep(1)
        return module
