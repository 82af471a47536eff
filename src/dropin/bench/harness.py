"""Benchmark harness shared by every suite: correctness against float64, timing, roofline, output.

A suite is a function `cases(quick: bool) -> list[Case]`. `run_suite` checks and times every provider of
every case, prints progress to stderr and the table to stdout, and writes
`<results_dir>/<gpu-slug>/<suite>.json` (format: DESIGN.md, "Result files").

Provider hooks: a provider is any callable taking the case's inputs and returning a tensor or a tuple of
tensors (e.g. an output and gradients: each is checked, the worst error counts). If it has an attribute `fallback`
(read after its first call), the row reports it. A provider that raises `Skipped` gets a row with a
`note` instead of numbers (see `skipped`, `compiled`); any other exception gives a row with an `error`.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import functools
import importlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch

from dropin import _runtime
from dropin._tolerance import NOISE_ULPS, ROWS, TOLERANCES, UNIT_ROUNDOFF, to_float64

from . import classes

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Case:
    """One benchmark case.

    dtype: a key of dropin._tolerance.ROWS, the row of DESIGN.md's tolerance table the outputs are held to ("tf32"
      means float32 tensors with TF32 allowed, see `allow_tf32`).
    make_inputs: returns a fresh tuple of random inputs (never zeros); every provider gets the same ones.
    providers: name -> callable(*inputs); the one named "dropin" gets `speedup_vs` in its row.
    reference: callable(*inputs) run on float64 copies of the inputs.
    flops / bytes: minimal work and memory traffic (0: not counted); the roofline takes the larger floor.
    ceiling: key of the compute ceiling in `measure_ceilings()` (default: "<dtype>_tflops").
    context: entered around every provider's check and timing (e.g. `lambda: allow_tf32(True)`).
    backward: the outputs include gradients, checked against DESIGN.md's backward tolerance.
    group: the shape class the case belongs to (bench/classes.py), its rows' `class`.
    """
    name: str
    dtype: str
    make_inputs: Callable[[], tuple]
    providers: dict[str, Callable]
    reference: Callable
    flops: float = 0.0
    bytes: float = 0.0
    ceiling: str | None = None
    context: Callable[[], ContextManager] = contextlib.nullcontext
    backward: bool = False
    group: str | None = None


class Skipped(Exception):
    """Raised by a provider that cannot run here; its row gets this message as `note`."""


def attempt(row: dict, fn: Callable[[], tuple], reset: bool = True) -> tuple | None:
    """fn()'s result for one row of a model bench, or None where it could not run: a `Skipped` reason goes to
    row["note"], any other exception to row["error"] (one line), and the other rows still run. reset: the compiled
    graphs (and CUDA graph trees) made by fn go with it either way."""
    try:
        return fn()
    except Skipped as e:
        row["note"] = str(e)
    except Exception as e:  # noqa: BLE001 (the row says why)
        row["error"] = one_line(f"{type(e).__name__}: {e}")
    finally:
        if reset:
            torch._dynamo.reset()
    return None


def skipped(reason: str) -> Callable:
    """A provider that is unavailable, e.g. `skipped("skipped: interpreter")`."""
    def provider(*inputs):
        raise Skipped(reason)
    return provider


def compiled(fn: Callable, mode: str | None = None) -> Callable:
    """torch.compile(fn, mode=mode) as a provider: compiled on its first call (the correctness check, before
    timing), after a dynamo reset so that every case gets its own static graph. Skipped under the interpreter."""
    if _runtime.INTERPRET:
        return skipped("skipped: interpreter")
    state = {}

    def provider(*inputs):
        if "fn" not in state:
            torch._dynamo.reset()
            state["fn"] = torch.compile(fn, dynamic=False, mode=mode)
        return state["fn"](*inputs)
    return provider


def optional(module: str, name: str):
    """`module.name` from an optional dependency (e.g. Liger-Kernel), or None when it is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def optional_provider(module: str, name: str, wrap: Callable = lambda function: function) -> Callable:
    """A provider built by `wrap` from an optional dependency's `module.name` (e.g. Liger-Kernel's GPU kernels);
    a skipped one when it is not installed, or under the interpreter, where such kernels cannot run."""
    function = optional(module, name)
    if function is None:
        return skipped("not installed")
    if _runtime.INTERPRET:
        return skipped("skipped: interpreter")
    return wrap(function)


