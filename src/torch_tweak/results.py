"""What torch-tweak's functions return, in one namespace.

    result = tt.tweak(model, dataset)          # tt.results.TweakResult
    result.rows[0]                             # tt.results.DepthResult
    result.modules, result.modules["head"]     # tt.results.ModuleResults, ModuleResult
    result.modules["head"].signatures[0]       # tt.results.SignatureResult
    tt.status(model), tt.status(model)["head"] # tt.results.ModelStatus, ModuleStatus
    tt.inspect(model, dataset)                 # tt.results.ModuleTree
    tt.load(model, path)                       # tt.results.LoadResult (its rebuilt: Rebuilt)

They are returned, never made by a user; name them here for type hints and isinstance checks.
The same names at the top of the package (tt.TweakResult, ...) are aliases kept for one release.
"""

from ._runtime.inspecting import ModuleTree
from ._search.plan import LoadResult, Rebuilt
from ._view.report import ModuleResult, ModuleResults, SignatureResult
from ._view.status import ModelStatus, ModuleStatus
from ._view.result import DepthResult, TweakResult

__all__ = ["DepthResult", "LoadResult", "ModelStatus", "ModuleResult", "ModuleResults", "ModuleStatus",
           "ModuleTree", "Rebuilt", "SignatureResult", "TweakResult"]
