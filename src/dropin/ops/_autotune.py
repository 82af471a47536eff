"""Config choice for the tiled kernels: pruned candidate lists, bucketed keys and an on-disk cache.

A kernel asks `pick(name, key, configs, prepare)`; the first call for a key times each candidate's
launch (`prepare(config)` returns it, ready to call repeatedly) with
`triton.testing.do_bench` (on the GPU only) and remembers the winner in memory and on disk
(`$DROPIN_CACHE_DIR`, default ~/.cache/dropin). Choices tuned on the project's own GPUs ship in `tuned/`
(same file names), so the benchmark shapes need no tuning there. Under the interpreter, or with
DROPIN_AUTOTUNE=0, no timing happens: the first candidate (the heuristic default) is used.
"""
import concurrent.futures
import contextlib
import json
import os
import pathlib
import threading

import torch
import triton

from .. import _runtime

TUNING = not _runtime.INTERPRET and os.environ.get("DROPIN_AUTOTUNE", "1") != "0"
_CACHE_DIR = pathlib.Path(os.environ.get("DROPIN_CACHE_DIR", pathlib.Path.home() / ".cache" / "dropin"))
_SHIPPED_DIR = pathlib.Path(__file__).with_name("tuned")
_memory: dict = {}
_disk: dict | None = None
_untimed = threading.local()
_warming = threading.local()
_compile_pool = None
_flush = None  # (the L2-flushing buffer, the ms its zeroing takes in a CUDA graph) once graph timing has run


@contextlib.contextmanager
def untimed():
    """Within it, `pick` times nothing (planning under torch.compile's tracing, whose tensors have no data): a
    remembered choice, else the first candidate, which is not remembered."""
    saved = getattr(_untimed, "on", False)
    _untimed.on = True
    try:
        yield
    finally:
        _untimed.on = saved


def warming_up() -> bool:
    """Whether launches are to compile their kernels only (`warming_launches`): `_dispatch.Launch` warms up
    instead, plans and shortcuts are not kept, weight copies not kept."""
    return getattr(_warming, "on", False)


warm_threads = 0  # threads inside `warming_launches`: Launch's hot path asks `warming_up` only when there is one


@contextlib.contextmanager
def warming_launches():
    """Within it (this thread), every dropin launch compiles its kernel without launching it, the compiles side by
    side in a thread pool (Triton's AsyncCompileMode: its compiler releases the GIL in its passes and in ptxas);
    on leaving, it waits for them (a compile that fails is left for the launch that needs it to raise). Raises
    RuntimeError where another AsyncCompileMode is active."""
    global _compile_pool, warm_threads
    if _compile_pool is None:
        _compile_pool = concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1))
    with _runtime.AsyncCompileMode(_compile_pool, ignore_errors=True):
        _warming.on = True
        warm_threads += 1
        try:
            yield
        finally:
            warm_threads -= 1
            _warming.on = False


def _warm(prepare, configs: list) -> None:
    """Each candidate's launches, as warm-ups (within `warming_launches`). A candidate that fails here fails again,
    with its error, where it is timed."""
    for config in configs:
        try:
            prepare(config)()
        except Exception:  # noqa: BLE001
            pass


def can_compile_ahead() -> bool:
    """Whether `compile_ahead` can compile anything here: a GPU (not the interpreter), a Triton with
    AsyncCompileMode, and not inside a warm-up already."""
    return _runtime.AsyncCompileMode is not None and not _runtime.INTERPRET and not warming_up()


def compile_ahead(run) -> bool:
    """Runs run() (e.g. a model's forward on example inputs) with every dropin launch compiled, not launched, the
    compiles side by side, and each tuning's candidates compiled too (timed at their first real use): a first
    call's compiles then take about as long as the slowest of them rather than their sum. What run() computes is
    garbage (no dropin kernel runs), so nothing is kept from it: no plan, no shortcut, no tuning choice, no weight
    copy; an exception inside run() (a check of garbage values) ends it, the compiles begun standing. Launches in
    this thread only: a backward, which autograd runs in threads of its own, would launch on the garbage (forwards
    under no_grad). False where nothing can be compiled ahead (`can_compile_ahead`): run() is not called."""
    if not can_compile_ahead():
        return False
    try:
        with warming_launches():
            try:
                run()
            except Exception:  # noqa: BLE001  (see above)
                pass
    except RuntimeError:
        return False  # another AsyncCompileMode is active
    return True


