"""torch_tweak._C's engine bindings: Tree, measure, compare, choose, tweak, Result.

Every measurement runs on a fake clock: a run callback advances a counter that
the clock reads, so latencies, and every decision made on them, are exact.
"""

from __future__ import annotations

import pytest

from torch_tweak import _C


class FakeClock:
    def __init__(self) -> None:
        self.now = 0
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.now

    def runner(self, cost_ns):
        """run(i) that takes cost_ns (an int, or a function of i)."""

        def run(i: int) -> None:
            self.now += cost_ns(i) if callable(cost_ns) else cost_ns

        return run


# ------------------------------------------------------------------------- Tree

MODULES = [("", 1, 1000), ("enc", 2, 600), ("enc.0", 2, 300), ("enc.1", 2, 250), ("head", 1, 100)]


def test_tree_queries():
    t = _C.Tree(MODULES)
    assert len(t) == 5
    assert t.max_depth == 2
    assert [t.path(i) for i in range(5)] == ["", "enc", "enc.0", "enc.1", "head"]
    assert [t.depth(i) for i in range(5)] == [0, 1, 2, 2, 1]
    assert [t.parent(i) for i in range(5)] == [-1, 0, 1, 1, 0]
    assert [t.child_count(i) for i in range(5)] == [2, 2, 0, 0, 0]
    assert t.calls(1) == 2 and t.time_ns(3) == 250
    assert t.find("enc.1") == 3 and t.find("nope") == -1 and t.find("") == 0
    assert t.cut(0) == [0]
    assert t.cut(1) == [1, 4]
    assert t.cut(2) == [2, 3, 4]  # head has no children: it stays in deeper cuts
    assert t.distinct_depths() == [0, 1, 2]
    assert t.distinct_depths(1) == [1, 2]
    assert t.distinct_depths(0, 1) == [0, 1]
    text = t.format()
    assert "enc.0" in text and "head" in text


def test_tree_root_may_come_in_any_order_and_containers_add_no_level():
    t = _C.Tree([("blocks.0", 1, 0), ("", 1, 0), ("blocks.1", 1, 0)])
    assert t.parent(0) == 1 and t.depth(0) == 1 and t.max_depth == 1


def test_tree_errors():
    with pytest.raises(ValueError, match="modules\\[1\\]"):
        _C.Tree([("", 1, 0), ("", 1, 0)])
    with pytest.raises(ValueError):
        _C.Tree([("a", 1, 0)])  # no root
    with pytest.raises(TypeError, match="modules\\[0\\]"):
        _C.Tree([("", 1)])
    with pytest.raises(ValueError, match="calls"):
        _C.Tree([("", -1, 0)])
    with pytest.raises(ValueError, match="time_ns"):
        _C.Tree([("", 1, 1.5)])
    with pytest.raises(ValueError, match="NUL"):
        _C.Tree([("", 1, 0), ("a\0b", 1, 0)])
    t = _C.Tree(MODULES)
    with pytest.raises(IndexError):
        t.path(5)
    with pytest.raises(IndexError):
        t.depth(-1)
    with pytest.raises(ValueError):
        t.cut(-1)
    with pytest.raises(ValueError):
        t.distinct_depths(2, 1)


# ---------------------------------------------------------------------- measure


def test_default_measure_config():
    cfg = _C.default_measure_config()
    assert cfg == {"warmup_min": 2, "warmup_max": 20, "warmup_patience": 2, "warmup_gain": 0.02,
                   "rounds_min": 5, "rounds_max": 50, "rel_spread": 0.05, "time_cap": 5.0,
                   "stop_when_decided": True, "settle": 1, "round_min": 0.0}


def test_a_round_of_round_min_seconds_goes_over_the_samples_again_and_reads_their_mean():
    """One call in ten stalls for 5 ms (a busy machine's scheduler): rounds of one pass read the
    quiet call, rounds of 20 ms the mean; a round longer than 1 s is refused."""
    clock = FakeClock()
    calls = []
    run = clock.runner(lambda i: calls.append(i) or (5_100_000 if len(calls) % 10 == 0 else 100_000))
    quick = {"warmup_min": 0, "warmup_max": 0, "rounds_min": 40, "rounds_max": 40, "time_cap": 0}
    assert _C.measure(run, 2, clock=clock, config=quick)["median_ns"] < 200_000
    calls.clear()
    stats = _C.measure(run, 2, clock=clock, config=dict(quick, round_min=0.02))
    assert 550_000 < stats["median_ns"] < 650_000 and len(calls) == 40 * 2 * 20
    with pytest.raises(ValueError, match="round_min"):
        _C.measure(run, 2, clock=clock, config=dict(quick, round_min=2.0))


def test_measure_on_a_fake_clock():
    clock = FakeClock()
    samples = []
    run = clock.runner(lambda i: samples.append(i) or 1000 * (i + 1))
    stats = _C.measure(run, 2, clock=clock)
    # mean per call of a round: (1000 + 2000) / 2, every round alike
    assert stats["median_ns"] == 1500.0 and stats["min_ns"] == 1500.0
    assert stats["spread"] == 0.0 and stats["stopped_by"] == "spread"
    assert stats["rounds"] == 5  # rounds_min, since the spread is 0 at once
    assert 2 <= stats["warmup_rounds"] <= 20
    assert set(samples) == {0, 1}
    assert len(samples) == 2 * (stats["rounds"] + stats["warmup_rounds"])
    assert set(stats) == {"median_ns", "q25_ns", "q75_ns", "min_ns", "spread", "warmup_rounds",
                          "rounds", "stopped_by"}


def test_measure_calls_sync_around_every_run():
    clock = FakeClock()
    events = []
    run = clock.runner(lambda i: events.append("run") or 10)
    _C.measure(run, 1, clock=clock, sync=lambda: events.append("sync"),
               config={"warmup_min": 0, "warmup_max": 0, "rounds_min": 1, "rounds_max": 1})
    assert events == ["sync", "run", "sync"]


def test_measure_stop_rules_follow_the_config():
    clock = FakeClock()
    rounds = {"n": 0}

    def noisy(i):  # alternating rounds of 1 us and 3 us: the spread never settles
        rounds["n"] += 1
        return 1000 if rounds["n"] % 2 else 3000

    stats = _C.measure(clock.runner(noisy), 1, clock=clock,
                       config={"warmup_min": 0, "warmup_max": 0, "rounds_min": 3, "rounds_max": 7})
    assert stats["stopped_by"] == "rounds" and stats["rounds"] == 7 and stats["warmup_rounds"] == 0
    stats = _C.measure(clock.runner(noisy), 1, clock=clock,
                       config={"warmup_min": 0, "warmup_max": 0, "rounds_min": 3, "rounds_max": 50,
                               "time_cap": 10e-6})  # 10 us: a handful of rounds
    assert stats["stopped_by"] == "time" and stats["rounds"] < 50


