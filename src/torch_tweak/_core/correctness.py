"""Whether a candidate's outputs are right: the check every backend and decode loop passes.

A candidate's outputs on the recorded calls must have the same structure as the original
module's (the same nesting of tuples, lists, dicts and key/value caches, tensors of the same
shape and dtype, equal plain values), no NaN or Inf where the original has none, the same NaN
or Inf where the original has one, equal integer and bool tensors, and floating-point values
that are right by one of two rules.

**The measured rule** (the default). For each recorded call, the module also runs at a higher
precision (float32 weights and inputs for a bfloat16 or float16 module, float64 for a float32
one: ``reference``; a parameter two modules share, as a tied output projection and input
embedding, is one copy there too). That run's outputs are the reference, and the original's
own outputs have an error against it: its rounding. Each part of a candidate's output is held
to the original's own error in that same part, per output tensor (each tensor of a tuple on its
own), by error_groups' measure:

- each value's error is ``|out - ref| / (|ref| + m)``, ``m`` the tensor's typical magnitude: a
  value is judged relative to its own size (a massive channel cannot hide a wrong ordinary
  one), and a value near zero relative to the tensor's typical one;
- the errors are gathered per row (along the last axis: a token's hidden state, a row of
  logits) and per column (one index of the last axis across every row: a channel), each group
  of at least settings.MIN_GROUP values; each group's root mean square and largest value
  are held to MULTIPLIER times the original's in the same group, plus a floor of one unit of
  the dtype's last place (for outputs the original gets exactly). The original's own error of
  a group counts as at least that of its tensor's median group: a group where the original
  happens to be nearly exact does not hold a candidate to chance.

So no single value or row decides for the others, in either direction: a value that cancels
(``(h + 4e6) - 4e6``, a naive ``E[x^2] - E[x]^2``) has a large own error, which loosens its
own row and its own column only, and every other value of them is also in a group of its own
that it does not loosen. A bound is at most MAX_TOLERANCES (ten times it for the largest
value), or the original's own error in that group where that is larger (a candidate there may
be as far off as the original, no more). Where the reference is NaN or Inf and the original
finite (the higher-precision run overflows where the original's rounding did not), the
candidate is compared with the original's values there by the fixed rule's tolerance for the
dtype, never skipped.

A module without a reference (no higher precision to run at, a call holding a key/value cache,
a run that fails or does not fit in memory or time, an original whose typical error is past
MAX_TOLERANCES: ``Reference.why`` says which) is held to the fixed rule, and the result says so
with the reason. A call first seen after tuning (a padded bucket, a new size) has no reference
of its own: each group of its output is held against the original's output within
MULTIPLIER + 1 times the original's typical own error measured at tuning (``Reference.own``).

**The fixed rule** (a backend config's ``tolerance``, the ``precision=`` policies, or
``tolerance=`` given to tt.tweak): the relative error ``max|out - ref| / max|ref|`` over the
positions where the original is finite must stay within the tolerance; its defaults per dtype
are ``TOLERANCES``. A tolerance of 0 asks for bit-identical outputs.

A floating reference tensor with fewer than MIN_FINITE_SHARE of its values finite compares
too little to accept anything, by either rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import time
from typing import Any, Iterator, Sequence

import torch

from . import settings
from . import error_groups
from ._samples import cache_layers, unstorable




REFERENCE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.float32: torch.float64,
}
"""The precision the reference runs at, per output dtype: float32 has 16 bits more than
bfloat16 and 13 more than float16 (its own error is thousands of times smaller than theirs,
and it runs at speed where float64 does not), float64 29 more than float32."""





class MismatchError(Exception):
    """A backend's output does not match the original module's.

    error and tolerance: the error found and the bound it broke, when the mismatch is one of
    values (None for one of structure, NaN or Inf); own: the original's own error against the
    reference (None under the fixed rule)."""

    def __init__(self, message: str, error: float | None = None, tolerance: float | None = None,
                 own: float | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.tolerance = tolerance
        self.own = own


class Finding(float):
    """The error a check found (its float value), with the bound it was held to and, under
    the measured rule, the original's own error (None under the fixed rule)."""

    bound: float
    own: float | None

    def __new__(cls, error: float, bound: float, own: float | None = None) -> "Finding":
        found = super().__new__(cls, error)
        found.bound = bound
        found.own = own
        return found

    @property
    def share(self) -> float:
        """How much of its bound the error uses (the worst finding is the one with most)."""
        return float(self) / self.bound if self.bound > 0 else (0.0 if float(self) == 0 else math.inf)

    @property
    def multiple(self) -> float | None:
        """The error as a multiple of the original's own (None under the fixed rule)."""
        if self.own is None:
            return None
        return float(self) / self.own if self.own > 0 else (0.0 if float(self) == 0 else math.inf)


