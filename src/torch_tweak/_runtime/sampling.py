"""A sampling call's processed scores without sorting the vocabulary.

transformers' top-p warper sorts every score of the vocabulary at every step, after top-k has
already set all but k of them to -inf. On the H200, choosing one sampled token that way (the
Llama-3 vocabulary of 128,256, temperature, top-k 50, top-p 0.9, the softmax and the draw)
takes 0.55 ms of the device's time at batch 1, a third of the decode step itself
(bench/results/decode-anatomy.md). TopSampler gives the same processed scores from the top
k + MARGIN scores alone: the entries top-k keeps (every score at least the k-th largest, ties
included), ordered as a stable ascending sort orders them (by score, then by index: the order
CUDA's sort of the whole vocabulary gives ties), their softmax and its running sum cut at
1 - top_p as transformers cuts it, then scattered back into a row of -inf. The softmax of that
row and torch.multinomial then run unchanged, as transformers runs them, so a draw under the
same seed is transformers' draw.

Where it can differ: the running sum over the kept entries is summed in another order than
transformers' sum over the whole sorted row (whose other entries are exact zeros), so an entry
whose running sum lies within a few float32 ulps of 1 - top_p can fall on the other side of
the cut. Where it cannot serve: more tied scores at the k-th than MARGIN, or a NaN score. Both
are seen on the device (overflowed) without a read per step; the loop reads the flag once per
call, and then makes the call again with transformers' own processors from the same generator
state (DecodeLoop.decode).

Used on CUDA only: the CPU's sort does not keep ties in index order, so there no ordering of
the kept entries can give transformers' cut among ties.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

MARGIN = 64
"""Scores read past the k-th for ties with it: more ties than this make a call run again with
transformers' own processors."""

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
        width = min(k + MARGIN, vocab)
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


RECORDED_DRAWS = 8
"""The recorded draws a decode loop keeps (one per batch size, vocabulary and sampler settings);
past it the oldest is dropped."""


class RecordedDraw:
    """One sampling step's choice of the next token (the sampler's processed scores, the softmax
    and torch.multinomial, as DecodeLoop._choose makes it) recorded as one device graph, for one
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


@contextlib.contextmanager
def own_blas_workspace() -> Any:
    """Around a capture on CUDA: cuBLAS's workspaces are dropped before and after it, so that
    the capture allocates its own inside the graph's memory pool, which lives as long as the
    graph. A workspace made outside the pool (by a warm-up on the same stream) would be freed
    while the graph still writes to it by the next code that drops them: torch.compile's own
    device graphs do, before and after each of their recordings. Dropping them after the
    capture keeps eager work from sharing the graph's workspace."""
    drop = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if drop is not None:
        drop()
    try:
        yield
    finally:
        if drop is not None:
            drop()


def record_graph(fn: Callable[[], Any], device: torch.device, warmups: int,
                 context: Callable[[], Any] = contextlib.nullcontext) -> tuple[Any, Any]:
    """`fn` recorded as a device graph on `device`, whichever device is current; returns the graph
    and what the recorded call returned. The warm-up calls run first on the stream the graph is
    recorded on, so that what is made on first use (lazy state, a library's plans) exists
    before the recording starts; every call runs inside `context()`. Their draws come
    from a fork of the generators: the caller's are as they were, so recording takes no random
    numbers from the call. The capture is thread-local: another thread's work on the device
    (another model's calls) goes on meanwhile instead of failing. The graph's cuBLAS workspace
    is its own, in its memory pool (own_blas_workspace)."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.random.fork_rng(devices=[device]):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), context():
            for _ in range(warmups):
                fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with own_blas_workspace(), \
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"), context():
            out = fn()
        torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


def replay(graph: Any, device: torch.device) -> None:
    """One replay of a graph record_graph recorded on `device`, whichever device is current (a
    replay launches on the current device's stream)."""
    if device.index == torch.cuda.current_device():
        graph.replay()
    else:
        with torch.cuda.device(device):
            graph.replay()


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator a draw on `device` uses."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
