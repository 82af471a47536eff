"""Whole models, original vs injected (`dropin inject MODEL --train --bench`): a training step's gradients
compared, the share of the work that dropin does, and latency rows in every execution mode a user picks.

Providers (PROVIDERS), each for the original model and the injected one: eager (`original`, `dropin`); the whole
forward captured in one CUDA graph and replayed (`_graph`, inference only); torch.compile default (`_compile`) and
mode="reduce-overhead" (`_compile_ro`); and peers, other libraries' versions of the same model where they have one
(`liger`: Liger-Kernel's Llama, see `bench.peers`). A mode that cannot run gives a row with the reason in `error` or
`note`. A training step is the forward, the loss (`TrainingLoss`: cross-entropy against fixed labels), the backward
and torch's AdamW step (fused on CUDA). `--curve N` adds the loss curves of N training steps (`loss_curve`).
Row keys (`--json` / `--csv`): model, provider, mode (inference | train), dtype, batch, median_ms, mean_ms, min_ms,
max_ms, first_call_ms (the first call, ms: for the torch.compile providers the compile time with it), graph_ms (GPU
time without the host's launch cost, eager inference rows only; None under the interpreter), peak_memory_mib (see
`bench_rows`; None under the interpreter), saved_mib (the activation memory of an eager training step,
`saved_bytes`), speedup_vs_original (original eager median / this median), rel_err_vs_fp64 (||x - x_64|| / ||x_64||
against the original model run in float64: the output, and in train mode the worst of the output and every
parameter's gradient, see `step_errors`), coverage_modules, coverage_flops, coverage_time (see `coverage`; None on
original rows), note, error.
"""
from __future__ import annotations

import copy
import inspect
import logging
import pathlib
import time

import torch
from torch import nn

from .. import _runtime
from .._tolerance import rel_err, to_float64
from ..inject.coverage import measure
from . import harness

progress = logging.getLogger("dropin.progress")  # each row's wall time (`dropin inject --progress`)

PROVIDERS = ("original", "original_graph", "original_compile", "original_compile_ro",
             "dropin", "dropin_graph", "dropin_compile", "dropin_compile_ro", "liger")
PEERS = ("liger",)  # providers built from another library (bench_rows' `peers`), eager
# The providers whose figures the host's speed sets (a Python launch per op), and which vary from process to
# process: `dropin inject --processes N` times these in N processes, the others (CUDA-graph replays, compiled
# code) in the first.
HOST_BOUND = ("original", "dropin", *PEERS)


def main_output(out) -> torch.Tensor:
    """A model's main output: the tensor itself, or the first entry of a tuple or HF ModelOutput (logits, or the
    last hidden state)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def train_step(forward, model: nn.Module, inputs: tuple, grad: torch.Tensor, optimizer=None):
    """Forward + backward of sum(output * grad) (grad: a fixed upstream gradient; ones for a model whose output is
    its loss, `TrainingLoss`), with the random state seeded (the same dropout masks for every model), then
    optimizer.step() where one is given. Returns (output, {state_dict key: gradient})."""
    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)}
    for p in params.values():
        p.grad = None
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(0)
        out = main_output(forward(*inputs))
        (out * grad).sum().backward()
    if optimizer is not None:
        optimizer.step()
    return out.detach(), {k: p.grad for k, p in params.items() if p.grad is not None}


def timing_optimizer(model: nn.Module):
    """torch's AdamW over the model's parameters (fused on CUDA) with lr 0: a step does all of its work (moments,
    weight decay, update) and leaves the weights as they are, so that every provider times and checks the same
    weights."""
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(model.parameters(), lr=0.0, **fused)


class TrainingLoss(nn.Module):
    """A model with its training loss as its output: the cross-entropy of its main output's last dim against
    fixed `labels` (`training_labels`), in float32. A language model (a forward with `labels` and an output
    embedding, HF's *ForCausalLM) computes it itself: HF's label shift, and in an injected LlamaForCausalLM
    dropin's fused linear + cross-entropy, which never makes the logits (HF computes that loss in float32, for a
    float64 model too: a float64 reference's loss carries float32's rounding). Parameters keep their names under
    `model.`, alike in every model so wrapped."""

    def __init__(self, model: nn.Module, labels: torch.Tensor):
        super().__init__()
        self.model, self.labels = model, labels
        head = getattr(model, "get_output_embeddings", lambda: None)()
        self.own_loss = head is not None and "labels" in inspect.signature(type(model).forward).parameters

    def forward(self, *inputs):
        if self.own_loss:
            return self.model(*inputs, labels=self.labels).loss
        logits = main_output(self.model(*inputs))
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), self.labels.flatten())


def training_labels(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """Fixed random class labels for the model's main output, shaped by one forward (a classifier's [batch], a
    language model's [batch, tokens])."""
    with torch.no_grad():
        out = main_output(model(*inputs))
    generator = torch.Generator(out.device).manual_seed(0)
    return torch.randint(out.shape[-1], out.shape[:-1], generator=generator, device=out.device)