NOTHING = Finding(0.0, 0.0)


def worst(findings: Iterator[Finding] | Sequence[Finding]) -> Finding:
    """The finding that uses most of its bound (NOTHING for none)."""
    found = NOTHING
    for f in findings:
        if not isinstance(f, Finding):
            f = Finding(float(f), 0.0)
        if f.share > found.share or (f.share == found.share and float(f) > float(found)):
            found = f
    return found


def describe_finding(found: Finding) -> str:
    """A finding as a user reads it: "1.3x the original's error" or "relative error 0.004"."""
    multiple = found.multiple
    if multiple is None:
        return f"relative error {float(found):.3g}"
    if math.isinf(multiple):
        return f"error {float(found):.3g} where the original is exact"
    return f"{multiple:.2g}x the original's error"


# ------------------------------------------------------------------ the rule in force


@dataclasses.dataclass(frozen=True)
class Rule:
    """How candidates without a tolerance of their own are judged (tt.tweak's ``tolerance``):
    "measured" (the default), "dtype" (the fixed rule at TOLERANCES' value for each output's
    dtype), or a number (the fixed rule at that relative tolerance; 0: bit-identical outputs,
    and for decode loops the untuned tokens exactly)."""

    tolerance: str | float = "measured"

    @property
    def measured(self) -> bool:
        return self.tolerance == "measured"

    @property
    def fixed(self) -> float | None:
        """The fixed rule's tolerance for every dtype; None for the measured rule or TOLERANCES'."""
        return None if isinstance(self.tolerance, str) else float(self.tolerance)

    @property
    def exact(self) -> bool:
        return self.fixed == 0

    def describe(self) -> str:
        if self.measured:
            return "measured rule"
        if self.fixed is None:
            return "fixed rule at the per-dtype tolerances"
        return "bit-identical rule" if self.exact else f"fixed rule at the relative tolerance {self.fixed:g}"


_RULE: contextvars.ContextVar[Rule] = contextvars.ContextVar("torch_tweak_rule", default=Rule())

def rule() -> Rule:
    """The rule in force (tt.tweak's, tt.tune's or a loaded file's; the measured one outside)."""
    return _RULE.get()


def check_rule(tolerance: Any) -> Rule:
    """tt.tweak's `tolerance` as a Rule: "measured" (or None), "dtype", or a number from 0 to 1."""
    if tolerance is None or tolerance == "measured":
        return Rule()
    if tolerance == "dtype":
        return Rule("dtype")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or \
            not (0 <= float(tolerance) <= 1):
        raise ValueError(f"tolerance must be \"measured\" (the default: each candidate's error against a "
                         f"higher-precision run within {settings.MULTIPLIER:g}x the original's own), \"dtype\" "
                         "(a fixed relative tolerance per dtype, torch_tweak.TOLERANCES) or a relative tolerance from 0 "
                         f"(bit-identical) to 1, not {tolerance!r}")
    return Rule(float(tolerance))


@contextlib.contextmanager
def ruling(given: Rule) -> Iterator[None]:
    """Holds `given` as the rule in force while the block runs."""
    token = _RULE.set(given)
    try:
        yield
    finally:
        _RULE.reset(token)


def tolerance_for(dtype: torch.dtype, override: float | None = None, bounded: bool = False) -> float:
    """The fixed rule's tolerance for `dtype`: `override`, else the rule's, else the default;
    at most MAX_TOLERANCES when bounded."""
    if override is None:
        override = rule().fixed
    limit = settings.TOLERANCES.get(dtype, 0.1) if override is None else override
    return min(limit, settings.MAX_TOLERANCES.get(dtype, 0.1)) if bounded else limit


def floor_for(dtype: torch.dtype) -> float:
    """The measured rule's floor: one unit in the last place of `dtype` at 1."""
    try:
        return float(torch.finfo(dtype).eps)
    except TypeError:
        return 0.0