def test_measure_config_errors():
    clock = FakeClock()
    run = clock.runner(1)
    with pytest.raises(ValueError, match="rounds_mni"):
        _C.measure(run, 1, clock=clock, config={"rounds_mni": 3})
    with pytest.raises(ValueError, match="rounds_min"):
        _C.measure(run, 1, clock=clock, config={"rounds_min": "3"})
    with pytest.raises(ValueError, match="warmup_max"):
        _C.measure(run, 1, clock=clock, config={"warmup_max": -1})
    with pytest.raises(ValueError, match="rel_spread"):
        _C.measure(run, 1, clock=clock, config={"rel_spread": float("nan")})
    with pytest.raises(ValueError, match="time_cap"):
        _C.measure(run, 1, clock=clock, config={"time_cap": -1.0})
    with pytest.raises(ValueError):  # the engine's own check
        _C.measure(run, 1, clock=clock, config={"rounds_min": 9, "rounds_max": 3})
    with pytest.raises(ValueError):
        _C.measure(run, 0, clock=clock)
    with pytest.raises(ValueError, match="n_samples"):
        _C.measure(run, -1, clock=clock)
    with pytest.raises(TypeError, match="config"):
        _C.measure(run, 1, clock=clock, config=[("rounds_min", 1)])
    with pytest.raises(ValueError, match="stop_when_decided.*True or False"):
        _C.measure(run, 1, clock=clock, config={"stop_when_decided": 1})
    with pytest.raises(TypeError, match="run"):
        _C.measure(None, 1)
    with pytest.raises(TypeError, match="clock"):
        _C.measure(run, 1, clock=5)
    assert clock.now == 0  # nothing ran


def test_measure_callback_error_becomes_engine_error_with_cause():
    error = ValueError("boom")

    def run(i):
        raise error

    with pytest.raises(_C.EngineError, match="ValueError: boom") as info:
        _C.measure(run, 1, clock=FakeClock())
    assert isinstance(info.value, RuntimeError)
    assert info.value.__cause__ is error


def test_measure_interrupt_propagates_unchanged():
    interrupt = KeyboardInterrupt("stop")
    clock = FakeClock()
    calls = []

    def run(i):
        calls.append(i)
        if len(calls) == 3:
            raise interrupt
        clock.now += 5

    with pytest.raises(KeyboardInterrupt) as info:
        _C.measure(run, 1, clock=clock)
    assert info.value is interrupt
    assert len(calls) == 3  # the engine stopped at once


def test_measure_bad_clock_stops_the_measurement():
    with pytest.raises(TypeError, match="clock\\(\\) must return an int"):
        _C.measure(lambda i: None, 1, clock=lambda: "now")

    def stop():
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        _C.measure(lambda i: None, 1, clock=stop)


def test_measure_without_a_clock_uses_the_real_one():
    stats = _C.measure(lambda i: None, 1, config={"rounds_min": 1, "rounds_max": 2})
    assert stats["median_ns"] >= 0 and 1 <= stats["rounds"] <= 2


# ---------------------------------------------------------------------- compare


def test_compare_interleaves_and_reports_each():
    clock = FakeClock()
    order = []
    runs = [clock.runner(lambda i, k=k: order.append(k) or (k + 1) * 1000) for k in range(3)]
    stats = _C.compare(runs, 1, clock=clock)
    assert [s["median_ns"] for s in stats] == [1000.0, 2000.0, 3000.0]
    assert order[-6:] == [0, 0, 1, 1, 2, 2]  # the measured rounds go A, B, C, each opened by an untimed call
    with pytest.raises(ValueError):
        _C.compare([], 1, clock=clock)
    with pytest.raises(TypeError):
        _C.compare([clock.runner(1), 3], 1, clock=clock)


def test_measure_paired_sees_a_load_both_rounds_share_and_refuses_bad_settings():
    """Paired rounds from Python (the engine's tw_measure_paired): a burst that slows every
    round of a stretch alike leaves each pair's ratio, and so the median, as it was."""
    clock = FakeClock()
    state = {"rounds": 0}

    def cost(base):
        def of(i):
            state["rounds"] += 1
            return base * (5 if 40 <= state["rounds"] < 80 else 1)  # a burst of other work
        return of

    paired = _C.measure_paired(clock.runner(cost(3000)), clock.runner(cost(1000)), 1, clock=clock,
                               rounds_min=20, rounds_max=20)
    assert paired["rounds"] == 20 and paired["wins"] == 20
    assert paired["ratio"] == pytest.approx(3.0) and paired["low"] == pytest.approx(3.0)
    assert paired["high"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="rounds_min \\(3\\) is under 8"):
        _C.measure_paired(clock.runner(1), clock.runner(1), 1, clock=clock, rounds_min=3)
    with pytest.raises(ValueError, match="width"):
        _C.measure_paired(clock.runner(1), clock.runner(1), 1, clock=clock, width=-1.0)
    with pytest.raises(TypeError, match="second must be callable"):
        _C.measure_paired(clock.runner(1), 3, 1, clock=clock)


@pytest.mark.parametrize("name, value", [("rounds_max", 2 ** 40), ("rounds_max", 2 ** 32), ("rounds_max", -5),
                                         ("rounds_min", -1), ("rounds_min", 2 ** 70), ("rounds_max", 2000)])
def test_measure_paired_names_the_value_it_was_given(name, value):
    """A count of rounds out of range is refused with the value the caller gave (never the 0
    a conversion made of it), before any round runs."""
    clock = FakeClock()
    ran = []
    with pytest.raises(ValueError, match=rf"paired {name} \({value}\)"):
        _C.measure_paired(clock.runner(lambda i: ran.append(i) or 1), clock.runner(1), 1, clock=clock,
                          **{name: value})
    assert not ran


def test_compare_stops_once_the_fastest_is_clear_unless_told_not_to():
    clock = FakeClock()
    count = {"n": 0}

    def noisy(i):  # 3 us and 5 us rounds: its spread never settles
        count["n"] += 1
        return 3000 if count["n"] % 2 else 5000

    # settle 0: every call of `noisy` is timed, so its rounds alternate 3 and 5 us
    cfg = {"warmup_min": 0, "warmup_max": 0, "rounds_min": 4, "rounds_max": 20, "settle": 0}
    fast, slow = _C.compare([clock.runner(1000), clock.runner(noisy)], 1, clock=clock, config=cfg)
    assert fast["stopped_by"] == slow["stopped_by"] == "decided" and fast["rounds"] == 4
    assert fast["median_ns"] == 1000.0 and slow["spread"] > 0.05
    cfg["stop_when_decided"] = False
    fast, slow = _C.compare([clock.runner(1000), clock.runner(noisy)], 1, clock=clock, config=cfg)
    assert fast["stopped_by"] == "rounds" and fast["rounds"] == 20


def test_compared_rounds_open_with_untimed_calls():
    """A compared runner's round opens with `settle` untimed calls: a first call slowed by the
    runner before it (here every call that follows the other runner takes 9 us) is left out."""
    clock = FakeClock()
    last = {"who": None}
    calls = {"a": 0, "b": 0}

    def runner(name):
        def run(i):
            calls[name] += 1
            woke = last["who"] not in (None, name)
            last["who"] = name
            return 9000 if woke else 1000
        return run

    cfg = {"warmup_min": 0, "warmup_max": 0, "rounds_min": 5, "rounds_max": 5, "stop_when_decided": False}
    a, b = _C.compare([clock.runner(runner("a")), clock.runner(runner("b"))], 2, clock=clock, config=cfg)
    assert a["median_ns"] == b["median_ns"] == 1000.0  # the slow first call of each round was not timed
    assert calls == {"a": 5 * 3, "b": 5 * 3}
    calls.update(a=0, b=0)
    a, b = _C.compare([clock.runner(runner("a")), clock.runner(runner("b"))], 2, clock=clock,
                      config=dict(cfg, settle=0))
    assert a["median_ns"] == b["median_ns"] == 5000.0  # (9 + 1) / 2 us: the wake is in every round
    assert calls == {"a": 5 * 2, "b": 5 * 2}