def with_backward(fn: Callable, n_args: int, n_grads: int) -> Callable:
    """A forward + backward provider from a forward one: called with (*args, *upstream gradients), one
    upstream gradient per output of fn(*args), it returns (*outputs, gradients of the first n_grads args).
    The args are detached first, so every call builds and consumes its own graph."""
    def provider(*inputs):
        args = [a.detach().requires_grad_(i < n_grads) for i, a in enumerate(inputs[:n_args])]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return (*outs, *torch.autograd.grad(outs, args[:n_grads], inputs[n_args:]))
    return provider


@contextlib.contextmanager
def allow_tf32(enabled: bool, backend=torch.backends.cuda.matmul):
    """Sets `backend.allow_tf32` inside the block, restores it after: torch.backends.cuda.matmul (the switch
    of matmuls) or torch.backends.cudnn (that of convolutions)."""
    old = backend.allow_tf32
    backend.allow_tf32 = enabled
    try:
        yield
    finally:
        backend.allow_tf32 = old


def randn(*shape: int, dtype: str | torch.dtype) -> torch.Tensor:
    """Standard-normal tensor on the device the kernels run on; dtype is a torch dtype or a Case.dtype name."""
    dtype = TORCH_DTYPES.get(dtype, dtype)
    return torch.randn(*shape, dtype=dtype, device=_runtime.KERNEL_DEVICE)


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| over entries where ref is not NaN; NaN if out has NaN/Inf anywhere else,
    or a NaN where ref has none (NaN never passes). For tuples of tensors: the worst of the pairs."""
    if isinstance(out, (tuple, list)):
        if len(out) != len(ref):
            raise ValueError(f"{len(out)} outputs, the reference has {len(ref)}")
        errors = [rel_error(o, r) for o, r in zip(out, ref)]
        return math.nan if any(math.isnan(e) for e in errors) else max(errors)
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    ref_nan = torch.isnan(ref)
    if not torch.equal(torch.isnan(out), ref_nan) or not torch.isfinite(out[~ref_nan]).all():
        return math.nan
    diff = (out - ref)[~ref_nan].norm().item()
    norm = ref[~ref_nan].norm().item()
    return diff / norm if norm > 0 else diff


def time_fn(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> list[float]:
    """Per-call times in ms. On CUDA: triton.testing.do_bench (CUDA events, L2 flushed each call). Under
    the interpreter: a perf_counter loop of a few calls (at least 3, about rep_ms in total, at most 20)."""
    if not _runtime.INTERPRET:
        import triton.testing
        return list(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
    times = []
    while len(times) < 3 or (sum(times) < rep_ms and len(times) < 20):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def alternated_times(fns: list[Callable[[], object]], rounds: int, calls: int) -> list[list[float]]:
    """Per-call times in ms of each of fns, timed in alternation: `rounds` rounds, each calling every fn `calls`
    times in turn, so that a drift of the host's speed (which sets the pace of eager models: it moved 2x within a
    process between two providers' timings on the H200's host) reaches all of them alike. On CUDA: CUDA events
    around each call, synchronised after it (no L2 flush: whole models); under the interpreter perf_counter."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            for _ in range(calls):
                if _runtime.INTERPRET:
                    start = time.perf_counter()
                    fn()
                    out.append((time.perf_counter() - start) * 1e3)
                    continue
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
    return times


def graph_time_ms(fn: Callable[[], object], calls: int = 10, replays: int = 15) -> float | None:
    """GPU time of one call without the host's launch cost (ms): a CUDA graph of `calls` x (L2 flush, fn),
    replayed, minus a graph of the flushes alone; medians over the replays. The flush writes twice the L2
    size, so memory-bound cases are not timed from the cache. None under the interpreter."""
    if _runtime.INTERPRET:
        return None
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _host_syncs_raise():  # (capture wants work that has already run once off the
        fn()  # default stream; a call that syncs with the host raises here, before a capture it would break)
    torch.cuda.current_stream().wait_stream(side)

    def replay_ms(body) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    with_fn = replay_ms(lambda: (flush.zero_(), fn()))
    return max(0.0, (with_fn - replay_ms(flush.zero_)) / calls)


