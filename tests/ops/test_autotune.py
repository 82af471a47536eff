"""The config cache: no tuning under the interpreter, remembered choices reused only while still candidates,
shipped choices overridden by the user's cache."""
import json

import pytest

import dropin  # noqa: F401

at = __import__("dropin.ops._autotune", fromlist=["pick"])
CONFIGS = [at.config(64, 64, 32, 4, 3), at.config(32, 32, 32, 4, 2)]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty memory, an empty user cache in tmp_path/user and a shipped table in tmp_path/shipped."""
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