# ------------------------------------------------------------------ the measure of an error


def deviation(out: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[float, float]:
    """(rms, peak) of `out`'s error against `ref`, two floating tensors of one shape, over the
    positions `finite` (default: where both are finite), by error_groups' measure: the largest
    row group's root mean square and the largest single value. A summary, for studies; the
    rule itself holds each group to the original's own (judge_groups)."""
    if finite is None:
        finite = torch.isfinite(ref) & torch.isfinite(out.to(ref.device))
    return error_groups.groups_of(out, ref, finite).worst()


@dataclasses.dataclass
class Reference:
    """A signature's reference for the measured rule: per recorded call, the module's outputs
    run at higher precision (a tree like the original's, a tensor None where it has none);
    own: per output tensor (in the order tensor_leaves gives), the original's typical own error
    (rms, peak of its median group: error_groups.Groups.typical), the largest over the calls
    that have that tensor (None where there is no reference): the allowance of a call first
    seen after tuning. outputs is None when there is no reference at all, and why says why;
    seconds: what it took."""

    outputs: list[Any] | None
    own: list[tuple[float, float] | None] = dataclasses.field(default_factory=list)
    why: str = ""
    seconds: float = 0.0
    dtype: torch.dtype | None = None

    @property
    def measured(self) -> bool:
        return self.outputs is not None


def tensor_leaves(value: Any) -> list[Any]:
    """The tensors of an output (a key/value cache's layer by layer), in the order the check
    walks them; a position the output holds None or a plain value at is left out."""
    found: list[Any] = []
    _leaves(value, found)
    return found


def _leaves(value: Any, found: list) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
        return
    cache = cache_layers(value)
    if cache is not None:
        for layer in cache[1]:
            found.extend(layer)
        return
    if isinstance(value, dict):
        for v in value.values():
            _leaves(v, found)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _leaves(v, found)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def reference(module: torch.nn.Module, samples: Sequence[Any], outputs: Sequence[Any],
              seconds: float | None = None) -> Reference:
    """The measured rule's reference of one signature: `module` run on each recorded call
    (`samples`, whose original outputs are `outputs`) with its floating weights and inputs at
    the precision REFERENCE_DTYPES gives for its outputs (run_higher: the module's own weights
    are swapped for higher-precision copies while it runs and put back, one copy of a tensor
    however many names it has; the copies are made one module at a time, on its device when
    they take at most REFERENCE_MEMORY_SHARE of its free memory, else on the host's, else
    none). A reference that cannot be had (the fixed rule is
    in force, no floating output, a float64 output, a call holding a key/value cache, a run
    that raises, takes longer than `seconds` (None: REFERENCE_SECONDS) or does not fit) is returned without outputs and
    says why: its signature is held to the fixed rule."""
    if not rule().measured:
        return Reference(None, why=f"the {rule().describe()} was asked for")
    leaves = [t for out in outputs for t in tensor_leaves(out) if _floating(t)]
    if not leaves:
        return Reference(None, why="no floating-point output")
    high = [REFERENCE_DTYPES.get(t.dtype) for t in leaves]
    if any(d is None for d in high):
        odd = next(t.dtype for t, d in zip(leaves, high) if d is None)
        return Reference(None, why=f"an output of {odd}, which has no higher precision to run at")
    dtype = max(high, key=lambda d: torch.finfo(d).bits)
    held = next((why for why in map(unstorable, samples) if why is not None), None)
    if held is not None:
        return Reference(None, why=f"a recorded call holds live state ({held})")
    start, limit = time.perf_counter(), settings.REFERENCE_SECONDS if seconds is None else seconds
    try:
        weights = higher_weights(module, dtype)
        if isinstance(weights, str):
            return Reference(None, why=weights)
        place, state = weights
        found = []
        for args, kwargs in samples:
            if time.perf_counter() - start > limit:
                return Reference(None, why=f"the higher-precision runs took more than {limit:g} s",
                                 seconds=time.perf_counter() - start)
            found.append(run_higher(module, state, _cast((args, kwargs), dtype, place, {})))
        del state
    except Exception as exc:  # an op with no kernel at that precision, a dtype the forward fixes...
        return Reference(None, why=f"the higher-precision run failed ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''})",
                         seconds=time.perf_counter() - start)
    return _own_errors(outputs, found, dtype, start)


def run_higher(module: torch.nn.Module, state: dict, call: tuple[tuple, dict]) -> Any:
    """`module` called with `call` (args, kwargs) on `state`'s weights (higher_weights') in
    place of its own, which are put back afterwards whatever happens. Each owner's entry is
    swapped once: a module reached by two paths, or a tensor two modules hold (a tied
    embedding), is swapped and put back once (torch.func.functional_call refused tied weights,
    and left the higher-precision copies in a module reached by two paths)."""
    args, kwargs = call
    taken: dict[tuple[int, str], tuple[dict, str, Any]] = {}
    try:
        for name, value in state.items():
            prefix, _, attr = name.rpartition(".")
            owner = module.get_submodule(prefix)
            table = owner._parameters if attr in owner._parameters else owner._buffers
            if (id(owner), attr) not in taken and attr in table:
                taken[(id(owner), attr)] = (table, attr, table[attr])
                table[attr] = value
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        for table, attr, original in taken.values():
            table[attr] = original


def _own_errors(outputs: Sequence[Any], found: Sequence[Any], dtype: torch.dtype, start: float) -> Reference:
    """The Reference of the original's `outputs` and the higher-precision runs' `found`, call by
    call: each call's tensors are its own (calls of one signature may give different numbers of
    tensors); an output tensor whose typical own error is past MAX_TOLERANCES has none."""
    kept: list[Any] = []
    own: list[tuple[float, float] | None] = []
    dtypes: dict[int, torch.dtype] = {}
    for out, hp in zip(outputs, found):
        mine, theirs = tensor_leaves(out), tensor_leaves(hp)
        if len(mine) != len(theirs):
            return Reference(None, why="the higher-precision run gave outputs of another structure",
                             seconds=time.perf_counter() - start)
        tree = []
        for i, (o, h) in enumerate(zip(mine, theirs)):
            usable = _floating(o) and _floating(h) and h.shape == o.shape and \
                torch.finfo(h.dtype).bits > torch.finfo(o.dtype).bits
            tree.append(h.detach() if usable else None)
            own.extend([None] * (i + 1 - len(own)))
            if usable:
                dtypes.setdefault(i, o.dtype)
                typical = error_groups.groups_of(o, h, torch.isfinite(o) & torch.isfinite(h.to(o.device))).typical()
                before = own[i]
                own[i] = typical if before is None else (max(before[0], typical[0]), max(before[1], typical[1]))
        kept.append(tree)
    # an original whose typical error is farther from the higher-precision run than any rounding
    # (a dtype the forward fixes, an operation whose result depends on the precision): no reference
    for i, typical in enumerate(own):
        if typical is not None and typical[0] > settings.MAX_TOLERANCES.get(dtypes[i], 0.1):
            own[i] = None
            for tree in kept:
                if i < len(tree):
                    tree[i] = None
    if all(o is None for o in own):
        return Reference(None, why="the original's outputs are farther from the higher-precision run than "
                                   "rounding explains", seconds=time.perf_counter() - start)
    return Reference(kept, own, seconds=time.perf_counter() - start, dtype=dtype)


def judged_by(found: Reference) -> str:
    """Under the measured rule, the rule that judges a signature without a reference and why
    (what the result shows beside each candidate's error); "" when the reference was made or
    another rule was asked for."""
    if found.measured or not rule().measured:
        return ""
    return f"the fixed rule: no higher-precision reference ({found.why})"


def higher_weights(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.device, dict] | str:
    """(where the reference runs, the module's floating weights at `dtype` there, by name), or
    why it cannot: they do not fit on the module's device nor on the host. A tensor held under
    several names (a tied output projection and input embedding, a parameter two modules share)
    is one copy under each of its names, and counts once."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    distinct = {id(t): t for t in named.values()}
    need = sum(t.numel() for t in distinct.values() if t.is_floating_point()) * torch.finfo(dtype).bits // 8
    devices = {t.device for t in distinct.values()}
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    if device.type == "cuda" and need > settings.REFERENCE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]:
        device = torch.device("cpu")
    if device.type == "cpu" and need > settings.REFERENCE_MEMORY_SHARE * _host_free():
        return f"its weights at {dtype} ({need / 2**20:.0f} MiB) do not fit in free memory"
    copies = {key: (t.detach().to(device=device, dtype=dtype) if t.is_floating_point() else t.detach().to(device))
              for key, t in distinct.items()}
    return device, {name: copies[id(t)] for name, t in named.items()}


def _host_free() -> int:
    """The host's available memory in bytes (MemAvailable), or a large number where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _cast(value: Any, dtype: torch.dtype, device: torch.device, memo: dict[int, Any]) -> Any:
    """A copy of `value` with every floating tensor at `dtype` and every tensor on `device` (a
    tensor found twice is one copy: a call given one tensor twice is given one copy twice)."""
    from ._samples import _rebuilt

    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, torch.Tensor):
        copied = value.detach().to(device=device, dtype=dtype if value.is_floating_point() else value.dtype,
                                   copy=True)
    else:
        copied = _rebuilt(value, lambda v: _cast(v, dtype, device, memo))
    memo[key] = copied
    return copied


