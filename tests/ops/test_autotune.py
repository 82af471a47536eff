"""The config cache: no tuning under the interpreter, remembered choices reused only while still candidates,
shipped choices overridden by the user's cache."""
import json

import pytest

import dropin

at = __import__("dropin.ops._autotune", fromlist=["pick"])
CONFIGS = [at.config(64, 64, 32, 4, 3), at.config(32, 32, 32, 4, 2)]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty memory, an empty user cache in tmp_path/user and a shipped table in tmp_path/shipped; no screening
    launch (`_once`) before the timing."""
    monkeypatch.setattr(at, "_once", lambda prepare, config: 0.0)
    monkeypatch.setattr(at, "_memory", {})
    monkeypatch.setattr(at, "_disk", None)
    monkeypatch.setattr(at, "_CACHE_DIR", tmp_path / "user")
    monkeypatch.setattr(at, "_SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(at, "TUNING", False)
    return tmp_path


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))


def test_untuned_pick_is_the_first_candidate(fresh):
    def prepare(config):
        raise AssertionError("no timing without tuning")
    assert at.pick("k", (1, 2), CONFIGS, prepare) == CONFIGS[0]


def test_remembered_choice_must_still_be_a_candidate(fresh):
    _write(at._cache_file(), {"k|1": CONFIGS[1], "k|2": at.config(16, 16, 16, 1, 1)})
    assert at.pick("k", (1,), CONFIGS, None) == CONFIGS[1]
    assert at.pick("k", (2,), CONFIGS, None) == CONFIGS[0]  # stale entry ignored


def test_user_cache_overrides_shipped_table(fresh):
    _write(at._cache_file(at._SHIPPED_DIR), {"k|1": CONFIGS[1], "k|2": CONFIGS[1]})
    _write(at._cache_file(), {"k|2": CONFIGS[0]})
    assert at.pick("k", (1,), CONFIGS, None) == CONFIGS[1]
    assert at.pick("k", (2,), CONFIGS, None) == CONFIGS[0]


def test_tuning_times_every_candidate_and_saves_the_fastest(fresh, monkeypatch):
    monkeypatch.setattr(at, "TUNING", True)
    times = {id(CONFIGS[0]): 2.0, id(CONFIGS[1]): 1.0}
    monkeypatch.setattr(at, "_time", lambda prepare, config, graph: times[id(config)])
    assert at.pick("k", (3,), CONFIGS, None) == CONFIGS[1]
    saved = fresh / "user" / at._cache_file().name  # the patched folder, never the real user cache
    assert json.loads(saved.read_text())["k|3"] == CONFIGS[1]


@pytest.mark.parametrize("fastest", [4.0, 0.4])
def test_slow_candidates_screened_out_by_one_launch(fresh, monkeypatch, fastest):
    """Where the fastest candidate's single launch takes SCREEN_MS or more, candidates over SCREEN times it are not
    benchmarked (inf); below SCREEN_MS every candidate is."""
    monkeypatch.setattr(at, "TUNING", True)
    configs = [at.config(16 * i, 16, 16, 4, 2) for i in range(1, 5)]
    once = dict(zip((16, 32, 48, 64), (fastest * 3, fastest, fastest * 1.4, fastest * 1.6)))
    monkeypatch.setattr(at, "_once", lambda prepare, config: once[config["BLOCK_M"]])
    timed = []
    monkeypatch.setattr(at, "_time", lambda prepare, config, graph: timed.append(config["BLOCK_M"]) or 1.0)
    assert at.pick("screen", (fastest,), configs, None) == configs[1 if fastest >= at.SCREEN_MS else 0]
    assert timed == ([32, 48] if fastest >= at.SCREEN_MS else [16, 32, 48, 64])


@pytest.mark.gpu
def test_no_timing_while_a_cuda_graph_is_captured(fresh, monkeypatch):
    """Timing syncs the device, which a capture forbids: the first candidate, not remembered."""
    import torch

    monkeypatch.setattr(at, "TUNING", True)
    timed, x = [], torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chosen = at.pick("capture", ("k",), CONFIGS, lambda c: timed.append(c) or (lambda: x.add_(1)))
        x.add_(1)
    graph.replay()
    assert chosen == CONFIGS[0] and not timed and not at._memory


class _CompileMode:
    """Stands in for Triton's AsyncCompileMode: records that it was entered with the pool."""
    entered = []

    def __init__(self, executor, ignore_errors=False):
        self.executor, self.ignore_errors = executor, ignore_errors

    def __enter__(self):
        _CompileMode.entered.append(self.ignore_errors)

    def __exit__(self, *exc):
        return False