@contextlib.contextmanager
def _host_syncs_raise():
    """torch's synchronizing CUDA operations (`.item()`, copies to the host) raise inside the block. A capture
    broken by one leaves CUDA's default generator marked as capturing: every later random draw of the process
    raised "Offset increment outside graph capture encountered unexpectedly" (Liger's fused linear cross-entropy
    calls `.item()`)."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def graph_time(fn: Callable[[], object]) -> tuple[float | None, str | None]:
    """(graph_time_ms(fn), None), or (None, the reason) where fn cannot be captured (it syncs with the host)."""
    try:
        return graph_time_ms(fn), None
    except Exception as e:
        return None, f"no CUDA-graph time: {one_line(_describe(e))}"


def peak_memory_mib(fn: Callable[[], object]) -> float | None:
    """Device memory that one call allocates at its peak beyond what was allocated before it (MiB);
    None under the interpreter (CPU memory is not tracked)."""
    if _runtime.INTERPRET:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def summarize(times_ms: list[float]) -> dict:
    """mean/median/min/max of timing samples, as result-row keys."""
    return {"median_ms": statistics.median(times_ms), "mean_ms": statistics.fmean(times_ms),
            "min_ms": min(times_ms), "max_ms": max(times_ms)}


@functools.lru_cache(maxsize=None)
def measure_ceilings() -> dict:
    """Measured once per process on the GPU: dense matmul TFLOP/s through torch per dtype (best of 4096^3
    and 8192^3), and copy bandwidth in GB/s (1 GiB device-to-device, bytes read + written).
    Empty under the interpreter."""
    if _runtime.INTERPRET:
        return {}
    ceilings = {}
    for key in ("bf16", "fp16", "tf32", "fp32"):
        best = 0.0
        for n in (4096, 8192):
            a, b = randn(n, n, dtype=key), randn(n, n, dtype=key)
            with allow_tf32(key == "tf32"):
                ms = statistics.median(time_fn(lambda: torch.matmul(a, b)))
            best = max(best, 2 * n**3 / ms / 1e9)
        ceilings[f"{key}_tflops"] = round(best, 1)
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(time_fn(lambda: dst.copy_(src)))
    ceilings["copy_gbps"] = round(2 * src.nbytes / ms / 1e6, 1)
    return ceilings


def _roofline(case: Case, ceilings: dict, median_ms: float) -> tuple[float | None, str | None]:
    """(% of the roofline floor time, "compute" | "memory"), or (None, None) without ceilings."""
    peak, bandwidth = ceilings.get(case.ceiling or f"{case.dtype}_tflops"), ceilings.get("copy_gbps")
    floors = {}
    if case.flops and peak:
        floors["compute"] = case.flops / peak / 1e9
    if case.bytes and bandwidth:
        floors["memory"] = case.bytes / bandwidth / 1e6
    if not floors:
        return None, None
    bound = max(floors, key=floors.get)
    return 100 * floors[bound] / median_ms, bound


def run_case(case: Case, ceilings: dict | None = None, warmup_ms: float = 25, rep_ms: float = 100,
             log: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Checks and times every provider of one case; returns one result row per provider."""
    ceilings = ceilings or {}
    inputs = case.make_inputs()
    ref = case.reference(*map(to_float64, inputs))
    tol = TOLERANCES[ROWS[case.dtype]][case.backward]
    rows = []
    for name, fn in case.providers.items():
        row = {"case": case.name, "class": case.group, "provider": name, "dtype": case.dtype,
               "median_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None,
               "tflops": None, "gbps": None, "pct_of_ceiling": None, "bound": None,
               "correct": None, "rel_err": None, "tol": tol, "fallback": False, "peak_mib": None,
               "graph_ms": None, "graph_pct_of_ceiling": None}
        rows.append(row)
        try:
            with case.context():
                err = rel_error(fn(*inputs), ref)
                row["fallback"] = bool(getattr(fn, "fallback", False))
                times = time_fn(lambda: fn(*inputs), warmup_ms, rep_ms)
                row["peak_mib"] = peak_memory_mib(lambda: fn(*inputs))
                row["graph_ms"], graph_note = graph_time(lambda: fn(*inputs))
                if graph_note:
                    row["graph_note"] = graph_note
        except Skipped as e:
            row["note"] = str(e)
            log(f"  {name}: {e}")
            continue
        except Exception as e:  # a failing provider is reported, not fatal
            row.update(correct=False, error=_describe(e))
            log(f"  {name}: ERROR {one_line(row['error'])}")
            continue
        row.update(summarize(times))
        median = row["median_ms"]
        row["tflops"] = case.flops / median / 1e9 if case.flops else None
        row["gbps"] = case.bytes / median / 1e6 if case.bytes else None
        row["pct_of_ceiling"], row["bound"] = _roofline(case, ceilings, median)
        if row["graph_ms"]:
            row["graph_pct_of_ceiling"] = _roofline(case, ceilings, row["graph_ms"])[0]
        row["correct"] = err <= tol  # False for NaN
        row["rel_err"] = err
        if math.isnan(err):
            row["error"] = "output has NaN/Inf where the reference has none"
        graph = "" if row["graph_ms"] is None else f" (GPU only: {row['graph_ms']:.4f} ms)"
        log(f"  {name}: {median:.4f} ms median{graph}, {_rate(row)}, rel_err {err:.1e} "
            f"{'ok' if row['correct'] else 'FAILED'} (tol {tol:g})")
    ours = next((r for r in rows if r["provider"] == "dropin" and r["median_ms"]), None)
    if ours:
        ours["speedup_vs"] = {r["provider"]: r["median_ms"] / ours["median_ms"]
                              for r in rows if r is not ours and r["median_ms"]}
        peer = next((r for r in rows if r["provider"] == "torch" and r["correct"]), None)
        if ours["correct"] and peer:
            # DESIGN.md: never worse than 2x PyTorch's own error, plus the noise allowance of tests/_tol.py
            bound = 2 * peer["rel_err"] + NOISE_ULPS * UNIT_ROUNDOFF[ROWS[case.dtype]]
            if ours["rel_err"] > bound:
                ours.update(correct=False, error=f"relative error {ours['rel_err']:.2e} is worse than 2x torch's "
                                                 f"own {peer['rel_err']:.2e} (bound {bound:.2e})")
                log(f"  dropin: FAILED: {ours['error']}")
    return rows