# ------------------------------------------------------------------ the check


def check(out: Any, ref: Any, tolerance: float | None = None, where: str = "output", bounded: bool = False,
          high: Sequence[Any] | None = None, own: Sequence[tuple[float, float] | None] | None = None) -> Finding:
    """Raises MismatchError when `out` does not match `ref`; returns the finding that uses most
    of its bound (a float: the error).

    tolerance: the fixed rule at this tolerance (a backend config's own); None: the rule in
    force. high: this call's reference outputs (Reference.outputs[i]), for the measured rule;
    own: per output tensor the original's typical own error (Reference.own), for a call with no
    reference of its own (a size first seen after tuning): each group of the candidate's output
    is then held to MULTIPLIER + 1 times it against the original's output, the most the
    measured bound allows by the triangle inequality. A transformers key/value cache (or its
    CacheRecord from a file) matches one of the same class with as many layers and matching
    tensors in each: caches are values, never compared by identity. bounded: the tolerance came from a file, capped by
    MAX_TOLERANCES."""
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    _structure(out, ref, where, pairs)
    findings = []
    for i, (at, o, r) in enumerate(pairs):
        h = high[i] if high is not None and i < len(high) else None
        mine = own[i] if own is not None and i < len(own) else None
        findings.append(check_tensor(o, r, tolerance, at, bounded, h, mine))
    return worst(findings)