# ----------------------------------------------------------------------- choose


def test_choose_highest_throughput():
    clock = FakeClock()
    built = []

    def build(name, fail=False):
        def b():
            built.append(name)
            if fail:
                raise RuntimeError(f"{name} does not build")

        return b

    cands = [("slow", build("slow"), clock.runner(3000)),
             ("broken", build("broken", True), clock.runner(1)),
             ("fast", build("fast"), clock.runner(1000))]
    winner, reports = _C.choose("highest-throughput", cands, 2, clock=clock)
    assert winner == 2
    assert built == ["slow", "broken", "fast"]
    assert [r["name"] for r in reports] == ["slow", "broken", "fast"]
    assert [r["state"] for r in reports] == ["measured", "failed", "measured"]
    assert "RuntimeError: broken does not build" in reports[1]["error"]
    assert reports[1]["stats"] is None and reports[0]["error"] == ""
    assert reports[0]["stats"]["median_ns"] == 3000.0 and reports[2]["stats"]["median_ns"] == 1000.0


def test_choose_first_wins_and_one_backend():
    clock = FakeClock()

    def fails():
        raise ValueError("no")

    cands = [("a", fails, clock.runner(1)), ("b", lambda: None, clock.runner(1)),
             ("c", lambda: None, clock.runner(1))]
    winner, reports = _C.choose("first-wins", cands, 1, clock=clock)
    assert winner == 1
    assert [r["state"] for r in reports] == ["failed", "built", "not tried"]
    winner, reports = _C.choose("one-backend", cands[:1], 1, clock=clock)
    assert winner == -1 and reports[0]["state"] == "failed"
    with pytest.raises(ValueError):
        _C.choose("one-backend", cands, 1, clock=clock)
    with pytest.raises(ValueError, match="fastest"):
        _C.choose("fastest", cands, 1, clock=clock)
    with pytest.raises(TypeError, match="candidates\\[0\\]"):
        _C.choose("first-wins", [("a", fails)], 1, clock=clock)


def test_choose_interrupt_from_build_propagates():
    def build():
        raise KeyboardInterrupt

    later = []
    cands = [("a", build, lambda i: None), ("b", lambda: later.append(1), lambda i: None)]
    with pytest.raises(KeyboardInterrupt):
        _C.choose("highest-throughput", cands, 1, clock=FakeClock())
    assert later == []


# ------------------------------------------------------------------------ tweak

# root "" -> enc -> enc.0, enc.1 ; root -> head.  Cuts: depth 0 [root], 1 [enc, head], 2 [enc.0, enc.1, head]
TREE_MODULES = MODULES


class FakeModel:
    """The host side of a tweak: which cut is entered, which modules are tuned
    and active, and a model whose latency depends on that."""

    def __init__(self, clock, latency, fail=(), interrupt=None):
        self.clock = clock
        self.latency = latency            # frozenset(active nodes) -> ns; default: untuned
        self.fail = set(fail)             # nodes whose tune raises ValueError
        self.interrupt = interrupt        # node whose tune raises KeyboardInterrupt
        self.entered = None
        self.active = False
        self.tuned = set()
        self.log = []

    def enter(self, nodes, tune):
        assert self.entered is None, "enter without leave"
        assert all(isinstance(t, bool) for t in tune)
        self.log.append(("enter", tuple(nodes), tuple(tune)))
        self.entered = list(nodes)

    # the module search's callbacks: one signature group of one candidate per module
    def groups(self, node):
        self.log.append(("tune", node))
        return 1

    def group(self, node, group):
        return ("(x)", "first-wins", ("fake",), 1)

    def build(self, node, group, candidate):
        if node == self.interrupt:
            raise KeyboardInterrupt("tune interrupted")
        if node in self.fail:
            raise ValueError(f"node {node} does not tune")

    def run_candidate(self, node, group, candidate, sample):
        self.clock.now += 1

    def commit(self, node, group, chosen):
        self.log.append(("commit", node, chosen))
        if chosen >= 0:
            self.tuned.add(node)

    def activate(self):
        self.log.append(("activate",))
        self.active = True

    def leave(self):
        self.log.append(("leave",))
        self.entered = None
        self.active = False

    def run(self, i):
        on = frozenset(n for n in (self.entered or []) if self.active and n in self.tuned)
        self.clock.now += self.latency.get(on, 1000)

    def kwargs(self, **extra):
        return dict(enter=self.enter, modules=Modules(self), activate=self.activate, leave=self.leave,
                    run=self.run, n_samples=2, clock=self.clock, **extra)


class Modules:
    """The `modules` object of a tweak: the FakeModel's module-search callbacks."""

    def __init__(self, model):
        self.groups, self.group, self.build = model.groups, model.group, model.build
        self.run, self.commit = model.run_candidate, model.commit


def test_tweak_selects_the_shallowest_depth_within_the_tolerance():
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([0]): 900, frozenset([1, 4]): 600, frozenset([2, 3, 4]): 590})
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(max_depth=None))
    rows = result.rows
    assert [r["depth"] for r in rows] == [0, 1, 2]
    assert [r["modules"] for r in rows] == [1, 2, 3]
    assert [r["state"] for r in rows] == ["measured"] * 3
    assert [r["stats"]["median_ns"] for r in rows] == [900.0, 600.0, 590.0]
    assert result.selected == 1  # 600 is within 2 % of 590 and shallower
    assert result.baseline["median_ns"] == 1000.0
    # every node tuned once over the whole tweak; head reused at depth 2
    assert sorted(e[1] for e in model.log if e[0] == "tune") == [0, 1, 2, 3, 4]
    assert ("enter", (2, 3, 4), (True, True, False)) in model.log
    # the selected cut stays entered and active at the end
    assert model.entered == [1, 4] and model.active
    assert [result.module(i)[0] for i in range(5)] == [1, 1, 1, 1, 1]
    modules = result.modules
    assert [m["node"] for m in modules] == [0, 1, 2, 3, 4]
    assert [m["depths"] for m in modules] == [[0], [1], [2], [2], [1, 2]]
    assert [m["kept"] for m in modules] == [False, True, False, False, True]
    assert modules[4]["path"] == "head" and modules[4]["state"] == 1 and modules[4]["error"] == ""
    assert modules[4]["groups"] == [{"text": "(x)", "strategy": "first-wins", "samples": 1, "chosen": 0,
                                     "error": "", "candidates": [{"name": "fake", "state": "built",
                                                                  "verdict": "chosen", "error": "",
                                                                  "stats": None, **NO_FACTS,
                                                                  "build_s": 0.0}]}]
    assert str(result) == result.format() and "enc" not in "" and len(result.format()) > 0
    with pytest.raises(IndexError):
        result.module(5)
    with pytest.raises(TypeError):
        _C.Result()