def _describe(e: Exception) -> str:
    """'Type: message', plus the chained cause (where Triton puts the reason for a CompilationError)."""
    text = f"{type(e).__name__}: {e}".strip()
    cause = e.__cause__
    return text + (f"\ncaused by {type(cause).__name__}: {cause}".rstrip() if cause else "")


def one_line(text: str, limit: int = 300) -> str:
    """First and last line of a long message, for the terminal (the rows keep it whole)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    short = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return short if len(short) <= limit else short[:limit] + "..."


def case_passed(rows: list[dict]) -> bool:
    """True when every provider that ran (not skipped) was correct."""
    return all(r["correct"] for r in rows if "note" not in r)


def _grouped(rows: list[dict], key: str = "case") -> dict[str, list[dict]]:
    groups = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


def failed_cases(rows: list[dict]) -> list[str]:
    """Names of the cases in which some provider was incorrect or raised."""
    return [name for name, case_rows in _grouped(rows).items() if not case_passed(case_rows)]


def run_cases(cases: list[Case], ceilings: dict | None = None, warmup_ms: float = 25,
              rep_ms: float = 100, label: str = "bench") -> list[dict]:
    """Runs every case, with progress lines on stderr; returns all rows."""
    def log(line):
        print(line, file=sys.stderr, flush=True)
    rows = []
    for i, case in enumerate(cases, 1):
        log(f"[{label} {i}/{len(cases)}] {case.name}")
        rows += run_case(case, ceilings, warmup_ms, rep_ms, log)
    return rows


def environment(suite: str, command: str, ceilings: dict) -> dict:
    """The result file's `env`: versions, device, date, command, timing method and ceilings."""
    env = dict(_runtime.info())
    env.update(suite=suite, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=command, ceilings=ceilings,
               timing="Triton interpreter on the CPU (perf_counter); not GPU performance"
               if _runtime.INTERPRET else "triton.testing.do_bench (CUDA events, L2 flushed); graph / %roofG: GPU "
               "time alone, from CUDA-graph replays (L2 flushed), without the host's launch cost")
    return env


def _rate(row: dict) -> str:
    if row["tflops"] is not None and row["bound"] != "memory":
        t = row["tflops"]
        return f"{t:.1f} TF/s" if t >= 1 else f"{t * 1e3:.2f} GF/s"
    return "-" if row["gbps"] is None else f"{row['gbps']:.1f} GB/s"