def _structure(out: Any, ref: Any, where: str, pairs: list) -> None:
    """Checks that `out` has `ref`'s structure and plain values; appends (where, out tensor,
    ref tensor) for every tensor, in tensor_leaves' order."""
    if isinstance(ref, torch.Tensor):
        pairs.append((where, out, ref))
        return
    cache = cache_layers(ref)
    if cache is not None:
        name, layers = cache
        got = cache_layers(out)
        if got is None or got[0] != name or len(got[1]) != len(layers):
            raise MismatchError(f"{where}: expected a {name} of {len(layers)} layers, got "
                                + (describe(out) if got is None else f"a {got[0]} of {len(got[1])} layers"))
        for i, (mine, theirs) in enumerate(zip(got[1], layers)):
            if len(mine) != len(theirs):
                raise MismatchError(f"{where}: layer {i} holds {len(mine)} tensors, expected {len(theirs)}")
            pairs.extend((f"{where} layer {i} {('keys', 'values')[j % 2]}", o, r)
                         for j, (o, r) in enumerate(zip(mine, theirs)))
        return
    if isinstance(ref, dict):
        if not isinstance(out, dict) or list(out.keys()) != list(ref.keys()):
            raise MismatchError(f"{where}: expected a dict with keys {list(ref.keys())}, got {describe(out)}")
        for k in ref:
            _structure(out[k], ref[k], f"{where}[{k!r}]", pairs)
        return
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            raise MismatchError(f"{where}: expected a {type(ref).__name__} of {len(ref)}, got {describe(out)}")
        for i, (o, r) in enumerate(zip(out, ref)):
            _structure(o, r, f"{where}[{i}]", pairs)
        return
    if type(out) is not type(ref):
        raise MismatchError(f"{where}: expected {type(ref).__name__}, got {describe(out)}")
    try:
        equal = bool(out == ref)
    except Exception:  # objects without a plain equality count as equal by type
        equal = True
    if not equal:
        raise MismatchError(f"{where}: expected {ref!r}, got {out!r}")