def test_tweak_result_says_how_good_its_figures_are():
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([0]): 500})

    def deactivate():
        model.active = False

    def run(i):
        if model.entered is not None and not model.active:
            clock.now += 20000  # a burst of load on the untuned side, side by side only
        else:
            model.run(i)

    kwargs = model.kwargs(max_depth=0, deactivate=deactivate)
    kwargs["run"] = run
    result = _C.tweak(_C.Tree(TREE_MODULES), **kwargs)
    side = result.confirmation
    assert result.quality == side["quality"] == "inconsistent" and side["tries"] == 3
    assert side["side_speedup"] == 40.0 and side["search_speedup"] == 2.0
    assert side["from_search"] and side["speedup"] == 2.0 and side["confirmed"] and result.selected == 0
    assert "the figures disagree" in str(result) and "40.00x" not in str(result)
    quiet = FakeModel(FakeClock(), {frozenset([0]): 500})
    result = _C.tweak(_C.Tree(TREE_MODULES), **quiet.kwargs(max_depth=0,
                                                             deactivate=lambda: setattr(quiet, "active", False)))
    assert result.quality == result.confirmation["quality"] == "consistent"
    assert result.confirmation["tries"] == 1 and not result.confirmation["from_search"]
    untuned = FakeModel(FakeClock(), {frozenset([0]): 1500})
    assert _C.tweak(_C.Tree(TREE_MODULES), **untuned.kwargs(max_depth=0)).quality == "unchecked"


def _record_of(result):
    return {"rows": result.rows, "selected": result.selected, "baseline": result.baseline,
            "confirmation": result.confirmation, "others_share": result.others_share,
            "busy_stopped": result.busy_stopped, "budgets": result.budgets, "quality": result.quality}


def test_restore_result_builds_the_same_result_from_its_numbers_and_refuses_others():
    """_C.restore_result (tw_result_restore): the numbers a caller kept of a result, in the
    getters' forms, give the same table, outcome and figures; the confirmation's figures are
    derived from its measurements, never read; numbers no tweak gives are refused."""
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([0]): 500})

    def run(i):
        if model.entered is not None and not model.active:
            clock.now += 20000  # side by side only: the figures disagree, the search's counts
        else:
            model.run(i)

    kwargs = model.kwargs(max_depth=None, deactivate=lambda: setattr(model, "active", False), time_budget=100.0)
    kwargs["run"] = run
    result = _C.tweak(_C.Tree(TREE_MODULES), **kwargs)
    record = _record_of(result)
    assert record["budgets"] == {"time_budget_ns": 100 * 10 ** 9, "busy_budget_ns": record["budgets"]["busy_budget_ns"]}
    again = _C.restore_result(record)
    assert str(again) == str(result) and again.outcome() == result.outcome()
    assert again.rows == result.rows and again.confirmation == result.confirmation
    assert again.quality == result.quality == "inconsistent" and again.modules == []
    forged = dict(record, confirmation=dict(record["confirmation"], speedup=42.0, side_speedup=42.0))
    assert _C.restore_result(forged).confirmation == result.confirmation  # derived, not read
    for change, words in [(dict(selected=-1), "is not the depth its confirmation keeps"),
                          (dict(others_share=2.0), "a share of the CPUs of 2"),
                          (dict(rows=record["rows"] * 400), "rows"),
                          (dict(baseline=dict(record["baseline"], spread=-1.0)), "a spread of -1")]:
        with pytest.raises(ValueError, match=words):
            _C.restore_result(dict(record, **change))
    for change in [dict(rows=5), dict(selected=True), dict(baseline="fast"), dict(budgets=None),
                   dict(rows=[dict(record["rows"][0], state=3)]), dict(busy_stopped=1)]:
        with pytest.raises(TypeError):
            _C.restore_result(dict(record, **change))
    with pytest.raises(ValueError, match="no name the engine gives"):
        _C.restore_result(dict(record, rows=[dict(record["rows"][0], state="kept")] + record["rows"][1:]))
    missing = dict(record)
    del missing["confirmation"]
    with pytest.raises(TypeError, match='has no "confirmation"'):
        _C.restore_result(missing)


def test_tweak_with_no_faster_depth_keeps_the_model_untuned():
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([1, 4]): 1200})
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(min_depth=1, max_depth=1))
    assert result.selected == -1
    assert model.entered is None
    assert model.log.count(("leave",)) == sum(1 for e in model.log if e[0] == "enter")


def test_tweak_skips_a_depth_where_every_module_fails():
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([1, 4]): 500}, fail={2, 3, 4})
    # head (4) fails at depth 1 too: depth 1 keeps enc tuned only
    model.latency[frozenset([1])] = 700
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(min_depth=1, max_depth=2))
    rows = result.rows
    assert rows[0]["state"] == "measured" and rows[0]["failed"] == 1
    assert rows[1]["state"] == "skipped" and rows[1]["failed"] == 3
    assert "ValueError: node 2 does not tune" in rows[1]["error"]
    assert rows[1]["stats"] is None
    assert result.selected == 0
    state, error = result.module(2)
    assert state == -1 and "ValueError: node 2 does not tune" in error
    assert result.module(1) == (1, "")
    assert result.module(0)[0] == 0  # the root was never in a cut
    failed = {m["node"]: m for m in result.modules}[2]
    assert failed["state"] == -1 and failed["groups"][0]["chosen"] == -1
    assert failed["error"] == "no backend passed (fake: ValueError: node 2 does not tune)"
    assert failed["groups"][0]["candidates"][0]["verdict"] == "failed"
    assert ("commit", 2, -1) in model.log


def test_tweak_interrupt_propagates_and_leaves():
    clock = FakeClock()
    model = FakeModel(clock, {}, interrupt=2)
    with pytest.raises(KeyboardInterrupt, match="tune interrupted"):
        _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(min_depth=2, max_depth=2))
    assert model.log[-1] == ("leave",)
    assert model.entered is None
    assert ("tune", 3) not in model.log  # nothing ran after the interrupt but leave


def test_tweak_dry_run_calls_nothing():
    clock = FakeClock()
    model = FakeModel(clock, {})
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(dry_run=True, max_depth=None))
    assert [r["state"] for r in result.rows] == ["dry"] * 3
    assert [r["modules"] for r in result.rows] == [1, 2, 3]
    assert result.modules == []
    assert result.baseline is None and result.selected == -1
    assert model.log == [] and clock.now == 0


def test_tweak_time_budget():
    clock = FakeClock()
    model = FakeModel(clock, {frozenset([0]): 10})
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(time_budget=1e-9, max_depth=None))
    assert [r["state"] for r in result.rows] == ["budget"] * 3
    assert result.rows[0]["error"] == "time budget used up"
    assert result.selected == -1 and result.baseline is not None
    model = FakeModel(FakeClock(), {})
    result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(time_budget=0, max_depth=None))
    assert [r["state"] for r in result.rows] == ["budget"] * 3
    assert not any(e[0] == "enter" for e in model.log)
    for bad in (-1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="time_budget"):
            _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(time_budget=bad))