# A gradient's error is relative to at least this share of the largest parameter gradient's norm: gradients that
# are zero in exact arithmetic (a key projection's bias, under softmax) hold rounding noise only (~1e-10 of it).
GRAD_FLOOR = 1e-5


def gradient_errors(grads: dict, grads_64: dict) -> dict:
    """{parameter: ||g - g_64|| / max(||g_64||, GRAD_FLOOR * the largest ||g_64||)}; inf where only one of the two
    has a gradient."""
    floor = GRAD_FLOOR * max((g.double().norm().item() for g in grads_64.values()), default=0.0)
    errors = {k: float("inf") for k in grads.keys() ^ grads_64.keys()}
    for k in grads.keys() & grads_64.keys():
        diff = (grads[k].double() - grads_64[k].double()).norm().item()
        errors[k] = diff / max(grads_64[k].double().norm().item(), floor) if diff else 0.0
    return errors


def step_errors(outs: tuple, outs_64: tuple) -> dict:
    """The errors of a step's (output, gradients) against the float64 step's: {"output": e, parameter: e, ...}."""
    return {"output": rel_err(outs[0], outs_64[0]), **gradient_errors(outs[1], outs_64[1])}


def upstream_gradient(original: nn.Module, inputs: tuple) -> torch.Tensor:
    """The upstream gradient of a training step (its loss: sum(output * it)): ones where the output is a loss (a
    scalar, `TrainingLoss`), else a fixed random tensor shaped by one forward."""
    out = main_output(original(*inputs)).detach()
    return torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)