def check_tensor(out: Any, ref: torch.Tensor, tolerance: float | None, where: str, bounded: bool = False,
                 high: torch.Tensor | None = None, own: tuple[float, float] | None = None) -> Finding:
    """One tensor of an output (see check)."""
    if not isinstance(out, torch.Tensor):
        raise MismatchError(f"{where}: expected a tensor, got {describe(out)}")
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise MismatchError(
            f"{where}: expected {tuple(ref.shape)} {ref.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if out.numel() == 0:
        return NOTHING
    out = out.detach()
    ref = ref.detach().to(out.device)
    if not ref.is_floating_point() and not ref.is_complex():
        if not torch.equal(out, ref):
            raise MismatchError(f"{where}: {int((out != ref).sum())} of {ref.numel()} values differ")
        return NOTHING
    finite = _finite_alike(out, ref, where)
    if tolerance is None and rule().measured and not ref.is_complex():
        if high is not None:
            return _measured(out, ref, high.to(out.device), finite, where)
        if own is not None:
            return _derived(out, ref, own, finite, where)
    a = out[finite].double() if not ref.is_complex() else out[finite]
    b = ref[finite].double() if not ref.is_complex() else ref[finite]
    scale = max(float(b.abs().max()), 1e-6)
    error = float((a - b).abs().max()) / scale
    limit = tolerance_for(ref.dtype, tolerance, bounded)
    if error > limit:
        raise MismatchError(f"{where}: relative error {error:.3g} exceeds the tolerance {limit:.3g} for {ref.dtype}",
                            error, limit)
    return Finding(error, limit)


def comparable(ref: Any, where: str = "output", whose: str = "the original's output") -> None:
    """Raises MismatchError when a floating tensor of `ref` (a reference output, `whose` in
    the message) has too few finite values for a check against it to compare anything (see
    _enough_finite): no backend is accepted on such a reference."""
    for i, t in enumerate(tensor_leaves(ref)):
        if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or t.is_complex()):
            _enough_finite(t, f"{where} tensor {i}" if not isinstance(ref, torch.Tensor) else where, whose)


def _enough_finite(ref: torch.Tensor, where: str, whose: str = "the original's output") -> torch.Tensor:
    """ref's finite positions; MismatchError when fewer than MIN_FINITE_SHARE of them."""
    finite = torch.isfinite(ref)
    count = int(finite.sum())
    if count == 0 or count < settings.MIN_FINITE_SHARE * ref.numel():
        found = "no finite value" if count == 0 else f"only {count} finite values of {ref.numel()}"
        raise MismatchError(f"{where}: {whose} has {found} (the rest NaN or Inf), so a check "
                            f"against it compares too little (at least {settings.MIN_FINITE_SHARE:.0%} must be "
                            "finite): "
                            "no backend is accepted for it, and it runs the original forward")
    return finite


def _finite_alike(out: torch.Tensor, ref: torch.Tensor, where: str) -> torch.Tensor:
    """The positions where the original is finite, after checking that the rest match in kind
    and that there are enough of them."""
    finite = _enough_finite(ref, where)
    count = int(finite.sum())
    bad = finite & ~torch.isfinite(out)
    if bool(bad.any()):
        raise MismatchError(f"{where}: {int(bad.sum())} NaN or Inf values where the original has none")
    if count < ref.numel():
        other = ~finite
        got, want = out[other], ref[other]
        if ref.is_complex():
            same = ~torch.isfinite(got)
        else:
            same = (torch.isnan(got) & torch.isnan(want)) | (got == want)
        if not bool(same.all()):
            raise MismatchError(f"{where}: {int((~same).sum())} values differ where the original is NaN or Inf "
                                "(a backend must give the same NaN or Inf there)")
    return finite


def _measured(out: torch.Tensor, ref: torch.Tensor, high: torch.Tensor, finite: torch.Tensor,
              where: str) -> Finding:
    """The measured rule: each group of out's errors against the higher-precision `high` within
    MULTIPLIER times the original `ref`'s own in that group (judge_groups); where `high` is NaN
    or Inf and `ref` finite, out against ref by the fixed rule (_unreferenced)."""
    usable = finite & torch.isfinite(high)
    if not bool(usable.all()) and bool((finite & ~usable).any()):
        _unreferenced(out, ref, finite & ~usable, where)
    own = error_groups.groups_of(ref, high, usable)
    found = error_groups.groups_of(out, high, usable)
    return judge_groups(found, own, settings.MULTIPLIER, ref.dtype, where,
                        f"against a {_name(high.dtype)} run of the module")