def test_tweak_argument_errors():
    clock = FakeClock()
    model = FakeModel(clock, {})
    tree = _C.Tree(TREE_MODULES)
    kwargs = model.kwargs()
    del kwargs["leave"]
    with pytest.raises(TypeError, match="leave"):
        _C.tweak(tree, **kwargs)
    with pytest.raises(TypeError, match="Tree"):
        _C.tweak(TREE_MODULES, **model.kwargs())
    with pytest.raises(ValueError, match="min_depth"):
        _C.tweak(tree, **model.kwargs(min_depth=-1))
    with pytest.raises(ValueError, match="tie_tolerance"):
        _C.tweak(tree, **model.kwargs(tie_tolerance=-0.5))
    with pytest.raises(ValueError, match="rounds_max"):
        _C.tweak(tree, **model.kwargs(config={"rounds_max": "x"}))
    with pytest.raises(TypeError, match="modules must have callable .*no callable group$"):
        _C.tweak(tree, **{**model.kwargs(), "modules": type("M", (), {"groups": lambda self, node: 1, "group": 2})()})
    with pytest.raises(ValueError, match="max_depth must be an int >= 0 or None, got -1"):
        _C.tweak(tree, **model.kwargs(max_depth=-1))
    assert model.log == []


@pytest.mark.parametrize("settings, message", [
    ({"min_depth": -1}, "min_depth must be an int >= 0, got -1"),
    ({"min_depth": "0"}, "min_depth must be an int >= 0, got '0'"),
    ({"min_depth": 2 ** 80}, "min_depth must be an int >= 0, got 1208925819614629174706176"),
    ({"max_depth": -1}, "max_depth must be an int >= 0 or None, got -1"),
    ({"max_depth": 1.0}, "max_depth must be an int >= 0 or None, got 1.0"),
    ({"min_depth": 3, "max_depth": 1}, "min_depth \\(3\\) is greater than max_depth \\(1\\): lower min_depth or "
                                       "raise max_depth"),
    ({"min_depth": 3}, "min_depth \\(3\\) is greater than max_depth \\(1\\)"),  # the engine's default max_depth
    ({"tie_tolerance": -0.1}, "tie_tolerance must be a fraction >= 0 \\(0.02 is 2 %\\), got -0.1$"),
    ({"tie_tolerance": float("nan")}, "tie_tolerance must be a fraction >= 0 \\(0.02 is 2 %\\), got nan$"),
    ({"tie_tolerance": "0.02"}, "tie_tolerance must be a fraction >= 0 \\(0.02 is 2 %\\), got '0.02'"),
    ({"time_budget": -1}, "time_budget must be a number of seconds >= 0 or None, got -1$"),
    ({"time_budget": "1"}, "time_budget must be a number of seconds >= 0 or None, got '1'"),
    ({"time_budget": float("nan")}, "time_budget must be a number of seconds >= 0 or None, got nan"),
    ({"time_budget": float("inf")}, "time_budget must be a finite number >= 0, not inf"),
    ({"config": {"rounds_min": 0}}, "rounds_min"),
])
def test_check_tweak_config_raises_the_users_message(settings, message):
    with pytest.raises(ValueError, match=message):
        _C.check_tweak_config(**settings)
    model = FakeModel(FakeClock(), {})
    with pytest.raises(ValueError, match=message):  # tweak checks its settings by the same rules
        _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(**settings))
    assert model.log == []


def test_check_tweak_config_accepts_what_tweak_accepts():
    assert _C.check_tweak_config() == {"min_depth": 0, "max_depth": 1, "tie_tolerance": 0.02, "time_budget": None}
    settings = _C.check_tweak_config(min_depth=True, max_depth=None, tie_tolerance=0, time_budget=0,
                                     config={"rounds_max": 10})
    # the settings in the engine's forms: what tt.tweak hashes for its cache and gives the engine
    assert settings == {"min_depth": 1, "max_depth": None, "tie_tolerance": 0.0, "time_budget": 0.0}
    assert type(settings["tie_tolerance"]) is float and type(settings["time_budget"]) is float
    assert _C.check_tweak_config(max_depth=3, tie_tolerance=1, time_budget=True)["time_budget"] == 1.0
    model = FakeModel(FakeClock(), {})
    assert _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(**settings)).rows[0]["state"] == "budget"


# ------------------------------------------------------------------ tune_module

NO_FACTS = {"reason": "", "max_error": None, "tolerance": None, "own_error": None, "build_s": None, "variant": False,
            "lowers_precision": False}

class Search:
    """One module for tune_module: per group (text, kind, candidates), each candidate
    (name, build error or None, ns per call); every callback logged."""

    def __init__(self, clock, groups):
        self.clock = clock
        self.spec = groups
        self.log = []

    def groups(self, node):
        self.log.append(("groups", node))
        return len(self.spec)

    def group(self, node, g):
        text, kind, cands = self.spec[g]
        self.log.append(("group", node, g))
        return (text, kind, tuple(c[0] for c in cands), 2)

    def build(self, node, g, c):
        self.log.append(("build", g, c))
        error = self.spec[g][2][c][1]
        if isinstance(error, BaseException):
            raise error

    def run(self, node, g, c, sample):
        self.clock.now += self.spec[g][2][c][2]

    def commit(self, node, g, chosen):
        self.log.append(("commit", node, g, chosen))


def test_tune_module_runs_each_groups_strategy_and_reports_every_candidate():
    clock = FakeClock()
    search = Search(clock, [
        ("(float32[8])", "highest-throughput",
         [("Slow", None, 300), ("Fast", None, 100), ("Broken", ValueError("does not build"), 1)]),
        ("(float32[1])", "first-wins", [("A", RuntimeError("no"), 1), ("B", None, 50), ("C", None, 10)]),
    ])
    result = _C.tune_module(search, 3, path="enc.0", clock=clock, config={"rounds_max": 5})
    assert result["path"] == "enc.0" and result["state"] == 1 and result["error"] == ""
    first, second = result["groups"]
    assert first["text"] == "(float32[8])" and first["strategy"] == "highest-throughput"
    assert first["chosen"] == 1 and first["samples"] == 2 and first["error"] == ""
    assert [c["verdict"] for c in first["candidates"]] == ["slower", "chosen", "failed"]
    assert [c["stats"]["median_ns"] for c in first["candidates"][:2]] == [300.0, 100.0]
    assert first["candidates"][2] == {"name": "Broken", "state": "failed", "verdict": "failed",
                                      "error": "ValueError: does not build", "stats": None,
                                      **NO_FACTS, "reason": "build failed", "build_s": 0.0}
    assert [c["verdict"] for c in second["candidates"]] == ["failed", "chosen", "not tried"]
    assert ("build", 1, 2) not in search.log  # first-wins stopped at B
    assert [e for e in search.log if e[0] == "commit"] == [("commit", 3, 0, 1), ("commit", 3, 1, 1)]


class Facts(Exception):
    """A failed build that says why, as tuning.ModuleSearch.build does."""

    def __init__(self, message, facts):
        super().__init__(message)
        self.tt_facts = facts


