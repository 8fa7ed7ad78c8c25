"""tt.tweak, tt.save and tt.load under torch.distributed: ranks that tune a sharded model
together (gloo on the CPU, 2 and 4 processes).

The model is a tensor-parallel MLP made by hand (column-parallel up projection, row-parallel
down projection ending in an all_reduce) from an unsharded model built with the same seed,
whose outputs every rank's tuned model must give. One rank is made slower (a sleep inside a
module on rank 1) or made to fail a candidate (a build that raises on rank 1 only): every rank
must still keep the same plan, measured by the slowest rank."""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import torch_tweak as tt
from torch_tweak.tweak import plan_digest

WIDTH, BATCH = 16, 4
MEASURE = {"warmup_max": 4, "rounds_min": 3, "rounds_max": 10, "time_cap": 1.0}
DELAY = 0.01  # the sleep inside each block on rank 1: far above the noise of 4 ranks on 2 cores


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, folder: str) -> None:
    faulthandler.enable(all_threads=True)  # a rank that aborts prints every thread's stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch_tweak._core import cpu_load

    cpu_load.reading = lambda also=(): None  # as in conftest: no decision turns on the CI machine's load
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world, Path(folder))
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank closes its connections while another still uses them
    finally:
        dist.destroy_process_group()
    # The rank's work is done and written. Ending without the interpreter's teardown: gloo's
    # worker threads can still be releasing tensors while the interpreter finalises, and the
    # process then aborts ("terminate called without an active exception", SIGABRT: a thread
    # made to exit while the interpreter finalises; seen once in CI). A failure above still
    # raises, and torch.multiprocessing reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, folder: Path, timeout: float = 120.0) -> list[dict]:
    """fn(rank, world, folder) on `world` processes of one gloo group; what each returned (JSON)."""
    context = mp.start_processes(_entry, args=(fn, world, free_port(), str(folder)), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not _joined(context, folder, world):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the ranks were still running after {timeout:.0f} s: a rank waits in a collective")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _joined(context, folder: Path, world: int) -> bool:
    """context.join(1 s); a rank that died names the ranks whose results were written (a death
    after every result is written is the teardown; before, the tuning)."""
    try:
        return context.join(timeout=1.0)
    except mp.ProcessExitedException as exc:
        written = [r for r in range(world) if (folder / f"rank{r}.json").exists()]
        raise AssertionError(f"{exc}; ranks whose results were written: {written}") from exc


# ---------------------------------------------------------------------- model


class Block(nn.Module):
    """A residual MLP block; `delay` seconds of sleep in its forward (a slow rank)."""

    def __init__(self, norm: nn.Module, up: nn.Module, down: nn.Module, delay: float = 0.0) -> None:
        super().__init__()
        self.norm, self.up, self.down, self.delay = norm, up, down, delay

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.compute(x)


class ColumnParallel(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of a Linear's weight: this rank's slice of its outputs."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        n = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * n:(rank + 1) * n].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallel(nn.Module):
    """Columns of a Linear's weight for this rank's slice of its inputs; the partial sums are
    added across ranks (all_reduce), then the bias."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        n = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y + self.bias


def full_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [Block(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(2)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 8)).eval()


def sharded_model(rank: int, world: int, slow_rank: int | None = None) -> nn.Sequential:
    full = full_model()
    blocks = [Block(b.norm, ColumnParallel(b.up, rank, world), RowParallel(b.down, rank, world),
                    DELAY if rank == slow_rank else 0.0) for b in full[:2]]
    return nn.Sequential(*blocks, full[2]).eval()


def dataset() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(BATCH, WIDTH) for _ in range(2)]


# ------------------------------------------------------------------- backends


@dataclasses.dataclass
class PlainConfig(tt.BackendConfig):
    pass


class Shortcut(tt.Backend):
    """The module's work without its sleep (Block.compute); any other module as it is."""

    name = "Shortcut"
    config_class = PlainConfig

    def build(self, module, samples, device):
        return getattr(module, "compute", module)


class FailsOnRank1(Shortcut):
    """Shortcut's callable, but its build raises on rank 1 only: on rank 0 alone it would tie."""

    name = "FailsOnRank1"

    def build(self, module, samples, device):
        if dist.get_rank() == 1:
            raise RuntimeError("this candidate fails on rank 1 only")
        return super().build(module, samples, device)


class LagsOnRank1(Shortcut):
    """Shortcut's callable, 20 ms slower on rank 1 only: rank 0 alone could keep it."""

    name = "LagsOnRank1"

    def build(self, module, samples, device):
        fn = super().build(module, samples, device)
        if dist.get_rank() != 1:
            return fn

        def lagging(*args, **kwargs):
            time.sleep(0.02)
            return fn(*args, **kwargs)

        return lagging


class BreaksOnRank1(Shortcut):
    """Passes its check, then fails while measured on rank 1 only (after the module's own
    all_reduce, so that the ranks' collectives still pair)."""

    name = "BreaksOnRank1"

    def build(self, module, samples, device):
        fn = super().build(module, samples, device)
        calls = [0]

        def breaking(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[0] += 1
            if dist.get_rank() == 1 and calls[0] > len(samples):
                raise RuntimeError("this candidate breaks on rank 1 while measured")
            return out

        return breaking


def strategy() -> tt.Strategy:
    return tt.HighestThroughputStrategy([FailsOnRank1(), LagsOnRank1(), Shortcut()])


# ---------------------------------------------------------------------- ranks


def _tune_save_load(rank: int, world: int, folder: Path) -> dict:
    model = sharded_model(rank, world, slow_rank=1)
    data = dataset()
    with torch.inference_mode():
        expected = [full_model()(x) for x in data]
    result = tt.tweak(model, data, strategy=strategy(), measure=MEASURE, cache=False, progress=False)
    with torch.inference_mode():
        same = all(torch.allclose(model(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    tt.save(model, folder / f"plan{rank}.tt")
    fresh = sharded_model(rank, world, slow_rank=1)
    loaded = tt.load(fresh, folder / f"plan{rank}.tt", backends=[Shortcut()])
    with torch.inference_mode():
        loaded_same = all(torch.allclose(fresh(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    other = folder / f"plan{(rank + 1) % world}.tt"
    dist.barrier()  # every rank's file is written
    try:
        tt.load(sharded_model(rank, world), other, backends=[Shortcut()])
        refused = ""
    except tt.CheckpointError as exc:
        refused = str(exc)
    return {"depth": result.selected_depth, "digest": plan_digest(model),
            "chosen": {p: m.backend for p, m in result.modules.items()},
            "errors": {p: [c["error"] for s in m.signatures for c in s.candidates if c["backend"] == "FailsOnRank1"]
                       for p, m in result.modules.items()},
            "same": same, "loaded": loaded, "loaded_same": loaded_same, "refused": refused}


def _break_and_cache(rank: int, world: int, folder: Path) -> dict:
    os.environ["TORCH_TWEAK_CACHE"] = str(folder / f"cache{rank}")  # each rank its own cache folder
    data = dataset()
    with torch.inference_mode():
        expected = [full_model()(x) for x in data]
    tweaks = []
    for attempt in range(3):
        if attempt == 1 and rank == 1:
            tt.clear_cache()  # a hit on rank 0 only: every rank must tune afresh
        model = sharded_model(rank, world, slow_rank=1)
        result = tt.tweak(model, data, strategy=tt.HighestThroughputStrategy([BreaksOnRank1(), Shortcut()]),
                          measure=MEASURE, progress=False)
        with torch.inference_mode():
            same = all(torch.allclose(model(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
        errors = [c["error"] for m in result.modules.values() for g in m.signatures for c in g.candidates
                  if c["backend"] == "BreaksOnRank1"]
        tweaks.append({"cached": result.cached, "errors": errors, "digest": plan_digest(model), "same": same,
                       "chosen": {p: m.backend for p, m in result.modules.items()}})
    model = sharded_model(rank, world, slow_rank=1)  # tt.wrap + tt.tune: the same search, together
    tt.wrap(model, ["0", "1"])
    tuned = tt.tune(model, data, strategy=strategy(), measure=MEASURE)
    with torch.inference_mode():
        same = all(torch.allclose(model(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    return {"tweaks": tweaks, "tune": {"chosen": tuned, "same": same}}


def check_agreed(results: list[dict], world: int) -> None:
    first = results[0]
    for r, got in enumerate(results):
        assert got["same"] and got["loaded_same"], f"rank {r}: outputs differ from the unsharded model's"
        assert got["digest"] == first["digest"] and got["chosen"] == first["chosen"], f"rank {r} kept another plan"
        # the depth kept turns on the machine's noise (4 ranks on 2 cores): the same on every rank is what counts
        assert got["depth"] == first["depth"], f"rank {r} kept another depth: {got}"
        # the blocks keep the shortcut (the head may keep Torch Eager, the baseline every strategy tries);
        # no module keeps the failing or the lagging candidate
        assert [got["chosen"][p] for p in ("0", "1")] == ["Shortcut"] * 2, got["chosen"]
        assert not {"FailsOnRank1", "LagsOnRank1"} & set(got["chosen"].values()), got["chosen"]
        for path, errors in got["errors"].items():
            assert errors and all("rank 1" in e for e in errors), (r, path, errors)
        assert "rank" in got["refused"] and f"{world} processes" in got["refused"], got["refused"]


@pytest.mark.slow
def test_two_ranks_keep_one_plan_measured_by_the_slowest(tmp_path):
    results = run_ranks(_tune_save_load, 2, tmp_path)
    check_agreed(results, 2)


@pytest.mark.slow
def test_a_call_failing_on_one_rank_and_a_cache_hit_on_one_rank_are_agreed(tmp_path):
    results = run_ranks(_break_and_cache, 2, tmp_path, timeout=180.0)
    for r, got in enumerate(results):  # the slowest rank's latency chose, on every rank alike
        assert got["tune"] == {"chosen": {"0": "Shortcut", "1": "Shortcut"}, "same": True}, (r, got["tune"])
    for i in range(3):
        tweaks = [got["tweaks"][i] for got in results]
        # rank 1's miss is everyone's; a hit (the third tweak, unless its figures were not replayable) is agreed
        assert len({t["cached"] for t in tweaks}) == 1 and (i != 1 or not tweaks[0]["cached"]), (i, tweaks)
        for r, t in enumerate(tweaks):
            assert t["same"] and t["digest"] == tweaks[0]["digest"], (i, r, t)
            assert "BreaksOnRank1" not in t["chosen"].values(), (i, r, t)
            if not t["cached"]:  # failed while measured, on every rank, naming rank 1 (on rank 0: "failed on rank 1")
                assert t["errors"] and all("rank 1" in e for e in t["errors"]), (i, r, t["errors"])


@pytest.mark.slow
def test_four_ranks_keep_one_plan(tmp_path):
    results = run_ranks(_tune_save_load, 4, tmp_path, timeout=240.0)
    check_agreed(results, 4)


def _default_backends(rank: int, world: int, folder: Path) -> dict:
    model = sharded_model(rank, world)
    data = dataset()
    with torch.inference_mode():
        expected = [full_model()(x) for x in data]
    result = tt.tweak(model, data, measure=MEASURE, cache=False, progress=False)
    with torch.inference_mode():
        same = all(torch.allclose(model(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    return {"same": same, "digest": plan_digest(model),
            "states": {c["backend"]: (c["state"], c["error"]) for m in result.modules.values() for g in m.signatures
                       for c in g.candidates}}


@pytest.mark.slow
def test_two_ranks_with_the_default_backends(tmp_path):
    """Inductor compiles modules holding the all_reduce (dynamo traces the collective) on both
    ranks; OpenVINO, whose build runs in a child process, is not built under ranks."""
    results = run_ranks(_default_backends, 2, tmp_path, timeout=240.0)
    for r, got in enumerate(results):
        assert got["same"] and got["digest"] == results[0]["digest"], (r, got)
        assert got["states"]["TorchInductor"][0] in ("measured", "built"), got["states"]
        if "OpenVINO" in got["states"]:
            assert "child process" in got["states"]["OpenVINO"][1], got["states"]


# ------------------------------------------------- transformers' tensor parallelism


def tiny_llama(folder: Path) -> None:
    """A tiny Llama saved to `folder`, for transformers' from_pretrained(tp_plan="auto")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)  # as Llama-3.2-1B and 3B ship
    LlamaForCausalLM(config).save_pretrained(folder / "llama")


def _tune_llama(rank: int, world: int, folder: Path) -> dict:
    from transformers import AutoModelForCausalLM

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    model = AutoModelForCausalLM.from_pretrained(folder / "llama", tp_plan="auto", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder / "llama", dtype=torch.float32).eval()
    sharded = type(model.model.layers[0].mlp.down_proj.weight).__name__
    torch.manual_seed(2)
    data = [{"input_ids": torch.randint(0, 64, (1, 6))} for _ in range(2)]
    with torch.inference_mode():
        expected = [reference(**x).logits for x in data]
    result = tt.tweak(model, data, strategy=tt.HighestThroughputStrategy([FailsOnRank1(), LagsOnRank1()]),
                      measure=MEASURE, cache=False, progress=False, max_depth=2)
    with torch.inference_mode():
        same = all(torch.allclose(model(**x).logits, e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    return {"sharded": sharded, "depth": result.selected_depth, "digest": plan_digest(model), "same": same,
            "chosen": sorted({m.backend or "" for m in result.modules.values()})}


@pytest.mark.slow
def test_two_ranks_tune_a_transformers_tp_plan(tmp_path):
    """transformers' own tensor parallelism (tp_plan="auto": DTensor weights, its hooks'
    all_reduce on gloo) tuned together; needs accelerate, as tp_plan does."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
    tiny_llama(tmp_path)
    results = run_ranks(_tune_llama, 2, tmp_path)
    for r, got in enumerate(results):
        assert got["sharded"] == "DTensor", got
        assert got["same"], f"rank {r}: logits differ from the unsharded model's"
        assert got["digest"] == results[0]["digest"], f"rank {r} kept another plan"
        assert "FailsOnRank1" not in got["chosen"], got


# ------------------------------------------------------------- one process alone


class FakeRanks:
    """What enter_build reads of a Ranks: its backend, and the barrier it waits at."""

    def __init__(self, backend: str, others_used: bool = False) -> None:
        self.backend = backend
        self.barriers = 0
        self.others_used = others_used  # another rank's time budget is used up
        self.asked = 0

    def any(self, flag: bool) -> bool:
        self.asked += 1
        return flag or self.others_used

    def barrier(self) -> None:
        self.barriers += 1


class Recording(Shortcut):
    name = "Recording"
    records_graph = True


class Isolated(Shortcut):
    name = "Isolated"
    isolate_build = True


def test_candidates_refused_under_ranks():
    from torch_tweak._core import distributed

    assert distributed.enter_build(Recording()) is None  # alone: nothing refused, no barrier
    gloo = FakeRanks("gloo")
    with distributed.using(gloo):
        assert "NCCL" in distributed.enter_build(Recording()) and "gloo" in distributed.enter_build(Recording())
        assert "child process" in distributed.enter_build(Isolated())
        assert distributed.enter_build(Shortcut()) is None
    assert gloo.barriers == 0
    nccl = FakeRanks("nccl")
    with distributed.using(nccl):
        assert distributed.enter_build(Recording()) is None
        assert distributed.current() is nccl
    assert nccl.barriers == 1, "a graph recording begins on every rank together"
    assert distributed.current() is None


def test_a_bad_group_is_refused_and_the_model_left_as_it_was():
    model = full_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for bad, kind in ((True, TypeError), ("world", TypeError), (3, TypeError)):
        with pytest.raises(kind, match="group must be"):
            tt.tweak(model, dataset(), group=bad, cache=False, progress=False)
    from torch_tweak._runtime.module import installed

    assert not installed(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert type(model) is nn.Sequential


def test_the_forms_ranks_compare_and_what_they_say_when_they_differ():
    """Ranks.same_calls compares every call's structure, dtypes and sizes (signatures.call_form)
    before the model runs; a difference nested where describe_call shows only a type counts."""
    from torch_tweak._core.distributed import _calls_differ
    from torch_tweak._core.signatures import call_form

    x = torch.zeros(4, WIDTH)
    assert call_form(((x,), {"mask": torch.ones(4, 3, dtype=torch.long)})) == "(float32[4, 16], mask=int64[4, 3])"
    nested = [call_form(((x, [torch.zeros(1), (torch.zeros(n),)]), {})) for n in (4, 5)]
    assert nested[0] != nested[1] and nested[0].startswith("(float32[4, 16], [float32[1], tuple]) holding ")
    assert _calls_differ([["(a)", "(b)"], ["(a)", "(c)"]], "of the dataset", "tt.tweak").startswith(
        "the ranks call tt.tweak with different inputs: call 1 of the dataset is rank 0 (b); rank 1 (c); every rank "
        "must pass calls of the same structure, dtypes and sizes")
    assert "call 1 of the dataset is rank 0 (b); rank 1 none (it has 1 calls)" in _calls_differ(
        [["(a)", "(b)"], ["(a)"]], "of the dataset", "tt.tweak")


def test_saved_ranks_must_match_the_loading_process():
    from torch_tweak._store.checkpoint import CheckpointError, _check_ranks

    _check_ranks({}, None, "old.tt")  # a file from before: loads alone
    with pytest.raises(CheckpointError, match="single process.*rank 1 of 2.*one file per rank"):
        _check_ranks({}, (1, 2), "old.tt")
    saved = {"ranks": {"rank": 1, "world_size": 2}}
    _check_ranks(saved, (1, 2), "r1.tt")
    with pytest.raises(CheckpointError, match=r"rank 1 of 2 processes.*runs alone.*torchrun --nproc-per-node 2"):
        _check_ranks(saved, None, "r1.tt")
    with pytest.raises(CheckpointError, match="rank 1 of 2 processes, and this is rank 0 of 2"):
        _check_ranks(saved, (0, 2), "r1.tt")
    with pytest.raises(CheckpointError, match=r"and this is rank 1 of 4 processes.*tune again"):
        _check_ranks(saved, (1, 4), "r1.tt")
    for forged in ({"rank": 2, "world_size": 2}, {"rank": "0", "world_size": 2}, [0, 2]):
        with pytest.raises(CheckpointError, match="its manifest's ranks are not a rank and a world size; .*tt.save "
                                                  "does not write that"):
            _check_ranks({"ranks": forged}, (0, 2), "forged.tt")


@pytest.mark.slow
def test_a_single_process_file_says_no_ranks_and_loads(tmp_path):
    model = full_model()
    tt.tweak(model, dataset(), strategy=tt.FirstWinsStrategy([Shortcut()]), max_depth=0, measure=MEASURE,
             cache=False, progress=False)
    tt.save(model, tmp_path / "alone.tt")
    from torch_tweak._store import checkpoint

    manifest = checkpoint._read(tmp_path / "alone.tt", 1 << 30, None)[0]
    assert "ranks" not in manifest
    fresh = full_model()
    tt.load(fresh, tmp_path / "alone.tt", backends=[Shortcut()])
    with torch.inference_mode():
        assert all(torch.allclose(fresh(x), full_model()(x)) for x in dataset())



# ------------------------------------------- a rank that raises, ranks that differ (issue 49, 5)


class RaisingRowParallel(nn.Module):
    """RowParallel whose all_reduce runs on `group` and which, on rank 0, raises before it from
    its `at`-th call on: the other rank waits in that all_reduce."""

    def __init__(self, row: RowParallel, group, at: int) -> None:
        super().__init__()
        self.row, self.group, self.at, self.calls = row, group, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 0 and 0 < self.at <= self.calls:
            raise RuntimeError("this model raised on rank 0 before its all_reduce")
        y = F.linear(x, self.row.weight)
        dist.all_reduce(y, group=self.group)
        return y + self.row.bias


def _raises_and_differs(rank: int, world: int, folder: Path) -> dict:
    data = dataset()
    with torch.inference_mode():
        expected = [full_model()(x) for x in data]
    found = {}
    for name, at in (("running the dataset", 1), ("measuring", 3)):
        # the user's own gloo group, with a short timeout: the rank left waiting in the model's
        # all_reduce leaves it then
        user = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
        model = sharded_model(rank, world)
        model[1].down = RaisingRowParallel(model[1].down, user, at).eval()
        try:
            tt.tweak(model, data, strategy=tt.OneBackendStrategy(Shortcut()), max_depth=0, measure=MEASURE,
                     cache=False, progress=False, group=user)
            found[name] = "no error"
        except Exception as exc:
            found[name] = f"{type(exc).__name__}: {exc} " + " ".join(getattr(exc, "__notes__", []))
        model[1].down.at, model[1].down.group = 0, None  # the default group: the user's timed out on a rank
        with torch.inference_mode():
            found[name + " same"] = not tt.installed(model) and all(
                torch.allclose(model(x), e, atol=1e-5, rtol=1e-4) for x, e in zip(data, expected))
    for name, options in (("max_depth", {"max_depth": rank}), ("shapes", {"shapes": {"batch": (1, 4 + 4 * rank)}})):
        model = sharded_model(rank, world)
        try:
            tt.tweak(model, data, strategy=tt.OneBackendStrategy(Shortcut()), measure=MEASURE, cache=False,
                     progress=False, **options)
            found[name] = "no error"
        except Exception as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
        found[name + " untouched"] = not tt.installed(model) and type(model) is nn.Sequential
    return found


@pytest.mark.slow
def test_a_rank_that_raises_and_ranks_that_differ_get_an_error_on_every_rank(tmp_path):
    """A rank whose model raised before its own all_reduce sent its agreement into the user's
    gloo group, where it paired with the other rank's model all_reduce: gloo aborted the
    process (SIGABRT). Ranks that differ in max_depth or shapes= aborted the same way. Now the
    agreement has its own group, and the settings are compared before anything runs: every
    rank raises, naming the other rank's failure or what differed, and every model answers as
    the unsharded one."""
    results = run_ranks(_raises_and_differs, 2, tmp_path, timeout=180.0)
    for r, got in enumerate(results):
        for name in ("running the dataset", "measuring"):
            assert got[name + " same"], (r, name, got)
            assert "raised on rank 0 before its all_reduce" in got[name], (r, name, got[name])
            if r == 1:  # its own error (a timeout in the model's all_reduce) and rank 0's, named
                assert "on rank 0" in got[name] and "this rank" in got[name] and "Timed out" in got[name], got[name]
        assert got["max_depth"].startswith("ValueError: the ranks call tt.tweak with different settings"), got
        assert "max_depth: rank 0 0, rank 1 1" in got["max_depth"], got["max_depth"]
        assert "shapes: rank 0 {'batch': [1, 4]}, rank 1 {'batch': [1, 8]}" in got["shapes"], got["shapes"]
        assert got["max_depth untouched"] and got["shapes untouched"], got


# ------------------------------------------------------------------- who speaks


class NeverBuilds(tt.Backend):
    """Every build fails: each module keeps its forward, which tweak logs as a WARNING (with no
    handler configured, logging's last resort prints it on stderr)."""

    name = "NeverBuilds"

    def build(self, module, samples, device):
        raise RuntimeError("this backend builds nothing")


def _speakers(rank: int, world: int, folder: Path) -> dict:
    """Two tweaks of the whole model on every rank, each rank's stderr written to a file: the
    default (rank 0 speaks), then rank 0 with progress=False and rank 1 with progress=True."""
    import logging

    logging.getLogger("torch_tweak").propagate = True  # as a user has it: no handler configured
    printed = {}
    for name, progress in (("default", None), ("asked", rank == 1)):
        path = folder / f"stderr-{name}-{rank}.txt"
        stream, sys.stderr = sys.stderr, open(path, "w")
        try:
            tt.tweak(full_model(), dataset(), strategy=tt.OneBackendStrategy(NeverBuilds()), measure=MEASURE,
                     cache=False, max_depth=0, progress=progress)
        finally:
            sys.stderr.close()
            sys.stderr = stream
        printed[name] = path.read_text()
    return printed


@pytest.mark.slow
def test_rank_0_alone_speaks_unless_a_rank_asks(tmp_path):
    """Under torchrun every rank printed the busy machine's message, a rank with progress=False
    too: what the group decided is said once, by rank 0; progress=True makes a rank speak, and
    progress=False silences one, its warnings included."""
    first, second = run_ranks(_speakers, 2, tmp_path)
    assert "keeps its forward" in first["default"] and "tuned in" in first["default"], first["default"]
    assert second["default"] == ""
    assert first["asked"] == ""
    assert "keeps its forward" in second["asked"] and "tuned in" in second["asked"], second["asked"]


# -------------------------------------------------- ranks that disagree on how they run (issue 53, 9)

GROUP_TIMEOUT = 5.0  # the user's group's timeout: every rank must end with its error within about it


def _elapsed(fn) -> tuple[str, float]:
    """(fn()'s error as 'Type: message notes', or 'no error'; the seconds it took)."""
    start = time.monotonic()
    try:
        fn()
        found = "no error"
    except Exception as exc:
        found = f"{type(exc).__name__}: {exc} " + " ".join(getattr(exc, "__notes__", []))
    return found, time.monotonic() - start


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model: nn.Module, before: dict, cls: type = nn.Sequential) -> bool:
    state = model.state_dict()
    return (not tt.installed(model) and type(model) is cls and state.keys() == before.keys()
            and all(torch.equal(before[k], v) for k, v in state.items()))


def _disagree(rank: int, world: int, folder: Path) -> dict:
    """On the user's own gloo groups (a short timeout): the ranks' datasets of different batch
    sizes; then rank 0 passes group=False to tt.load and to tt.tweak while rank 1 does not
    (each on a group of its own: an agreement that timed out is closed)."""
    users = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT)) for _ in range(2)]

    def on_user(model, user):
        for block in model[:2]:
            block.down = RaisingRowParallel(block.down, user, 0).eval()  # its all_reduce on the user's group
        return model

    found = {}
    alone = full_model()  # no collectives: each rank tunes it alone and saves its rank's file
    tt.tweak(alone, dataset(), strategy=tt.FirstWinsStrategy([Shortcut()]), max_depth=0, measure=MEASURE,
             cache=False, progress=False, group=False)
    tt.save(alone, folder / f"rank{rank}.tt")

    model = on_user(sharded_model(rank, world), users[0])
    before = _state(model)
    torch.manual_seed(1)
    data = [torch.randn(BATCH * (1 + rank), WIDTH) for _ in range(2)]  # rank 1's calls are twice as large
    found["sizes"], found["sizes s"] = _elapsed(lambda: tt.tweak(
        model, data, strategy=tt.OneBackendStrategy(Shortcut()), max_depth=0, measure=MEASURE, cache=False,
        progress=False, group=users[0]))
    found["sizes untouched"] = _untouched(model, before)

    fresh = full_model()
    before = _state(fresh)
    found["load"], found["load s"] = _elapsed(lambda: tt.load(  # the ranks have met on users[0] before
        fresh, folder / f"rank{rank}.tt", backends=[Shortcut()], group=False if rank == 0 else users[0]))
    found["load untouched"] = _untouched(fresh, before)

    model = on_user(sharded_model(rank, world), users[1])
    before = _state(model)
    found["tweak"], found["tweak s"] = _elapsed(lambda: tt.tweak(  # the first meeting on users[1]
        model, dataset(), strategy=tt.OneBackendStrategy(Shortcut()), max_depth=0, measure=MEASURE, cache=False,
        progress=False, group=False if rank == 0 else users[1]))
    found["tweak untouched"] = _untouched(model, before)
    found["again"] = _elapsed(lambda: tt.tweak(full_model(), dataset(), group=users[0]))[0] if rank == 1 else ""
    return found


@pytest.mark.slow
def test_ranks_that_disagree_end_with_one_error_on_every_rank_within_the_groups_timeout(tmp_path):
    """Ranks whose datasets differ in size aborted the process (gloo: "Received data size doesn't
    match", in the model's all_reduce); a rank left alone by another's group=False to tt.tweak or
    tt.load waited until it was killed, far past the group's timeout. Now the calls' sizes are
    compared before the model runs, and the ranks meet within the group's timeout."""
    results = run_ranks(_disagree, 2, tmp_path, timeout=120.0)
    bound = GROUP_TIMEOUT + 5.0  # the group's timeout, and the time to start a tweak on a busy machine
    for r, got in enumerate(results):
        assert got["sizes"].startswith("ValueError: the ranks call tt.tweak with different inputs: call 0 of the "
                                       "dataset is rank 0 (float32[4, 16]); rank 1 (float32[8, 16])"), got["sizes"]
        assert got["sizes s"] < bound and got["sizes untouched"], got
        for case in ("load", "tweak"):
            assert got[f"{case} s"] < bound and got[f"{case} untouched"], (r, case, got)
    zero, one = results
    assert zero["load"].startswith("CheckpointError: ") and "this process runs alone" in zero["load"], zero["load"]
    assert "Timed out" in zero["tweak"] and "called tt.tweak with group=False (alone)" in zero["tweak"], zero["tweak"]
    for case, call in (("load", "tt.load"), ("tweak", "tt.tweak")):
        assert one[case].startswith(f"RanksTimedOut: torch-tweak's agreement of the 2 ranks timed out meeting the "
                                    f"other ranks (rank 1 waited 5 s of at most 5 s; the group's timeout is 5 s): "
                                    f"every rank must call {call} at the same point of its program, with the same "
                                    "group="), one[case]
    assert one["again"].startswith("RanksTimedOut: torch-tweak's agreement of these ranks timed out earlier in this "
                                   "process (tt.load, meeting the other ranks), and torch closed its connections: "
                                   "start the ranks again (torchrun)"), one["again"]