def _unreferenced(out: torch.Tensor, ref: torch.Tensor, where_odd: torch.Tensor, where: str) -> None:
    """Raises MismatchError unless `out` is within the fixed rule's tolerance for ref's dtype of
    the original `ref` at the positions `where_odd` (the reference is NaN or Inf there, the
    original finite), each value's error relative to its own size (error_groups' measure)."""
    errors = error_groups.relative_errors(out, ref, where_odd)
    error, limit = float(errors.max()), tolerance_for(ref.dtype, bounded=True)
    if error > limit:
        raise MismatchError(
            f"{where}: at the {int(where_odd.sum())} values where the higher-precision run is NaN or Inf and the "
            f"original finite, the error against the original's values is {error:.3g}, more than the fixed rule's "
            f"{limit:.3g} for {_name(ref.dtype)} (those values have no reference: they are held to the original's)",
            error, limit)


def _derived(out: torch.Tensor, ref: torch.Tensor, own: tuple[float, float], finite: torch.Tensor,
             where: str) -> Finding:
    """A call with no reference of its own: each group of out's errors against the original's
    output within MULTIPLIER + 1 times the original's typical own error measured at tuning."""
    found = error_groups.groups_of(out, ref, finite)
    return judge_groups(found, None, settings.MULTIPLIER + 1, ref.dtype, where,
                        "against the original's output (a call with no higher-precision run: the original's own "
                        "error is its typical one measured at tuning)", typical=own)


def judge_groups(found: error_groups.Groups, own: error_groups.Groups | None, multiplier: float,
                 dtype: torch.dtype, where: str, against: str,
                 typical: tuple[float, float] | None = None) -> Finding:
    """Raises MismatchError unless each group of `found` (per row and per column, rms and
    largest value) is within `multiplier` times `own`'s in the same group, that counting as at
    least own's typical (its median group's) or `typical` where given (own None: every group
    held to it), plus the dtype's floor; at most MAX_TOLERANCES (10x for the largest value) or
    the original's own there where larger. Returns the finding that uses most of its bound."""
    floor, cap = floor_for(dtype), settings.MAX_TOLERANCES.get(dtype, 0.1)
    chosen, at = NOTHING, None
    for f, mine in enumerate(found.families):
        theirs = None if own is None else own.families[f]
        least = typical if typical is not None else theirs.typical()
        for k, (stat, limit) in enumerate((("rms", cap), ("peak", 10 * cap))):
            got = getattr(mine, stat)
            scale = got.new_full(got.shape, least[k]) if theirs is None else getattr(theirs, stat).clamp(min=least[k])
            times = multiplier * (settings.PEAK_SPREAD if stat == "peak" else 1.0)
            bound = torch.minimum(times * scale + floor, scale.clamp(min=limit)).clamp(
                min=float(torch.finfo(torch.float64).tiny))
            if not got.numel():
                continue
            g = int((got / bound).argmax())
            candidate = Finding(float(got[g]), float(bound[g]), float(scale[g]))
            if candidate.share > chosen.share or at is None:
                chosen, at = candidate, (mine, g, stat, times)
    if at is not None and float(chosen) > chosen.bound:
        family, g, stat, times = at
        whose = "typical one measured at tuning" if own is None else f"own there, at least its typical {family.name}'s"
        raise MismatchError(
            f"{where}: {found.name(family, g)}: {describe_finding(chosen)}, more than {times:g}x allowed "
            f"({'error' if stat == 'rms' else 'largest single error'} {float(chosen):.3g} {against}, the original's "
            f"{chosen.own:.3g}; the bound {chosen.bound:.3g} is {times:g}x the original's {whose}, plus one unit "
            f"in the last place of {_name(dtype)}, at most {cap if stat == 'rms' else 10 * cap:g} or the original's)",
            float(chosen), chosen.bound, chosen.own)
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


# ------------------------------------------------------------------ decode loops