def test_build_facts_and_flags_are_the_engines_result():
    """What a build says of itself (returned, or on its exception), the build time by the
    engine's clock and the flags group() gives are kept per candidate in the result."""
    clock = FakeClock()

    class Built(Search):
        def group(self, node, g):
            return super().group(node, g) + ((0, _C.CANDIDATE_LOWERS_PRECISION | _C.CANDIDATE_VARIANT, 0, 0),)

        def build(self, node, g, c):
            clock.now += 1000 * (c + 1)
            super().build(node, g, c)
            return ("", 2e-5, None) if c == 0 else None

    search = Built(clock, [("(x)", "highest-throughput",
                            [("A", None, 5), ("B", Facts("too far", ("mismatch", 0.5, 0.01, 0.002)), 1),
                             ("C", Facts("odd", ("no such reason", "x", 10**400)), 1),
                             ("D", RuntimeError("no"), 1)])])
    a, b, c, d = _C.tune_module(search, 0, clock=clock)["groups"][0]["candidates"]
    assert (a["reason"], a["max_error"], a["tolerance"], a["build_s"]) == ("", 2e-5, None, 1e-6)
    assert not a["variant"] and not a["lowers_precision"]
    assert (b["reason"], b["max_error"], b["tolerance"], b["build_s"]) == ("mismatch", 0.5, 0.01, 2e-6)
    assert a["own_error"] is None and b["own_error"] == 0.002  # a fourth fact: the original's own error
    assert b["variant"] and b["lowers_precision"] and b["error"] == "Facts: too far"
    assert (c["reason"], c["max_error"], c["tolerance"]) == ("build failed", None, None)  # what it cannot read: nothing
    assert d["reason"] == "build failed" and d["build_s"] == 4e-6
    for flags in ((1,), (0, 0, 0, 4), [0, 0, 0, 0], (0, 0, 0, "1")):
        class Flagged(Search):
            def group(self, node, g, flags=flags):
                return super().group(node, g) + (flags,)

        result = _C.tune_module(Flagged(clock, search.spec), 0, clock=clock)
        assert "flags" in result["error"] and result["state"] == -1


def test_tweak_time_budget_leaves_the_variants_out():
    """One clock, the engine's: once the budget is used up inside a depth, a candidate flagged
    as a variant is not built (its build is never called); the others still are."""

    class Variants(FakeModel):
        def groups(self, node):
            self.clock.now += 10**12  # the search of each module begins with 1000 s
            return super().groups(node)

        def group(self, node, group):
            return ("(x)", "first-wins", ("fake [variant]", "fake"), 1, (_C.CANDIDATE_VARIANT, 0))

        def build(self, node, group, candidate):
            self.log.append(("build", node, candidate))

    for budget, built in ((100.0, 1), (1e4, 0)):
        model = Variants(FakeClock(), {frozenset([0]): 900})
        result = _C.tweak(_C.Tree(TREE_MODULES), **model.kwargs(max_depth=0, time_budget=budget))
        assert [e for e in model.log if e[0] == "build"] == [("build", 0, built)]
        variant, plain = result.modules[0]["groups"][0]["candidates"]
        assert result.modules[0]["groups"][0]["chosen"] == built
        if built:
            assert variant["state"] == "failed" and variant["reason"] == "time budget"
            assert variant["build_s"] == 0.0 and variant["variant"] and not plain["variant"]
            assert variant["error"].startswith("not built: the time budget was used up")
        else:
            assert variant["state"] == "built" and plain["state"] == "not tried"


def test_tune_module_failures_say_why():
    clock = FakeClock()
    search = Search(clock, [("(x)", "first-wins", [("A", ValueError("bad"), 1), ("B", ValueError("worse"), 1)])])
    result = _C.tune_module(search, 0, clock=clock)
    assert result["state"] == -1 and result["path"] == ""
    assert result["error"] == "no backend passed (A: ValueError: bad; B: ValueError: worse)"
    assert result["groups"][0]["error"] == result["error"]
    result = _C.tune_module(Search(clock, []), 0, path="head", clock=clock)
    assert result["error"] == "the dataset never called head; there is nothing to tune it on"
    bad = Search(clock, [("(x)", "nope", [("A", None, 1)])])
    result = _C.tune_module(bad, 0, clock=clock)
    assert result["state"] == -1 and "unknown strategy kind 'nope'" in result["groups"][0]["error"]
    assert bad.log[-1] == ("commit", 0, 0, -1)  # a group that failed still ends with a commit
    with pytest.raises(TypeError, match="object has no callable groups"):
        _C.tune_module(object(), 0)
    with pytest.raises(ValueError, match="node must be >= 0"):
        _C.tune_module(search, -1)


def test_tune_module_interrupt_commits_and_propagates():
    clock = FakeClock()
    search = Search(clock, [("(x)", "highest-throughput", [("A", None, 1), ("B", KeyboardInterrupt("stop"), 1),
                                                          ("C", None, 1)])])
    with pytest.raises(KeyboardInterrupt, match="stop"):
        _C.tune_module(search, 5, clock=clock)
    assert ("build", 0, 2) not in search.log
    assert search.log[-1] == ("commit", 5, 0, -1)


def test_callbacks_and_failures_keep_their_reference_counts():
    import sys

    clock = FakeClock()
    run = clock.runner(10)
    sync = lambda: None  # noqa: E731
    error = ValueError("x")

    def failing(i):
        raise error

    cfg = {"warmup_min": 0, "warmup_max": 0, "rounds_min": 1, "rounds_max": 1}
    watched = [clock, run, sync, failing, error]
    _C.measure(run, 1, sync=sync, clock=clock, config=cfg)
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(200):
        _C.measure(run, 3, sync=sync, clock=clock, config=cfg)
        _C.compare([run, run], 2, sync=sync, clock=clock, config=cfg)
        try:
            _C.measure(failing, 1, clock=clock, config=cfg)
        except _C.EngineError as e:
            assert e.__cause__ is error
    error.__traceback__ = None  # the traceback holds frames, not our references
    assert [sys.getrefcount(o) for o in watched] == before


# ------------------------------------------------- callbacks that free arguments
# Python code run from inside a call may drop the last reference to what the
# caller passed in a list: candidates, runs, a Signature's dynamic axes, a
# GraphReplay's inputs. The extension holds its own references for the whole
# call; before it did, these read freed memory. Each runs in a child, so a
# crash fails one test, not pytest.

_FREEING_PRELUDE = """
import gc
import os
from torch_tweak import _C

class Clock:
    now = 0
    def __call__(self):
        return self.now

clock = Clock()
cfg = {"warmup_min": 0, "warmup_max": 0, "rounds_min": 2, "rounds_max": 2}

kept = []

class Trap:
    def method(self, *args, **kwargs):
        os._exit(86)

def churn():
    # Reuse what was freed: a call through a stale pointer then crashes, or
    # reaches one of these traps and exits with 86.
    gc.collect()
    trap = Trap()
    kept.append([(lambda *a, **k: os._exit(86)) for _ in range(300)])
    kept.append([trap.method for _ in range(300)])
    kept.append([bytearray(48) for _ in range(300)] + [(object(), i) for i in range(300)])
"""