class _Kernel:
    """A kernel whose warm-ups and launches are counted."""

    def __init__(self):
        self.warmups, self.launches = [], 0
        self.params = ()

    def warmup(self, *args, grid, **constexprs):
        self.warmups.append((args, grid, constexprs))

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.launches += 1
        return run


def test_candidates_compile_side_by_side_before_timing(fresh, monkeypatch):
    """Each candidate's launches first run as warm-ups (compiles handed to Triton's async compile mode), then each
    is timed; a pick met during the warm-ups takes its first candidate, remembered nowhere, and plans made then are
    not kept (their picks were untimed)."""
    dispatch = __import__("dropin.ops._dispatch", fromlist=["Launch"])
    monkeypatch.setattr(at, "TUNING", True)
    monkeypatch.setattr(at._runtime, "INTERPRET", False)
    monkeypatch.setattr(at._runtime, "DIRECT_LAUNCH", False)  # (a direct launch would ask for the GPU)
    monkeypatch.setattr(at._runtime, "AsyncCompileMode", _CompileMode)
    monkeypatch.setattr(at, "_time", lambda prepare, config, graph: prepare(config)() or config["BLOCK_M"])
    _CompileMode.entered.clear()
    kernel, events, plans = _Kernel(), [], {}

    def prepare(config):
        launch = dispatch.Launch(kernel, (1,), {"BLOCK": config["BLOCK_M"]})

        def run():
            events.append((config["BLOCK_M"], at.warming_up()))
            inner = at.pick("inner", (config["BLOCK_M"],), CONFIGS, lambda c: (lambda: None))
            dispatch.plan(plans, config["BLOCK_M"], lambda: inner)
            launch(7)
        return run

    assert at.pick("outer", (1,), CONFIGS, prepare) == CONFIGS[1]  # the faster (BLOCK_M 32)
    assert _CompileMode.entered == [True] * 3  # the outer pick's, then each inner pick's, met while timing
    assert events[:2] == [(64, True), (32, True)] and events[2:] == [(64, False), (32, False)]
    assert [w[0] for w in kernel.warmups] == [(7,), (7,)] and {w[2]["BLOCK"] for w in kernel.warmups} == {64, 32}
    assert kernel.launches == 2  # the timed calls only
    assert not at.warming_up() and plans == {64: CONFIGS[1], 32: CONFIGS[1]}  # kept from the timed calls


def test_compile_ahead_launches_nothing_and_keeps_nothing(fresh, monkeypatch):
    """compile_ahead(run): every launch in run() warms up, one compiled before too (its inputs may be garbage),
    every tuning met warms all its candidates and times none, nothing is kept, and an exception inside run() (a
    check of garbage values) ends it quietly."""
    dispatch = __import__("dropin.ops._dispatch", fromlist=["Launch"])
    monkeypatch.setattr(at, "TUNING", True)
    monkeypatch.setattr(at._runtime, "INTERPRET", False)
    monkeypatch.setattr(at._runtime, "AsyncCompileMode", _CompileMode)
    monkeypatch.setattr(at, "_time", lambda prepare, config, graph: timed.append(config) or 1.0)
    kernel, plans, timed, warmed = _Kernel(), {}, [], []
    compiled = dispatch.Launch(kernel, (2,), {"BLOCK": 16})
    compiled.compiled = object()  # (as after its first launch: a call would launch it directly)

    def run():
        compiled(5)
        at.pick("ahead", (1,), CONFIGS, lambda c: (lambda: warmed.append(c["BLOCK_M"])))
        dispatch.plan(plans, "key", lambda: "plan")
        raise ValueError("a check of garbage values")

    assert at.compile_ahead(run)
    assert kernel.warmups == [((5,), (2, 1, 1), {"BLOCK": 16})] and kernel.launches == 0
    assert warmed == [64, 32] and not timed and not at._memory and not plans and not at.warming_up()
    assert at.warm_threads == 0


@pytest.mark.gpu
def test_tuning_on_the_gpu_compiles_the_candidates_first(fresh, monkeypatch):
    """A real first-use tuning (a product of a shape no other test makes): its candidates are warmed up under
    Triton's async compile mode, then timed; one is remembered and the product is right."""
    import torch

    from _tol import rel_err

    monkeypatch.setattr(at, "TUNING", True)
    precompiled, compile_ahead = [], at.compile_ahead
    monkeypatch.setattr(at, "compile_ahead", lambda run: precompiled.append(compile_ahead(run)))
    a = torch.randn(149, 83, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(83, 211, device="cuda", dtype=torch.bfloat16)
    out = dropin.matmul(a, b)
    assert precompiled and all(precompiled) and at._memory and not at.warming_up()
    assert rel_err(out, a.double() @ b.double()) < 1e-2
