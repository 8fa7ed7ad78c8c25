"""Teacher forcing: a generate() call's decode steps fed the untuned tokens, and the measured
correctness rule's reference for it.

A decode loop or a depth that changes kernels can part from the untuned tokens where two
tokens are nearly tied, and the untuned call itself does not always repeat its own tokens
there. So a candidate is judged on the same prefixes as the untuned call: its steps are fed
the untuned tokens (``teacher_forced``) and each step's logits are held to the measured rule
against a higher-precision run of the model on the same sequence (``reference``: one forward
of the whole sequence at float32, teacher-forced by construction), where the untuned call's
own logits have their error too (decode_numerics.StepReference). Its own free-running tokens may
part from the untuned ones only at a near tie (decode_numerics.partings).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from torch import nn

from .._core import correctness, decode_numerics, settings
from .._runtime.decode import call as decode_call, model as decode_model
from .._runtime.decode.loop import DecodeLoop, install, loop_of, uninstall


def _forcing_processor(new: torch.Tensor, prompt: int) -> Any:
    """A transformers logits processor that leaves only the forced token: step t's token is
    new[:, t] (transformers appends it after the call's own processors, before its sampling
    warpers, which keep a lone token)."""
    from transformers import LogitsProcessor

    class Forcing(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step = input_ids.shape[1] - prompt
            if step >= new.shape[1]:
                return scores
            forced = torch.full_like(scores, float("-inf"))
            return forced.scatter_(1, new[:, step:step + 1].to(scores.device), 0.0)

    return Forcing()


def teacher_forced(model: nn.Module, args: tuple, kwargs: dict, tokens: torch.Tensor,
                   processed: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The model's generate() call fed `tokens` (the untuned output, prompt included) step by
    step: (each step's raw logits, [batch, vocab] in float32; with `processed`, each step's
    scores as the loop processed them, its top-k sampler's where it serves the call; through
    transformers' loop, None: its processors are its own). Through tweak's decode loop where it
    is installed and serves the call (its own steps, kernels and processing), else through
    transformers' loop with a processor that forces the tokens."""
    prompt = decode_call.prompt_length(args, kwargs) or 0
    new = tokens[:, prompt:]
    loop = loop_of(model)
    call = decode_call.greedy_call(model, args, kwargs)
    if loop is not None and not isinstance(call, str) and loop.unmeasured(call) is None and \
            loop.problem(call) is None:
        with loop.choice.watch(new, processed) as (raw, scores), \
                decode_call.same_draws(model, args, kwargs), torch.no_grad():
            model.generate(*args, **kwargs)
            return list(raw), (list(scores) if processed else None)
    from transformers import LogitsProcessorList

    given = dict(kwargs, logits_processor=LogitsProcessorList([_forcing_processor(new, prompt)]),
                 output_logits=True, return_dict_in_generate=True)
    with decode_call.same_draws(model, args, kwargs), torch.no_grad():
        out = (loop.original if loop is not None else model.generate)(*args, **given)
    return [t.detach().to(dtype=torch.float32) for t in out.logits], None


def reference(model: nn.Module, args: tuple, kwargs: dict, tokens: torch.Tensor) -> decode_numerics.StepReference:
    """The measured rule's reference of one generate() call whose untuned output is `tokens`:
    the untuned call teacher-forced (its own logits, and for a sampling call its processed
    scores) against one forward of the whole sequence with the model's floating weights at
    float32 (float64 for a float32 model; correctness.reference's rule for where they go and
    when they do not fit). Without one (a fixed tolerance asked for, the weights do not fit, a
    forward that fails), `why` says why and the tokens must be the untuned ones exactly."""
    if not correctness.rule().measured:
        return decode_numerics.StepReference(None, why=f"the {correctness.rule().describe()} was asked for")
    call = decode_call.greedy_call(model, args, kwargs)
    if isinstance(call, str):
        return decode_numerics.StepReference(None, why=f"a call tweak's loop does not serve ({call})")
    try:
        own = teacher_forced(model, args, kwargs, tokens)[0]
        high = _high_logits(model, call, tokens)
        if isinstance(high, str):
            return decode_numerics.StepReference(None, why=high)
        own_tv = None
        if call.sample:
            pairs = zip(processed_scores(call, tokens, own), processed_scores(call, tokens, high))
            own_tv = [float(decode_numerics.total_variation(a, b).max()) for a, b in pairs]
        return decode_numerics.step_reference(own, high, own_tv, _weights_dtype(model))
    except Exception as exc:  # a model whose plain forward of the whole sequence is not its decode steps' sum
        return decode_numerics.StepReference(None, why=f"the reference run failed ({type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")