def _ms(v: float) -> str:
    return f"{v:.4f}" if v < 10 else f"{v:.2f}"


def format_table(rows: list[dict], env: dict) -> str:
    """The seed-style terminal table: one line per case, a column group per provider, dropin's median
    speed-up against each other provider, then pass/fail counts, failures, notes."""
    cases = _grouped(rows)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    others = [p for p in providers if p != "dropin"]
    width = max([len(n) for n in cases] + [4]) + 9
    cols = ["mean", "med", "min", "max", "rate", "%roof", "MiB", "graph", "%roofG"]
    widths = [9, 9, 9, 9, 12, 7, 8, 9, 7]
    group = sum(widths)
    lines = [f"=== {env['suite']} on {env['gpu']}: latency (ms), rate, % of roofline, peak MiB beyond inputs; "
             f"torch {env['torch']}, triton {env['triton']}, dropin {env['dropin']} ===",
             " " * width + "".join(f"{p:>{group}}" for p in providers)
             + ("   median speed-up of dropin" if "dropin" in providers and others else ""),
             f"{'Case':<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths)) * len(providers)
             + "".join(f"{'vs ' + p:>{max(len(p) + 5, 10)}}" for p in others if "dropin" in providers)]
    shape_class = None
    for name, case_rows in cases.items():
        by_provider = {r["provider"]: r for r in case_rows}
        if case_rows[0].get("class") not in (None, shape_class):
            shape_class = case_rows[0]["class"]
            lines.append(f"-- class {shape_class}")
        line = f"{'[PASSED]' if case_passed(case_rows) else '[FAILED]'} {name:<{width - 9}}"
        for p in providers:
            r = by_provider.get(p)
            if r is None or r["median_ms"] is None:
                text = "-" if r is None else r.get("note") or "ERROR (see below)"
                line += f"{text:>{group}}"
                continue
            pct = "-" if r["pct_of_ceiling"] is None else f"{r['pct_of_ceiling']:.1f}"
            peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
            graph = "-" if r.get("graph_ms") is None else _ms(r["graph_ms"])
            pct_g = "-" if r.get("graph_pct_of_ceiling") is None else f"{r['graph_pct_of_ceiling']:.1f}"
            cells = [_ms(r["mean_ms"]), _ms(r["median_ms"]), _ms(r["min_ms"]), _ms(r["max_ms"]), _rate(r), pct, peak,
                     graph, pct_g]
            line += "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
        speedups = by_provider.get("dropin", {}).get("speedup_vs", {})
        if "dropin" in providers:
            line += "".join(f"{(f'{speedups[p]:.2f}x' if p in speedups else '-'):>{max(len(p) + 5, 10)}}"
                            for p in others)
        lines.append(line)
    failed = failed_cases(rows)
    lines.append(f"Passed: {len(cases) - len(failed)} | Failed: {len(failed)}")
    if env.get("interpreter"):
        lines.append("  note: Triton interpreter on the CPU (no GPU): timings and speed-ups are not meaningful here, "
                     "the checks are")
    for r in rows:
        if r["correct"] is False:
            why = one_line(r["error"]) if "error" in r else f"rel_err {r['rel_err']:.2e} > tol {r['tol']:g}"
            lines.append(f"  FAILED {r['case']} / {r['provider']}: {why}")
    for note in dict.fromkeys(f"{r['provider']}: {r[k]}" for r in rows for k in ("note", "graph_note") if k in r):
        lines.append(f"  note: {note}")
    if any(r["fallback"] for r in rows):
        lines.append("  fallback (dropin fell back to torch): "
                     + ", ".join(f"{r['case']} / {r['provider']}" for r in rows if r["fallback"]))
    lines.append(f"  timing: {env['timing']}")
    return "\n".join(lines)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: str | Path, result: dict) -> Path:
    """Writes {"env": ..., "rows": [...]} (non-finite floats as null); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=1) + "\n")
    return path


def write_csv(path: str | Path, rows: list[dict]) -> Path:
    """One line per row; `speedup_vs` becomes columns speedup_vs_<provider>."""
    flat = []
    for r in rows:
        r = dict(r)
        for p, x in r.pop("speedup_vs", {}).items():
            r[f"speedup_vs_{p}"] = x
        flat.append(r)
    fields = list(dict.fromkeys(k for r in flat for k in r))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)
    return path


def write_plot(path: str | Path, rows: list[dict], title: str) -> Path:
    """Horizontal bars per case and provider (PNG): % of roofline where ceilings were measured, else
    TFLOP/s (GB/s for cases without a FLOP count); each bar is labelled with its rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _grouped(rows)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    roofline = any(r["pct_of_ceiling"] is not None for r in rows)
    height = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.3 * len(rows)))
    for j, p in enumerate(providers):
        ran = [next((r for r in rs if r["provider"] == p and r["median_ms"]), None) for rs in cases.values()]
        values = [0 if r is None else (r["pct_of_ceiling"] if roofline else r["tflops"] or r["gbps"]) or 0
                  for r in ran]
        bars = ax.barh([i + j * height for i in range(len(cases))], values, height, label=p)
        ax.bar_label(bars, ["" if r is None else _rate(r) for r in ran], fontsize=7, padding=2)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], list(cases), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of roofline (median)" if roofline else "TFLOP/s, or GB/s without a FLOP count (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def merged(old: dict, new: dict, key: str = "case") -> dict:
    """`new`'s rows in place of `old`'s rows of the same `key` (cases; `dropin inject`: providers), `old`'s other
    rows kept (in old's order, new ones last): a suite measured in parts, one call each. env is new's, with "parts"
    listing each part's command and date. Only results of one GPU, torch and Triton merge (ValueError otherwise)."""
    keys = ("gpu", "torch", "triton", "suite")
    if any(old["env"].get(k) != new["env"].get(k) for k in keys):
        raise ValueError("cannot merge results of different runs' " + "/".join(keys) + ": "
                         + ", ".join(f"{old['env'].get(k)} vs {new['env'].get(k)}" for k in keys))
    fresh = _grouped(new["rows"], key)
    rows, placed = [], set()
    for r in old["rows"]:
        if r[key] not in fresh:
            rows.append(r)
        elif r[key] not in placed:
            placed.add(r[key])
            rows.extend(fresh[r[key]])
    rows.extend(r for r in new["rows"] if r[key] not in placed)
    part = lambda env: {"command": env["command"], "date": env["date"]}
    env = dict(new["env"], parts=old["env"].get("parts", [part(old["env"])]) + [part(new["env"])])
    return {"env": env, "rows": rows}


def run_suite(suite: str, cases: list[Case], *, results_dir: str | Path = "benchmarks/results",
              save: bool = True, json_path=None, csv_path=None, plot: bool = False, command: str | None = None,
              warmup_ms: float = 25, rep_ms: float = 100, update: bool = False) -> dict:
    """Measures ceilings, runs the cases, prints the table to stdout and writes the requested files; with
    `update`, the files hold the suite's result file (RESULTS_DIR/<gpu>/<suite>.json) with these cases' rows
    replaced (`merged`).

    Returns {"env": ..., "rows": [...]} as written, with "classes" (classes.summarize) where the cases have
    classes; `failed_cases(result["rows"])` lists the failures."""
    if _runtime.INTERPRET:
        print(f"[{suite}] running under the Triton interpreter (no GPU): small cases, CPU timings",
              file=sys.stderr)
    ceilings = measure_ceilings()
    env = environment(suite, command or " ".join(sys.argv), ceilings)
    result = {"env": env, "rows": run_cases(cases, ceilings, warmup_ms, rep_ms, label=suite)}
    print(format_table(result["rows"], env), flush=True)
    default = Path(results_dir) / _runtime.gpu_slug() / f"{suite}.json"
    if update and default.exists():
        result = merged(json.loads(default.read_text()), result)
    if any(r.get("class") for r in result["rows"]):  # (rows of older files have none)
        result["classes"] = classes.summarize(result["rows"])
        print(classes.format_summary(result["classes"]), flush=True)
    written = []
    if save:
        written.append(write_json(default, result))
    if json_path:
        written.append(write_json(json_path, result))
    if csv_path:
        written.append(write_csv(csv_path, result["rows"]))
    if plot:
        written.append(write_plot(default.with_suffix(".png"), result["rows"], f"{suite} on {env['gpu']}"))
    for path in written:
        print(f"[{suite}] wrote {path}", file=sys.stderr)
    return result