_FREEING_SCRIPTS = {
    "tune-module-rebinds-its-callbacks": """
class Search:
    def groups(self, node):
        return 2
    def group(self, node, g):
        return ("(x)" * 20, "highest-throughput", tuple("cand-%d-%s" % (i, "x" * 40) for i in range(3)), 2)
    def build(self, node, g, c):
        # drop every callback the binding was given, and the names it read
        for name in ("groups", "group", "build", "run", "commit"):
            setattr(self, name, None)
        churn()
    def run(self, node, g, c, sample):
        clock.now += 10 * (c + 1)
        churn()
    def commit(self, node, g, chosen):
        churn()
result = _C.tune_module(Search(), 0, clock=clock, config=cfg)
assert [g["chosen"] for g in result["groups"]] == [0, 0], result
assert result["groups"][1]["candidates"][2]["name"].startswith("cand-2-"), result
""",
    "choose-clears-candidates": """
cands = []
def make(name):
    def build():
        cands.clear()
        churn()
    def run(i):
        clock.now += 10
    return (name + "-" + "x" * 40, build, run)
cands.extend(make(n) for n in ("a", "b", "c"))
winner, reports = _C.choose("highest-throughput", cands, 2, clock=clock, config=cfg)
assert [r["state"] for r in reports] == ["measured"] * 3, reports
assert [r["name"][:1] for r in reports] == ["a", "b", "c"]
""",
    "choose-run-mutates-candidates": """
cands = []
def run(i):
    clock.now += 10
    cands[:] = [(str(j), None, None) for j in range(5)]
    churn()
cands.extend(("n%d" % k, (lambda: None), (lambda i: run(i))) for k in range(3))
winner, reports = _C.choose("highest-throughput", cands, 2, clock=clock, config=cfg)
assert len(reports) == 3 and reports[0]["name"] == "n0"
""",
    "compare-clears-runs": """
runs = []
def make():
    def run(i):
        clock.now += 10
        runs.clear()
        churn()
    return run
runs.extend(make() for _ in range(3))
stats = _C.compare(runs, 2, clock=clock, config=cfg)
assert len(stats) == 3
""",
    "signature-clears-dynamic": """
import torch
dynamic = []
class Sneaky(torch.Tensor):
    @property
    def dtype(self):
        dynamic.clear()
        churn()
        return super().dtype
x = torch.zeros(2, 3)
dynamic.extend([None, [0], [1 + 0 * len(kept)]])
sig = _C.Signature((torch.zeros(2, 3).as_subclass(Sneaky), x, x), None, dynamic)
""",
    "value-keyer-replaces-itself": """
class Cache:
    pass
def keyer(value):
    _C.set_value_keyer(None)  # drops the last reference to this function while it runs
    churn()
    return ("cache",)
_C.set_value_keyer(keyer)
del keyer
sig = _C.Signature((Cache(),), None)
assert sig.matches((Cache(),), {})
""",
    "graph-replay-clears-inputs": """
import torch
inputs = []
class Index:
    def __index__(self):
        inputs.clear()
        churn()
        return -1
x, y = torch.zeros(2), torch.zeros(2)
inputs.extend([(0, Index(), torch.zeros(2)), (1, -1, torch.zeros(2)), (2, -1, torch.zeros(2))])
sig = _C.Signature((x, y, y), None)
_C.GraphReplay(0, 0, sig, inputs, torch.zeros(2), lambda *a: None, replay=lambda: None)
""",
}


@pytest.mark.parametrize("name", sorted(_FREEING_SCRIPTS))
@pytest.mark.slow
def test_callbacks_that_free_the_callers_arguments_do_not_crash(name):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FREEING_PRELUDE + _FREEING_SCRIPTS[name]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{name}: exit code {proc.returncode} (negative: killed by that signal)\n"
        f"{proc.stderr[-3000:]}")


def test_the_untimed_opening_call_is_for_a_cpu():
    """tt.tweak opens compared rounds with an untimed call on a CPU only (thread pools spin
    there); on another device it sets settle 0, unless measure= names it."""
    import torch

    from torch_tweak._search.tuning import measure_for
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert measure_for(cpu, None) is None and measure_for(cpu, {"rounds_min": 3}) == {"rounds_min": 3}
    assert measure_for(cuda, None) == {"settle": 0}
    assert measure_for(cuda, {"rounds_min": 3}) == {"rounds_min": 3, "settle": 0}
    assert measure_for(cuda, {"settle": 2}) == {"settle": 2}
    given = {"rounds_min": 3}
    measure_for(cuda, given)
    assert given == {"rounds_min": 3}  # the caller's dict is not changed


# ------------------------------------------------------------------ replay_steps


def python_steps(replay, start, stop, every, finished):
    """The graph decode loop as it was written in Python (generation.py before the loop
    moved into the extension): the reference replay_steps must match call for call."""
    done = start
    while done < stop:
        burst = min(every, stop - done)
        for _ in range(burst):
            replay()
        done += burst
        if finished(done):
            break
    return done


class StepLog:
    """A replay and a finished callback that log every call; finished is true from `end` on."""

    def __init__(self, end):
        self.calls = []
        self.end = end

    def replay(self):
        self.calls.append("replay")

    def finished(self, done):
        self.calls.append(done)
        return self.end is not None and done >= self.end


@pytest.mark.parametrize("start,stop,every", [(1, 1, 16), (1, 2, 16), (1, 40, 16), (0, 33, 16), (1, 17, 16),
                                              (3, 50, 1), (1, 100, 7), (5, 2, 4)])
@pytest.mark.parametrize("end", [None, 1, 17, 20, 1000])
def test_replay_steps_replays_and_asks_exactly_as_the_python_loop_did(start, stop, every, end):
    ours, ref = StepLog(end), StepLog(end)
    got = _C.replay_steps(ours.replay, start, stop, every, ours.finished)
    want = python_steps(ref.replay, start, stop, every, ref.finished)
    assert (got, ours.calls) == (want, ref.calls)


def test_replay_steps_refuses_bad_arguments_before_any_replay():
    log = StepLog(None)
    for args, error, words in [((42, 1, 5, 2, log.finished), TypeError, "replay must be callable, not int"),
                               ((log.replay, 1, 5, 2, "x"), TypeError, "finished must be callable, not str"),
                               ((log.replay, 1, 5, 0, log.finished), ValueError, "every must be >= 1"),
                               ((log.replay, -1, 5, 2, log.finished), ValueError, "must be >= 0, got -1 and 5"),
                               ((log.replay, 1, -5, 2, log.finished), ValueError, "must be >= 0")]:
        with pytest.raises(error, match=words):
            _C.replay_steps(*args)
    for args in [(log.replay, 1, "5", 2, log.finished), (log.replay, 1, 5, 2)]:
        with pytest.raises(TypeError):
            _C.replay_steps(*args)
    assert log.calls == []


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_replay_steps_stops_at_the_first_failure_and_keeps_its_references(raised):
    import sys

    count = [0]

    def replay():
        count[0] += 1
        if count[0] == 5:
            raise raised("replay failed")

    before = sys.getrefcount(replay)
    with pytest.raises(raised, match="replay failed"):
        _C.replay_steps(replay, 1, 100, 3, lambda done: False)
    assert count[0] == 5 and sys.getrefcount(replay) == before

    def finished(done):
        if done >= 7:
            raise raised("finished failed")
        return False

    count[0] = 10
    with pytest.raises(raised, match="finished failed"):
        _C.replay_steps(replay, 1, 100, 3, finished)
    assert count[0] == 10 + 6  # two bursts of 3, then finished(7) raised

    class Undecided:
        def __bool__(self):
            raise ValueError("no truth value")

    with pytest.raises(ValueError, match="no truth value"):
        _C.replay_steps(lambda: None, 1, 10, 2, lambda done: Undecided())