# The loss curves' bar: at every step the injected model's loss within this relative difference of the original's
CURVE_LIMITS = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _curve(model: nn.Module, inputs: tuple, targets: torch.Tensor | None, steps: int, lr: float) -> list:
    """The losses of `steps` AdamW steps of `model` on one batch (each step seeded alike: the same dropout masks),
    from no gradient (a gradient left by an earlier step would join the first): the model's output where it is a
    loss (a scalar, `TrainingLoss`), else the cross-entropy of its main output against `targets`."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **({"fused": True} if device.type == "cuda" else {}))
    losses = []
    for step in range(steps):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(step)
            out = main_output(model(*inputs))
            loss = out if out.dim() == 0 else nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).double(),
                                                                         targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def loss_curve(original: nn.Module, injected: nn.Module, inputs: tuple, steps: int, lr: float = 1e-5) -> dict:
    """The original, the injected model and a float64 copy of the original trained `steps` steps on one fixed batch from
    the same weights (torch's AdamW, fused on CUDA): the loss is the model's output where it is one
    (`TrainingLoss`), else the cross-entropy of the main output's last dim against fixed random targets (logits of a
    classifier or a language model). Returns {"steps", "lr", "original", "dropin", "float64": their losses,
    "rel_diff": per step |dropin - original| / |original|, "max_rel_diff", "torch_max_rel_diff": the original's own
    largest difference from the float64 curve (Adam's normalised steps carry rounding noise on gradients near 0 into
    the weights), "limit": CURVE_LIMITS of the dtype, "within"}. Trains the models given: run it last."""
    out = main_output(original(*inputs)).detach()
    targets = None if out.dim() == 0 else training_labels(original, inputs)
    reference = copy.deepcopy(original).double()
    curves = {"float64": _curve(reference, tuple(map(to_float64, inputs)), targets, steps, lr)}
    del reference
    curves.update(original=_curve(original, inputs, targets, steps, lr), dropin=_curve(injected, inputs, targets,
                                                                                       steps, lr))

    def differences(a, b):
        return [abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(a, b)]
    diffs = differences(curves["dropin"], curves["original"])
    bound = CURVE_LIMITS.get(next(original.parameters()).dtype, CURVE_LIMITS[torch.float32])
    return {"steps": steps, "lr": lr, **curves, "rel_diff": diffs, "max_rel_diff": max(diffs),
            "torch_max_rel_diff": max(differences(curves["original"], curves["float64"])), "limit": bound,
            "within": max(diffs) <= bound}


def plot_curve(path, curve: dict, title: str):
    """loss_curve's result as a PNG: the three loss curves step by step, and below them the injected model's
    relative difference from the original's (and the original's from its float64 curve) against the limit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, curve["steps"] + 1)
    fig, (losses, diffs) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, style in (("float64", ":"), ("original", "-"), ("dropin", "--")):
        losses.plot(steps, curve[name], style, label=name)
    losses.set_ylabel("loss")
    losses.set_title(title)
    losses.legend()
    own = [abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(curve["original"], curve["float64"])]
    diffs.semilogy(steps, [max(d, 1e-12) for d in curve["rel_diff"]], "--", label="|dropin - original| / |original|")
    diffs.semilogy(steps, [max(d, 1e-12) for d in own], ":", label="|original - float64| / |float64|")
    diffs.axhline(curve["limit"], color="red", label=f"limit {curve['limit']:g}")
    diffs.set_xlabel("AdamW step")
    diffs.set_ylabel("relative difference (1e-12 where 0)")
    diffs.legend()
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def float64_step(original: nn.Module, inputs: tuple, grad: torch.Tensor | None):
    """(output, gradients) of a float64 copy of `original` on the inputs in float64 (a training step with
    upstream gradient `grad`, an inference forward for None): the reference."""
    model = copy.deepcopy(original).double()
    return _step(model, model, tuple(map(to_float64, inputs)), to_float64(grad))()


def coverage(original: nn.Module, injected: nn.Module, inputs: tuple, report, grad: torch.Tensor | None):
    """({coverage_modules, coverage_flops, coverage_time}, the measured dropin.inject.coverage.Coverage) of one
    step (an inference forward, or a training step with upstream gradient `grad`). coverage_modules: the share of
    the torch modules without children that compute (the report's count) done by dropin modules; coverage_flops
    and coverage_time: the profiler's shares of the FLOPs and of the GPU kernel time (None under the interpreter)
    in dropin."""
    measured = measure(injected, original, lambda m: _step(m, m, inputs, grad)())
    covered = sum(r.covers for r in report.replaced)
    return {"coverage_modules": covered / max(covered + len(report.left), 1), "coverage_flops": measured.flops,
            "coverage_time": measured.kernel_time}, measured


def _step(forward, model: nn.Module, inputs: tuple, grad: torch.Tensor | None, optimizer=None):
    """The timed call, returning (output, {parameter: gradient}): an inference forward (no_grad, no gradients) or
    a training step (with optimizer's step where one is given)."""
    if grad is None:
        def run():
            with torch.no_grad():
                return main_output(forward(*inputs)), {}
        return run
    return lambda: train_step(forward, model, inputs, grad, optimizer)