def processed_scores(call: decode_call.Greedy, tokens: torch.Tensor, logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each step's `logits` through the call's logits processors, on the prefix of `tokens`
    that step saw (float32, as transformers processes them)."""
    prompt = call.input_ids.shape[1]
    out = []
    for step, scores in enumerate(logits):
        scores = scores.to(tokens.device, torch.float32, copy=True)
        if call.processors is not None:
            scores = call.processors(tokens[:, :prompt + step], scores)
        out.append(scores)
    return out


def _weights_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the model computes in: its first floating weight's (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _high_logits(model: nn.Module, call: decode_call.Greedy, tokens: torch.Tensor) -> list[torch.Tensor] | str:
    """Each decode step's logits from one forward of the whole sequence (`tokens`, prompt and
    new tokens) with the model's floating weights at higher precision, the model as it was
    before any tuning; or why there are none."""
    floating = _weights_dtype(model)
    dtype = correctness.REFERENCE_DTYPES.get(floating)
    if dtype is None:
        return f"weights of {floating}, which have no higher precision to run at"
    prompt = call.input_ids.shape[1]
    steps = tokens.shape[1] - prompt
    mask = call.mask if call.mask is not None else torch.ones_like(call.input_ids)
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    kwargs = {"input_ids": tokens, "attention_mask": mask, "use_cache": False}
    try:
        takes = "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with decode_model.plain_model(model):
        weights = correctness.higher_weights(model, dtype)
        if isinstance(weights, str):
            return weights
        place, state = weights
        moved = {k: v.to(place) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = correctness.run_higher(model, state, ((), moved))
    logits = out.logits if hasattr(out, "logits") else out[0]
    return [logits[:, prompt - 1 + step].float().to(tokens.device) for step in range(steps)]


def check_call(model: nn.Module, i: int, args: tuple, kwargs: dict, untuned: Any, reference: Any) -> str:
    """Raises MismatchError unless generate call i, on the model as it is now, keeps the rule in
    force; returns what it found, for the report (the multiple, and where its tokens part).

    untuned: the untuned call's tokens (several where it does not repeat its own:
    Workload._warm_tokens); reference: its decode_numerics.StepReference. Without a measured
    reference the tokens must be one of the untuned runs' exactly, and what it returns says so
    and why ("exact tokens: the reference run failed (...)"). With one, the call is also
    run teacher-forced on the untuned tokens and each step's logits held to the measured rule
    (decode_numerics.check_steps); a greedy call's own tokens may part from the untuned ones only
    at a near tie (decode_numerics.partings; where they part elsewhere and the teacher-forced logits
    break the rule too, the step and the multiple are said first); a sampling call's processed
    distributions are held to
    the measured bound (decode_numerics.check_distributions), and a loop's own processing (its
    top-k sampler) to transformers' processors on the same logits."""
    from .._core.correctness import MismatchError
    from .._core.decode_numerics import StepReference, check_distributions, check_steps, partings

    prompt = decode_call.prompt_length(args, kwargs) or 0
    with decode_call.same_draws(model, args, kwargs), torch.no_grad():
        got = model.generate(*args, **kwargs)
    differ = decode_numerics.untuned_difference(i, got, untuned, prompt)
    if reference is None or not reference.measured:
        if differ is not None:
            raise MismatchError(differ)
        return f"call {i}: exact tokens: {reference.why if reference is not None else 'no reference was made'}"
    call = decode_call.greedy_call(model, args, kwargs)
    sample = not isinstance(call, str) and call.sample
    notes, wide = [], None  # wide: a greedy parting that is not a near tie
    if differ is not None and isinstance(got, torch.Tensor):
        for parting in partings(got, untuned[0], reference, prompt):
            if not sample and not parting.near_tie:
                wide = wide or f"generate call {i}: {parting.describe()}"
            notes.append(("a draw: " if sample else "") + parting.describe())
    elif differ is not None:
        raise MismatchError(differ)
    raw, processed = teacher_forced(model, args, kwargs, untuned[0], processed=sample)
    try:  # the step and the multiple that broke the rule, with the parting where the tokens show it
        found = check_steps(raw, reference, f"generate call {i}")
    except MismatchError as exc:
        if wide is None:
            raise
        raise MismatchError(f"{exc}; its own tokens: {wide}", exc.error, exc.tolerance, exc.own) from None
    if wide is not None:
        raise MismatchError(wide)
    if sample:
        mine = processed_scores(call, untuned[0], raw)
        if processed is not None:  # the loop's processing against transformers' processors on its own logits
            check_distributions(processed, mine, StepReference(None), f"generate call {i} (the loop's processing)")
        check_distributions(mine, processed_scores(call, untuned[0], reference.high), reference, f"generate call {i}")
    parts = "; ".join(notes) if notes else "the untuned tokens"
    return f"call {i}: {correctness.describe_finding(found)}, {parts}"