def bucket(n: int) -> int:
    """Sizes that share a config: the next power of two (at least 16)."""
    return max(16, _runtime.next_power_of_2(_runtime.size_hint(n)))


def _cache_file(folder: pathlib.Path | None = None) -> pathlib.Path:
    """The cache file for this GPU and Triton in `folder` (the user's cache dir, read at call time)."""
    return (folder or _CACHE_DIR) / f"autotune-{_runtime.gpu_slug()}-triton{triton.__version__}.json"


def _load_disk() -> dict:
    """The shipped choices for this GPU and Triton, overridden by the user's own cache."""
    global _disk
    if _disk is None:
        _disk = {}
        for path in (_cache_file(_SHIPPED_DIR), _cache_file()):
            try:
                _disk.update(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
    return _disk


def _save_disk(key: str, config: dict) -> None:
    disk = _load_disk()
    disk[key] = config
    try:
        _CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = _cache_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(disk, indent=0, sort_keys=True))
        tmp.replace(_cache_file())
    except OSError:
        pass  # a read-only home only costs re-tuning in the next process


def _time(prepare, config, graph: bool) -> float:
    try:
        launch = prepare(config)
        if not graph:
            return triton.testing.do_bench(launch, warmup=5, rep=25)
        # each launch after an L2 flush, as do_bench times: operands left in L2 by the previous replay would favour
        # kernels that are fast on cached data (a decoding step streams its weights from memory); the flush's own
        # time taken off
        global _flush
        if _flush is None:
            buffer = triton.runtime.driver.active.get_empty_cache_for_benchmark()
            _flush = buffer, triton.testing.do_bench_cudagraph(buffer.zero_, rep=10)
        buffer, flush_ms = _flush
        return triton.testing.do_bench_cudagraph(lambda: (buffer.zero_(), launch()), rep=10) - flush_ms
    except triton.runtime.errors.OutOfResources:
        return float("inf")


# Benchmarking a candidate launches it 16-30 times: where the fastest candidate's single launch takes over
# SCREEN_MS, those whose single launch takes over SCREEN times it are not benchmarked (linear_cross_entropy's products
# at a 128k vocabulary take 10-40 ms a launch, 20-30 candidates a key: minutes of tuning a first call).
SCREEN, SCREEN_MS = 1.5, 1.0


def _once(prepare, config) -> float:
    """The ms of one launch of the candidate, after an untimed one (its module loaded); inf where it cannot run."""
    try:
        launch = prepare(config)
        launch()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def _tuning_times(prepare, configs: list, graph: bool) -> list:
    """Each candidate's benchmarked time (`_time`), inf for those that one launch each screens out (SCREEN)."""
    once = [_once(prepare, c) for c in configs]
    fastest = min(once)
    return [_time(prepare, c, graph) if fastest < SCREEN_MS or t <= SCREEN * fastest else float("inf")
            for c, t in zip(configs, once)]


def pick(name: str, key: tuple, configs: list, prepare, graph: bool = False) -> dict:
    """The config for `key`: a remembered one if it is still a candidate, else (when tuning) the one whose
    launch `prepare(config)` runs fastest (slow ones screened out by one launch each: SCREEN), else configs[0].
    While a CUDA graph is being captured nothing can be timed, nor under `untimed`: configs[0], not remembered, so
    that the next call that may time tunes.
    graph: time the launches replayed in a CUDA graph, the GPU's time alone (the launch must be capture-safe), L2
    flushed before each; timed as eager calls, kernels shorter than their launch's host time (a decoding step's
    products) are timed by the host."""
    full_key = f"{name}|{'|'.join(map(str, key))}"
    for remembered in (_memory.get(full_key), _load_disk().get(full_key)):
        if remembered in configs:
            _memory[full_key] = remembered
            return remembered
    config = configs[0]
    if TUNING and len(configs) > 1:
        if _runtime.capturing() or getattr(_untimed, "on", False):
            return config
        if warming_up():  # (`compile_ahead`: every candidate compiled now, timed at its first real use)
            _warm(prepare, configs)
            return config
        compile_ahead(lambda: _warm(prepare, configs))  # (the candidates compiled side by side, then timed)
        times = _tuning_times(prepare, configs, graph)
        config = configs[min(range(len(configs)), key=times.__getitem__)]
        _save_disk(full_key, config)
    _memory[full_key] = config
    return config


def config(block_m, block_n, block_k, warps, stages, **extra) -> dict:
    """A candidate: block sizes, launch settings and any kernel-specific constexprs."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **extra)