def graphed(model: nn.Module, inputs: tuple):
    """The model's inference forward captured in one CUDA graph (after two warm-up calls on a side stream, as
    torch's CUDA-graph notes advise): a step that copies `inputs` into the graph's static inputs once and replays
    the graph on every call, returning (output, {})."""
    if _runtime.INTERPRET:
        raise harness.Skipped("skipped: interpreter")
    static = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            model(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = main_output(model(*static))

    def run():
        graph.replay()
        return out, {}
    return run


# Models whose forward cannot be captured in one plain CUDA graph, and why: their `_graph` rows say so instead of
# running (a device-side assert on replay would poison the process for every later row).
NO_PLAIN_GRAPH = {"llama": "HF Llama's forward cannot be captured in one plain CUDA graph (its mask and position "
                           "code asserts on the device when replayed); reduce-overhead captures it"}


def _provider_step(name: str, provider: str, model: nn.Module, inputs: tuple, grad: torch.Tensor | None,
                   no_graph: str | None):
    """The step to check and time for one provider (see PROVIDERS) of model `name`; no_graph: why its forward
    cannot be captured in one plain CUDA graph (else NO_PLAIN_GRAPH's reason, if any)."""
    mode = provider.partition("_")[2]
    if mode == "graph":
        if grad is not None:
            raise harness.Skipped("no plain CUDA graph of a training step (reduce-overhead captures one)")
        if no_graph or name in NO_PLAIN_GRAPH:
            raise harness.Skipped(no_graph or NO_PLAIN_GRAPH[name])
        return graphed(model, inputs)
    forward = {"": model, "compile": harness.compiled(model),
               "compile_ro": harness.compiled(model, mode="reduce-overhead")}[mode]
    return _step(forward, model, inputs, grad, None if grad is None else timing_optimizer(model))


def _resident(model: nn.Module) -> dict:
    """{data_ptr: bytes} of the storages the model's modules hold: parameters, buffers and tensor attributes
    (weights dropin derived at injection, e.g. a BatchNorm folded into a conv)."""
    storages = {}
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return storages


def saved_bytes(step, model: nn.Module) -> int:
    """The activation memory of a training step: bytes of the tensors autograd keeps from its forward for its
    backward (torch.autograd.graph.saved_tensors_hooks; each storage once), but for the model's own (`_resident`:
    the weights). Tensors an op keeps on its ctx outside save_for_backward are not seen (dropin's linear +
    cross-entropy keeps its gradients so, as Liger-Kernel's does): peak_memory_mib counts them."""
    resident, storages = _resident(model), {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in resident:
            storages[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def _memory_mark() -> int | None:
    """The device memory allocated now, with the peak statistics reset (None under the interpreter)."""
    if _runtime.INTERPRET:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


# A row left to a fresh process: an earlier row's device error (an illegal address, a device-side assert) leaves
# the CUDA context unusable, so every later call of this process fails.
NOT_RUN = "not run in this process: an earlier row's device error left its CUDA context unusable"


def device_fault(error: str | None) -> bool:
    """Whether a row's error is one that leaves the process's CUDA context unusable."""
    return bool(error) and ("CUDA error" in error or error.startswith("AcceleratorError"))


def bench_rows(name: str, original: nn.Module, injected: nn.Module, inputs: tuple, *, grad: torch.Tensor | None,
               reference: tuple, dtype: str, batch: int, cover: dict, warmup_ms: float = 25,
               rep_ms: float = 100, no_graph: str | None = None, providers=None, peers=None) -> list[dict]:
    """One row per entry of `providers` (PROVIDERS' names and order, see the module docstring; by default all but the
    peers not given; speed-ups where `original` is one): a training step with upstream gradient `grad` and an AdamW
    step (`timing_optimizer`), or inference for None; errors against `reference` (float64_step's for the same grad).
    peers: {PEERS name: a function that builds that library's version of the original (it may raise
    harness.Skipped)}. A provider that cannot run here gets a `note` (skipped) or an `error` (it raised) and the
    others still run; after a device error (`device_fault`) the later rows only get the note NOT_RUN. no_graph:
    why the model's forward cannot be captured in one plain CUDA graph (its `_graph` rows say so instead of
    running). peak_memory_mib: the most device memory allocated during the provider's calls
    (torch.cuda.max_memory_allocated) beyond what was allocated before its first, plus what its model holds
    (`_resident`): a process running only this model in this mode would peak there (in training: weights, gradients,
    AdamW's state, activations). saved_mib: the activation memory of a training step (`saved_bytes`), eager
    providers only. Not counted: copies of frozen weights that dropin keeps in other layouts from calls before the
    row's (conv2d.weights.derived, inference only). Where two or more HOST_BOUND providers run, their times are
    taken again at the end, in alternation (`_time_in_alternation`): those rows' median_ms, mean_ms, min_ms and
    max_ms come from there."""
    models, peers = {"original": original, "dropin": injected}, peers or {}
    providers = providers or tuple(p for p in PROVIDERS if p not in PEERS or p in peers)
    rows, fault, host_bound = [], False, []
    for provider in providers:
        row = {"model": name, "provider": provider, "mode": "inference" if grad is None else "train", "dtype": dtype,
               "batch": batch, "median_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None,
               "first_call_ms": None, "graph_ms": None, "peak_memory_mib": None, "saved_mib": None,
               "speedup_vs_original": None, "rel_err_vs_fp64": None, "coverage_modules": None,
               "coverage_flops": None, "coverage_time": None}
        if provider.startswith("dropin"):
            row.update(cover)
        rows.append(row)
        if fault:
            row["note"] = NOT_RUN
            continue

        def check_and_time():
            if provider in PEERS and provider not in peers:
                raise harness.Skipped(f"no {provider} version of {name}")
            model = peers[provider]() if provider in peers else models[provider.split("_")[0]]
            mark = _memory_mark()
            step = _provider_step(name, provider, model, inputs, grad, no_graph)
            start = time.perf_counter()
            outs = step()
            if not _runtime.INTERPRET:
                torch.cuda.synchronize()
            row["first_call_ms"] = (time.perf_counter() - start) * 1e3
            row["rel_err_vs_fp64"] = max(step_errors(outs, reference).values())
            times = harness.time_fn(step, warmup_ms, rep_ms)
            if mark is not None:
                torch.cuda.synchronize()
                resident = sum(_resident(model).values())
                row["peak_memory_mib"] = (torch.cuda.max_memory_allocated() - mark + resident) / 2**20
            if grad is not None and provider.partition("_")[2] == "":
                row["saved_mib"] = saved_bytes(step, model) / 2**20
            model.zero_grad(set_to_none=True)  # (the next row starts from the same memory)
            return step, times, model

        start = time.perf_counter()
        measured = harness.attempt(row, check_and_time)
        progress.info("bench %s: %.1f s%s", provider, time.perf_counter() - start,
                      "" if measured else f" ({row.get('note') or row.get('error')})")
        if measured is None:
            fault = device_fault(row.get("error"))
            continue
        step, times, model = measured
        row.update(harness.summarize(times))
        if grad is None and provider in ("original", "dropin"):
            row["graph_ms"], note = harness.graph_time(step)
            if note:
                row["note"] = note
        if provider in HOST_BOUND:
            host_bound.append((row, step, model))
        del step, measured, model  # (a training step's optimizer and its state, unless kept for the alternation)
    if len(host_bound) > 1 and not fault:  # (after a device error nothing more runs)
        _time_in_alternation(host_bound, rep_ms)
    return with_speedups(rows)


ROUNDS = 2 if _runtime.INTERPRET else 10  # rounds of `_time_in_alternation` (the interpreter's times say nothing)


def _time_in_alternation(host_bound: list, rep_ms: float) -> None:
    """Times again the host-bound providers' steps [(row, step, model)] in alternation (`harness.alternated_times`,
    ROUNDS rounds of about rep_ms / ROUNDS of each step), replacing each row's times: their speed-ups then compare
    figures of the same moments of the host."""
    calls = max(1, round(rep_ms / ROUNDS / max(row["median_ms"] for row, _, _ in host_bound)))
    times = harness.alternated_times([step for _, step, _ in host_bound], ROUNDS, calls)
    for (row, _, model), samples in zip(host_bound, times):
        row.update(harness.summarize(samples))
        model.zero_grad(set_to_none=True)


def with_speedups(rows: list[dict]) -> list[dict]:
    """rows with speedup_vs_original set from the `original` row's median, where there is one."""
    base = next((r["median_ms"] for r in rows if r["provider"] == "original"), None)
    for row in rows:
        if base and row["median_ms"]:
            row["speedup_vs_original"] = base / row["median_ms"]
    return rows


def recommendation(rows: list[dict], tolerance: float) -> str:
    """Which way to run the injected model, from the rows: the fastest dropin provider whose error is within
    `tolerance`, with its speed-up over the original eager and over the original's fastest mode; none under the
    interpreter."""
    if _runtime.INTERPRET:
        return f"no recommendation: {INTERPRETER_TIMES}"
    timed = [r for r in rows if r["median_ms"] and r["rel_err_vs_fp64"] is not None]
    ours = [r for r in timed if r["provider"].startswith("dropin") and r["rel_err_vs_fp64"] <= tolerance]
    theirs = [r for r in timed if r["provider"].startswith("original")]
    if not ours or not theirs:
        return "no recommendation: no injected mode was timed within the tolerance"
    best, rival = min(ours, key=lambda r: r["median_ms"]), min(theirs, key=lambda r: r["median_ms"])
    return (f"fastest here: {best['provider']} ({best['median_ms']:.3f} ms: {best['speedup_vs_original']:.2f}x the "
            f"original in eager, {rival['median_ms'] / best['median_ms']:.2f}x the original's fastest mode, "
            f"{rival['provider']})")


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """The rows of several processes' bench_rows merged provider by provider (the first run's providers; each
    provider's rows from the runs that have it): median_ms and graph_ms the median of the processes' medians
    (their list in process_median_ms, the spread in spread_ms: [min, max]), min_ms / max_ms the extremes, mean_ms
    the mean of the means, rel_err_vs_fp64 the worst, speed-ups from the merged medians; a provider that failed in
    any process keeps that process's error or note."""
    import statistics

    merged = []
    for first in runs[0]:
        same = [r for run in runs for r in run if r["provider"] == first["provider"]]
        row = dict(first)
        timed = [r for r in same if r["median_ms"] is not None]
        if len(timed) < len(same):
            merged.append(next(r for r in same if r["median_ms"] is None))
            continue
        medians = [r["median_ms"] for r in timed]
        graphs = [r["graph_ms"] for r in timed if r["graph_ms"] is not None]
        row.update(median_ms=statistics.median(medians), process_median_ms=medians,
                   spread_ms=[min(medians), max(medians)], min_ms=min(r["min_ms"] for r in timed),
                   max_ms=max(r["max_ms"] for r in timed), mean_ms=statistics.fmean(r["mean_ms"] for r in timed),
                   graph_ms=statistics.median(graphs) if graphs else None,
                   rel_err_vs_fp64=max(r["rel_err_vs_fp64"] for r in timed))
        merged.append(row)
    return with_speedups(merged)


INTERPRETER_TIMES = ("the times are CPU times of kernels run by the Triton interpreter, which say nothing of their "
                     "speed on a GPU")

# Table columns: (row key, heading, format, width).
COLUMNS = (("median_ms", "median ms", ".4f", 11), ("graph_ms", "graph ms", ".4f", 10),
           ("peak_memory_mib", "peak MiB", ".0f", 10), ("saved_mib", "saved MiB", ".4g", 10),
           ("speedup_vs_original", "speed-up", ".2f", 10), ("rel_err_vs_fp64", "err vs fp64", ".2e", 12),
           ("coverage_modules", "modules", ".0%", 9), ("coverage_flops", "FLOPs", ".2%", 9),
           ("coverage_time", "GPU time", ".1%", 10))


def format_rows(rows: list[dict]) -> str:
    """The terminal table of bench_rows: the COLUMNS that some row has a value in."""
    first = rows[0]
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = [f"{first['model']}, {first['mode']}, {first['dtype']}, batch {first['batch']}",
             f"{'provider':<19}" + "".join(f"{head:>{width}}" for _, head, _, width in columns) + "  note"]
    for r in rows:
        cells = ["-" if r.get(key) is None else format(r[key], fmt) + ("x" if key.startswith("speedup") else "")
                 for key, _, fmt, _ in columns]
        lines.append(f"{r['provider']:<19}" + "".join(f"{c:>{w}}" for c, (*_, w) in zip(cells, columns))
                     + f"  {r.get('error') or r.get('note', '')}")
    lines.append("err vs fp64: relative error against the original model in float64 (train: worst of the output "
                 "and the parameter gradients); peak MiB: the device memory of the model alone in that mode at its "
                 "peak; saved MiB: the tensors a training step keeps for its backward, weights aside; modules: share "
                 "of the computing torch modules covered by dropin modules; FLOPs, GPU time: shares of the FLOPs and "
                 "of the GPU kernel time in dropin kernels (torch profiler)")
    if _runtime.INTERPRET:
        lines.append(f"speed-up: {INTERPRETER_TIMES}")
    return "\n".join(lines)