def apply_loop(model: nn.Module, plan: Any, seconds: float | None = None) -> str | None:
    """Installs the loop a plan keeps (plan.LoopPlan) when, on every stored call, it keeps the correctness rule in
    force (check_call) against the untuned generate() run here (transformers' own loop on the
    model with its tuned modules taken out, the loop not installed), with the reference made
    here too; else leaves generate() as it was and returns why. The tokens the plan stores
    are not trusted: a forged loop stores its own. Each call is bounded
    (decode_call.check_bounds), and the whole check by `seconds` (default
    LOOP_CHECK_SECONDS)."""
    from .._core.correctness import MismatchError

    if not plan.checks:
        return "no stored generate() call to check it on"
    for args, kwargs, _ in plan.checks:
        problem = decode_call.check_bounds(model, args, kwargs)
        if problem is not None:
            return problem
    limit = settings.LOOP_CHECK_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + limit
    late = f"its check took longer than {limit:g} s (LOOP_CHECK_SECONDS)"
    untuned, references = [], []
    uninstall(model)
    try:
        with torch.no_grad(), decode_model.plain_model(model):
            for args, kwargs, _ in plan.checks:
                if deadline - time.monotonic() <= 0:
                    return late
                # the first compiles; the two after it are the untuned tokens (either, where they
                # differ: Workload._warm_tokens)
                runs = 3 if decode_model.compiled_by_transformers(model, args, kwargs) else 1
                outs = []
                for _ in range(runs):
                    with decode_call.same_draws(model, args, kwargs):
                        left = max(deadline - time.monotonic(), 0.0)
                        outs.append(model.generate(*args, **{**kwargs, "max_time": left}))
                untuned.append(outs[-2:] if runs > 1 else outs)
                references.append(reference(model, args, kwargs, untuned[-1][0]))
        if time.monotonic() > deadline:  # transformers' max_time stopped a run short
            return late
    except Exception as exc:
        return f"the untuned generate() failed on a stored call: {type(exc).__name__}: {str(exc)[:200]}"
    loop = DecodeLoop(model, plan.kind, plan.layouts, plan.top_sampler, plan.kernels)
    loop.checks = [(args, kwargs, outs[0]) for (args, kwargs, _), outs in zip(plan.checks, untuned)]
    loop.stopping.deadline = deadline
    install(model, loop)
    problem = None
    try:
        for i, (args, kwargs, _) in enumerate(loop.checks):
            try:
                check_call(model, i, args, kwargs, untuned[i], references[i])
            except MismatchError as exc:
                problem = str(exc)
            if loop.fallbacks:
                problem = f"generate call {i} is not one it serves ({next(iter(loop.fallbacks))})"
            if problem is not None:
                break
    except Exception as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        loop.stopping.deadline = None
        if problem is not None or loop_of(model) is not loop:
            uninstall(model)  # whatever happened (an interrupt too), generate() is as it was
    loop.calls = 0
    loop.fallbacks.clear()
    return problem


def distribution_difference(model: nn.Module, loop: DecodeLoop, args: tuple, kwargs: dict) -> str | None:
    """For a sampling call: how the loop's processed next-token distribution differs from
    transformers' processors' on the same prefixes (the untuned loop's output_scores, each
    step's against the loop's), beyond TV_FLOOR (the same processors on the
    same scores: equal bit for bit where the logits are, but for a softmax's last bit); None
    when it does not, or for a greedy call (its tokens are compared exactly). Both runs draw
    under same_draws."""
    call = decode_call.greedy_call(model, args, kwargs)
    if isinstance(call, str) or not call.sample:
        return None
    with decode_call.same_draws(model, args, kwargs), torch.no_grad():
        reference = loop.original(*args, **{**kwargs, "return_dict_in_generate": True, "output_scores": True})
    with loop.choice.watch() as (_, captured), decode_call.same_draws(model, args, kwargs), torch.no_grad():
        model.generate(*args, **kwargs)
    expected = list(reference.scores)
    if len(captured) < len(expected):
        return f"the loop made {len(captured)} processed distributions, transformers {len(expected)}"
    for step, (mine, theirs) in enumerate(zip(captured, expected)):
        distance = float(decode_numerics.total_variation(mine, theirs).max())
        if not distance <= settings.TV_FLOOR:
            return (f"step {step}: the processed next-token distribution is {distance:.2e} (total variation) "
                    f"from transformers' processors', more than {settings.TV_FLOOR:g}")
    return None