def test_replay_steps_stays_interruptible_when_no_python_runs_per_token():
    """A replay that runs no Python code (torch's is C++) never reaches the interpreter's own
    check for signals: Ctrl-C during a long decode must still stop the loop."""
    import functools
    import os
    import subprocess
    import time

    replay = functools.partial(sum, range(100))  # C only; about 40 s for the steps below
    killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -INT {os.getpid()}"])
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _C.replay_steps(replay, 0, 40_000_000, 1 << 30, lambda done: False)
    finally:
        killer.wait()
    assert time.monotonic() - start < 20


# ---------------------------------------------------------------- weight_change


def test_weight_change_finds_the_first_weight_replaced_moved_or_written():
    torch = pytest.importorskip("torch")
    from torch_tweak._core.model_state import weight_change, weights_of

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    weights = weights_of(model)
    assert _C.weight_change(weights, True) is None and weight_change(weights, in_place=True) == ""
    with torch.no_grad():
        model[1].weight.mul_(2)  # in place: seen only with in_place
    assert _C.weight_change(weights, False) is None
    assert _C.weight_change(weights, True) == (2, 2)
    assert weight_change(weights, in_place=True) == "1.weight was updated in place"
    model[0].bias.data = torch.zeros(4)  # other memory, same object
    assert _C.weight_change(weights, False) == (1, 1)
    assert weight_change(weights) == "0.bias was given other memory"
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # replaced in its module
    assert _C.weight_change(weights, False) == (0, 0) and weight_change(weights) == "0.weight was replaced"
    del model[1]._parameters["bias"]  # gone from its table: replaced
    assert _C.weight_change(weights[3:], False) == (0, 0)
    with torch.inference_mode():  # inference tensors keep no version counter: their version is None
        frozen = torch.nn.Linear(2, 2)
    listed = weights_of(frozen)
    assert [entry[5] for entry in listed] == [None, None] and _C.weight_change(listed, True) is None
    assert [entry[6:] for entry in listed] == [(0, None), (0, None)]  # sampled bytes: only where asked


@pytest.mark.parametrize("weights, in_place, error", [
    ((), True, TypeError), ([("table", "p", "n", None, 0, None, 0, None)], True, TypeError),
    ([({}, "p")], False, TypeError), ([({"n": 1}, "p", "n", 1, 0, None, 0, None)], False, AttributeError),
    ([({"n": 1}, "p", "n", 1, 0, None)], False, TypeError), ([([1], "p", "0", 1, 0, None, 0, None)], False, TypeError),
    ([({"n": 1}, "p", "n", 1, 0, None, "0", None)], False, TypeError),
])
def test_weight_change_refuses_what_weights_of_does_not_make(weights, in_place, error):
    with pytest.raises(error):
        _C.weight_change(weights, in_place)


def test_weight_change_sees_writes_behind_the_version_counter_in_the_sampled_bytes():
    """Writes the version counter misses (numpy, a storage's copy_, another tensor over the
    same memory) are seen where they change a sampled byte: every byte of a weight up to 1 KiB,
    16 pieces of 64 bytes of a larger one, the first at its start and the last at its end."""
    torch = pytest.importorskip("torch")
    from torch_tweak._core.model_state import sampled, span_of, weight_change, weights_of

    model = torch.nn.Linear(64, 64)  # weight: 16 KiB, sampled; bias: 256 bytes, whole
    weights = [sampled(entry) for entry in weights_of(model)]
    assert [(e[6], len(e[7])) for e in weights] == [(16384, 1024), (256, 256)]
    assert _C.weight_change(weights, True) is None and _C.weight_change(weights, False) is None
    flat = model.weight.detach().view(-1)
    for at in (0, 4095, 4096 - 16):  # the first and the last float; the last piece's first
        before, value = model.weight._version, float(flat[at])
        flat.numpy()[at] = 9.0  # numpy: no version bump
        assert model.weight._version == before
        assert _C.weight_change(weights, True) == (0, 3) and _C.weight_change(weights, False) is None
        assert weight_change(weights, in_place=True) == "weight was written behind its version counter (its " \
                                                        "sampled bytes differ)"
        flat.numpy()[at] = value
        assert _C.weight_change(weights, True) is None
    flat.numpy()[100] = 9.0  # between pieces (bytes 400-403): not sampled, not seen
    assert _C.weight_change(weights, True) is None
    alias = torch.empty(0).set_(model.bias.untyped_storage(), 0, (64,))  # another tensor over the bias
    alias[63] = 7.0
    assert _C.weight_change(weights, True) == (1, 3)
    view = torch.zeros(8, 8).t()  # strided: its span is its elements' extent
    assert span_of(view) == 256 and span_of(torch.zeros(0)) == 0 and span_of(torch.zeros(4)[1:]) == 12
    assert span_of(torch.zeros(4, device="meta")) == 0


def test_weight_change_reads_a_list_or_tuple_by_index_and_weight_sample_checks_its_span():
    torch = pytest.importorskip("torch")
    t = torch.ones(3)
    scales = [t]
    entry = (scales, "scales[0]", 0, t, t.data_ptr(), t._version, 12, _C.weight_sample(t, 12))
    assert _C.weight_change([entry], True) is None and _C.weight_sample(t, 12) == t.numpy().tobytes()
    t.numpy()[2] = 5.0
    assert _C.weight_change([entry], True) == (0, 3)
    t.numpy()[2] = 1.0
    scales.pop()  # gone from its list: replaced
    assert _C.weight_change([entry], True) == (0, 0)
    assert _C.weight_change([((t,), "p", 1, t, t.data_ptr(), None, 0, None)], True) == (0, 0)  # out of range
    with pytest.raises(ValueError, match="span must be 0 or more"):
        _C.weight_sample(t, -1)
    with pytest.raises(ValueError, match="no memory"):
        _C.weight_sample(torch.zeros(0, device="meta"), 4)
    with pytest.raises(ValueError, match="sample is not weight_sample's"):
        _C.weight_change([({"n": t}, "n", "n", t, t.data_ptr(), None, 12, b"short")], True)
    assert _C.weight_sample(torch.zeros(0), 0) == b""


def test_class_change_finds_a_module_given_another_class_or_a_class_given_another_forward():
    torch = pytest.importorskip("torch")

    class Lin(torch.nn.Linear):
        pass

    class Other(torch.nn.Linear):
        pass

    m = Lin(2, 2)
    entries = [(m, None, Lin), (Lin, "forward", Lin.forward)]
    assert _C.class_change(entries) is None
    Lin.forward = lambda self, x: x
    assert _C.class_change(entries) == 1
    del Lin.forward  # Linear's again, as at the start
    assert _C.class_change(entries) is None
    m.__class__ = Other
    assert _C.class_change(entries) == 0
    assert _C.class_change([(Lin, "no_such_thing", None)]) == 0  # gone: changed
    for bad in ((), [(m, 1, Lin)], [(m, None)]):
        with pytest.raises(TypeError):
            _C.class_change(bad)
