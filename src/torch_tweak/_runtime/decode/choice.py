"""A decode step's choice of the next token, as transformers' _sample makes it (Choice): the
argmax, or transformers' processors (or the top-k sampler's) and a draw, recorded as a device
graph where it can be (RecordedDraw); while watched, the forced tokens of teacher forcing, and
each step's logits and processed scores kept for the measured rule (decode_check).

The top-k sampler (TopSampler; docs/generate.md, "The top-k sampler"): transformers' top-p
warper sorts the whole vocabulary at every step (0.55 ms of the H200's time at batch 1 for the
Llama-3 vocabulary of 128,256, a third of the decode step: bench/results/decode-anatomy.md).
TopSampler gives the same processed scores from the top k + SAMPLER_MARGIN scores alone: top-k's kept
entries (ties with the k-th included), ordered as a stable ascending sort orders them (by score,
then by index: CUDA's order of ties), their softmax's running sum cut at 1 - top_p as
transformers cuts it, scattered back into a row of -inf; the softmax and torch.multinomial then
run as transformers runs them, so a draw under a seed is transformers'. It can differ where a
running sum lies within a few float32 ulps of 1 - top_p (summed in another order than over the
whole sorted row); it cannot serve more ties at the k-th than SAMPLER_MARGIN, or a NaN score: both are
flagged on the device (overflowed), read once per call, and the call is made again with
transformers' processors from the same generator state (loop.DecodeLoop). CUDA only: the CPU's
sort does not keep ties in index order.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..._core import settings
from .call import Greedy
from .model import record_graph, replay

logger = logging.getLogger("torch_tweak")

DEVICES = frozenset({"cuda"})
"""The device types TopSampler serves (tests widen it to check its arithmetic on the CPU)."""


class TopSampler:
    """The processed scores of a sampling call whose logits processors are exactly transformers'
    [TemperatureLogitsWarper], TopKLogitsWarper, [TopPLogitsWarper], in that order (as its
    generate() builds them), each filtering to -inf."""

    def __init__(self, temperature: Any, top_k: int, top_p: float | None, keep_p: int) -> None:
        self.temperature = temperature  # transformers' own warper, or None
        self.top_k = top_k
        self.top_p = top_p
        self.keep_p = keep_p  # the top-p warper's min_tokens_to_keep
        self.flag: torch.Tensor | None = None  # per row: any step overflowed (a device tensor)
        self.candidates: torch.Tensor | None = None  # the last process()'s top scores' indices, ascending

    @classmethod
    def of(cls, processors: Any, sample: bool, device: torch.device) -> "TopSampler | None":
        """The sampler for a call's processors, or None where it does not apply."""
        if not sample or processors is None or device.type not in DEVICES:
            return None
        names = [type(p).__name__ for p in processors]
        if not all(type(p).__module__.startswith("transformers.") for p in processors):
            return None
        temperature = None
        if names and names[0] == "TemperatureLogitsWarper":
            temperature, names, processors = processors[0], names[1:], list(processors)[1:]
        if names not in (["TopKLogitsWarper"], ["TopKLogitsWarper", "TopPLogitsWarper"]):
            return None
        if any(getattr(p, "filter_value", None) != -float("inf") for p in processors):
            return None
        top_k = processors[0].top_k
        top_p = processors[1].top_p if len(processors) == 2 else None
        keep_p = processors[1].min_tokens_to_keep if len(processors) == 2 else 1
        if not isinstance(top_k, int) or top_k < 1 or not isinstance(keep_p, int) or keep_p < 1:
            return None
        return cls(temperature, top_k, top_p, keep_p)

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """The processed scores of `scores` (batch x vocabulary, float32), as the processors give
        them but where overflowed() says otherwise."""
        if self.temperature is not None:
            scores = self.temperature(None, scores)
        vocab = scores.shape[-1]
        k = min(self.top_k, vocab)
        width = min(k + settings.SAMPLER_MARGIN, vocab)
        values, indices = torch.topk(scores, width)  # descending
        kth = values[:, k - 1:k]
        kept = values >= kth  # top-k keeps every score not below the k-th, ties included
        flag = torch.isnan(values[:, 0])  # topk puts a NaN first
        if width < vocab:
            flag = flag | (values[:, -1] >= kth[:, 0])  # ties may go on past the margin
        if self.flag is None:
            self.flag = flag
        else:  # in place: a recorded draw's flag keeps its address (RecordedDraw)
            self.flag |= flag
        if self.top_p is not None:
            # the stable ascending order: by index first, then a stable sort by score
            by_index, order = indices.sort(dim=-1)
            self.candidates = by_index
            masked = values.gather(1, order).masked_fill(~kept.gather(1, order), -float("inf"))
            values, place = torch.sort(masked, dim=-1, stable=True)
            indices = by_index.gather(1, place)
            cumulative = values.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[..., -self.keep_p:] = False
            kept = ~remove
        else:
            self.candidates = indices.sort(dim=-1).values
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, indices, values.masked_fill(~kept, -float("inf")))

    def start(self, batch: int, device: torch.device) -> None:
        """Before a call's first step: no step overflowed yet. The flag is made for `batch` rows
        on `device` once and zeroed in place after (a recorded step keeps its address)."""
        if self.flag is None or self.flag.shape[0] != batch or self.flag.device != device:
            self.flag = torch.zeros(batch, dtype=torch.bool, device=device)
        else:
            self.flag.zero_()

    def pick(self, probs: torch.Tensor) -> torch.Tensor:
        """torch.multinomial's one draw from `probs`, the softmax of the last process()'s
        scores, over the top scores it kept (draw_one)."""
        assert self.candidates is not None, "process() the scores first"
        return draw_one(probs, self.candidates)

    def overflowed(self) -> bool:
        """Whether any step since the last reset could not be served (reads the device once)."""
        return self.flag is not None and bool(self.flag.any())

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of `logits` (batch x vocabulary, float32): torch.multinomial's
        one draw from the softmax of the processed scores, where that is exactly what draw_one
        gives (exact_draws), else torch.multinomial itself."""
        probs = torch.nn.functional.softmax(self.process(logits), dim=-1)
        if not exact_draws(logits.device):
            return torch.multinomial(probs, num_samples=1).squeeze(1)
        assert self.candidates is not None
        return draw_one(probs, self.candidates)


def draw_one(probs: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs` as torch.multinomial(probs, 1) makes it, where every nonzero
    probability lies in `candidates` (indices per row, ascending). torch draws one sample as the
    argmax of probs / q, q an exponential variate per entry (torch.empty_like(probs).exponential_):
    the same variates are taken from the generator here, and the ratios are the same divisions,
    but the argmax runs over the candidates alone (outside them every ratio is 0; among equal
    ratios the lowest index, as torch's argmax). It spares the device the full-row division, the
    full-row argmax and multinomial's checks of the row (several reductions of the vocabulary)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    ratio = probs.gather(1, candidates) / q.gather(1, candidates)
    return candidates.gather(1, ratio.argmax(dim=-1, keepdim=True)).squeeze(1)


_EXACT: dict[str, bool] = {}


def exact_draws(device: torch.device) -> bool:
    """Whether draw_one gives torch.multinomial's draws on this device type with this torch:
    checked once per process, on rows of probabilities with zeros and ties drawn with a
    generator of the check's own (the user's generators are not touched)."""
    known = _EXACT.get(device.type)
    if known is None:
        same = True
        for seed in range(4):
            g = torch.Generator(device).manual_seed(seed)
            scores = torch.randn(4, 1000, device=device, generator=g).round(decimals=1)  # ties among the kept
            scores[:, 100:] = -float("inf")
            probs = torch.nn.functional.softmax(scores, dim=-1)
            candidates = torch.arange(120, device=device).expand(4, 120).contiguous()
            theirs = torch.multinomial(probs, num_samples=1, generator=g.manual_seed(100 + seed)).squeeze(1)
            ours = draw_one(probs, candidates, g.manual_seed(100 + seed))
            same = same and bool(torch.equal(ours, theirs))
        known = _EXACT[device.type] = same
    return known


class RecordedDraw:
    """One sampling step's choice of the next token (the sampler's processed scores, the softmax
    and torch.multinomial, as Choice.choose makes it) recorded as one device graph, for one
    batch size, vocabulary and sampler: a step copies its last logits into the graph's input and
    replays it, one launch from the host instead of about forty.

    The draw is transformers' under a seed, as an eager one is: a replay reads the generator's
    seed and offset when it is launched and moves the offset on by what the recorded kernels
    take, as the same kernels run eagerly would. Recording runs the draw three times (two to
    warm it up); the generator's state is put back after, so recording takes no draw from the
    call (record_graph). On a device without graphs (RECORDS) the same buffers are run eagerly."""

    RECORDS = frozenset({"cuda"})

    def __init__(self, sampler: TopSampler, batch: int, vocab: int, device: torch.device) -> None:
        self.sampler = sampler
        self.logits = torch.empty(batch, vocab, dtype=torch.float32, device=device)
        sampler.flag = torch.zeros(batch, dtype=torch.bool, device=device)
        self.token: torch.Tensor | None = None
        self.graph: Any = None
        self.replays = 0
        if device.type in self.RECORDS:
            self._record(device)

    def _draw(self) -> torch.Tensor:
        return self.sampler.draw(self.logits)

    def _record(self, device: torch.device) -> None:
        self.logits.normal_(generator=torch.Generator(device).manual_seed(0))  # scores to warm up on
        self.graph, self.token = record_graph(self._draw, device, warmups=2)

    def reset(self) -> None:
        """Before a call: no step of it has overflowed yet."""
        assert self.sampler.flag is not None
        self.sampler.flag.zero_()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from a step's last logits (batch x vocabulary)."""
        self.logits.copy_(logits)
        self.replays += 1
        if self.graph is None:
            return self._draw()
        replay(self.graph, self.logits.device)
        assert self.token is not None
        return self.token.clone()  # the next replay writes over the graph's own

    def overflowed(self) -> bool:
        return self.sampler.overflowed()

    @staticmethod
    def key(sampler: TopSampler, batch: int, vocab: int, device: torch.device) -> tuple:
        temperature = None if sampler.temperature is None else float(sampler.temperature.temperature)
        return (batch, vocab, str(device), torch.is_inference_mode_enabled(), temperature, sampler.top_k,
                sampler.top_p, sampler.keep_p)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator a draw on `device` uses."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class Choice:
    """A loop's choice of each next token: the argmax, or the call's processors (or a top-k
    sampler, recorded as a device graph per batch, vocabulary and settings: RecordedDraw) and
    a draw; while watched (watch), the forced tokens, each step's logits and scores kept."""

    def __init__(self) -> None:
        self.record_draws = True  # a top-k sampler's choice of the next token recorded (RecordedDraw)
        self.draws: dict[tuple, RecordedDraw] = {}  # the recorded draws, the newest last
        self.unrecorded: dict[tuple, str] = {}  # a draw whose recording failed: why (its calls run eagerly)
        self.captured: list[torch.Tensor] | None = None  # each step's processed scores, while captured
        self.forcing: torch.Tensor | None = None  # the forced tokens ([batch, steps]), while teacher-forced
        self.forced_logits: list[torch.Tensor] = []  # each forced step's raw logits

    def choose(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
               sampler: "TopSampler | RecordedDraw | None" = None) -> torch.Tensor:
        """The next token from a forward's logits, as transformers' _sample chooses it (under
        teacher forcing: the forced token, the logits kept)."""
        if self.forcing is not None:
            return self._forced(call, logits, seq, sampler)
        if call.processors is None and not call.sample:
            return logits[:, -1, :].argmax(-1)
        if isinstance(sampler, RecordedDraw):
            return sampler(logits[:, -1])
        if sampler is not None:
            scores = sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32))
        else:
            scores = self.process(call, logits, seq)
        if self.captured is not None:
            self.captured.append(scores.clone())
        if call.sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def _forced(self, call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None,
                sampler: "TopSampler | RecordedDraw | None") -> torch.Tensor:
        """Teacher forcing: the step's raw logits (and, while captured, its processed scores:
        the top-k sampler's where it serves the call) kept, the forced token returned (past the
        forced ones, the argmax)."""
        step = len(self.forced_logits)
        self.forced_logits.append(logits[:, -1].detach().to(copy=True, dtype=torch.float32))
        if self.captured is not None:
            if isinstance(sampler, TopSampler):
                self.captured.append(sampler.process(logits[:, -1].to(copy=True, dtype=torch.float32)))
            else:
                self.captured.append(self.process(call, logits, seq))
        if step < self.forcing.shape[1]:
            return self.forcing[:, step].to(logits.device)
        return logits[:, -1].argmax(-1)

    def watched_step(self, logits: torch.Tensor, process: Callable[[torch.Tensor], torch.Tensor]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step whose token another part chooses (the fused loop's StepChoice), while watched:
        (the forced token under teacher forcing, past the forced ones the argmax, its raw logits
        [batch, vocab] kept; while captured, its processed scores, process(logits), kept and
        returned). (None, None) when not watched."""
        if not self.watched():
            return None, None
        scores = None
        if self.captured is not None:
            scores = process(logits)
            self.captured.append(scores.clone())
        if self.forcing is None:
            return None, scores
        step = len(self.forced_logits)
        self.forced_logits.append(logits.detach().to(copy=True, dtype=torch.float32))
        if step < self.forcing.shape[1]:
            return self.forcing[:, step].to(logits.device), scores
        return logits.argmax(-1), scores

    @staticmethod
    def process(call: Greedy, logits: torch.Tensor, seq: torch.Tensor | None) -> torch.Tensor:
        """The processed next-token scores: the last logits in float32 through transformers'
        processors for the call, given the sequence so far."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        if call.processors is not None:
            scores = call.processors(seq, scores)
        return scores

    def sampler_for(self, call: Greedy, vocab: int) -> "TopSampler | RecordedDraw | None":
        """The top-k sampler of a call's choices (None where it does not serve): recorded as a
        device graph once per batch, vocabulary and settings (RecordedDraw), but where the
        processed scores are read (captured) or record_draws is off."""
        batch, device = call.input_ids.shape[0], call.input_ids.device
        sampler = TopSampler.of(call.processors, call.sample, device)
        if sampler is None or self.captured is not None or not self.record_draws:
            return sampler
        key = RecordedDraw.key(sampler, batch, vocab, device)
        if key in self.unrecorded:
            return sampler
        draw = self.draws.pop(key, None)
        if draw is None:
            if len(self.draws) >= settings.RECORDED_DRAWS:
                self.draws.pop(next(iter(self.draws)))
            try:
                draw = RecordedDraw(sampler, batch, vocab, device)
            except Exception as exc:  # the call is served eagerly, and so are later ones of this shape
                self.unrecorded[key] = f"{type(exc).__name__}: {exc}"
                logger.warning("torch-tweak: the decode loop could not record its sampler's choice for batch %d "
                               "(%s); such calls choose their tokens kernel by kernel", batch, self.unrecorded[key])
                sampler.flag = None  # RecordedDraw gave it a buffer of its own
                return sampler
        self.draws[key] = draw  # the newest last
        draw.reset()
        return draw

    @staticmethod
    def key(call: Greedy) -> tuple:
        """What of a call's choice of the next token a recorded step bakes in: whether it draws,
        and each processor's settings (its plain attributes)."""
        processors = tuple((type(p).__name__, tuple(sorted((k, v) for k, v in vars(p).items()
                                                           if isinstance(v, (bool, int, float, str)))))
                           for p in (call.processors or ()))
        return (call.sample, processors)

    def watched(self) -> bool:
        """Whether each step's choice is watched (teacher-forced or captured): its steps then run
        one by one, never from a recorded step."""
        return self.captured is not None or self.forcing is not None

    def mark(self) -> tuple[int | None, int]:
        """Where the kept scores and logits end now (rewind goes back to it)."""
        return (None if self.captured is None else len(self.captured)), len(self.forced_logits)

    def rewind(self, mark: tuple[int | None, int]) -> None:
        """Drops what was kept since `mark` (a call made again)."""
        if mark[0] is not None and self.captured is not None:
            del self.captured[mark[0]:]
        del self.forced_logits[mark[1]:]

    @contextlib.contextmanager
    def watch(self, forcing: torch.Tensor | None = None,
              scores: bool = True) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        """Inside the block: with `forcing` ([batch, steps]), each step's token is taken from it
        instead of chosen, its raw logits kept; with `scores`, each step's processed scores kept.
        Yields the two lists (None: the scores are not kept)."""
        self.forcing, self.forced_logits = forcing, []
        self.captured = [] if scores else None
        try:
            yield self.forced_logits, self.captured
        finally:
            self.forcing, self.forced_logits, self.captured = None, [], None

    def figures(self) -> dict:
        """What tt.status says of the recorded draws: how many replay a device graph, and why
        others run kernel by kernel."""
        return {"recorded_draws": sum(d.graph is not None for d in self.draws.values()),
                "unrecorded": list(self.unrecorded.values())}
