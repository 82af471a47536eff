"""Command line: `dropin info`, `dropin bench SUITE [options]`, `dropin inject MODEL [options]`, `dropin zoo`.

torch and dropin's kernels are imported by the commands that use them, so that `--help` and `--version` are quick.
"""
import argparse
import dataclasses
import importlib
import os
import sys

import dropin

# Suite name -> "module:function"; the function takes `quick` and returns a list of harness.Case.
SUITES = {
    "matmul": "dropin.bench.matmul:matmul_cases",
    "bmm": "dropin.bench.matmul:bmm_cases",
    "conv2d": "dropin.bench.conv2d:conv2d_cases",
    "swiglu": "dropin.bench.swiglu:swiglu_cases",
    "rms_norm": "dropin.bench.rms_norm:rms_norm_cases",
    "rope": "dropin.bench.rope:rope_cases",
    "attention": "dropin.bench.attention:attention_cases",
    "sparse": "dropin.bench.sparse:sparse_cases",
    "flce": "dropin.bench.flce:flce_cases",
    "group_norm": "dropin.bench.layers:group_norm_cases",
    "conv1d": "dropin.bench.layers:conv1d_cases",
    "activations": "dropin.bench.layers:activation_cases",
}
# Suites with a runner of their own (not checked and timed cases): name -> "module:function(args) -> exit code".
RUNNERS = {"overhead": "dropin.bench.overhead:run"}
# `dropin zoo --dtype` (dropin.bench.zoo.DTYPES, named here so that --help imports no torch).
ZOO_DTYPES = ("bfloat16", "float32", "both")


# Llama defaults: seed 002's LlamaModel (1 layer, hidden 1024, 4 heads of 256, intermediate 11008, vocab 32000,
# token ids [2, 1024]), and a tiny one under the interpreter. Flag -> LlamaConfig field ("seq", "batch": inputs).
LLAMA = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
         "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size", "seq": None,
         "batch": None}
LLAMA_SEED_002 = {"layers": 1, "hidden": 1024, "heads": 4, "kv_heads": 4, "intermediate": 11008, "vocab": 32000,
                  "seq": 1024, "batch": 2}
LLAMA_TINY = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 2, "intermediate": 128, "vocab": 512, "seq": 8,
              "batch": 2}
# Under the interpreter CvT-13 is reduced (its full size takes minutes there): these CvtConfig fields replace
# CvT-13's (embed dims 64/192/384, heads 1/3/6, depths 1/2/10).
CVT_TINY = {"embed_dim": [8, 16, 32], "num_heads": [1, 2, 2], "depth": [1, 2, 3]}


class WeightsError(Exception):
    """--weights exists but could not be loaded into the model."""


def _load_weights(args, load):
    """load(): what it returns; what it raises becomes a one-line WeightsError naming --weights."""
    try:
        return load()
    except Exception as e:
        reason = " ".join(str(e).split())
        raise WeightsError(f"--weights {args.weights}: cannot load it into {args.model}: {type(e).__name__}: "
                           f"{reason[:300]}{'...' if len(reason) > 300 else ''}") from e


def _pretrained(cls, args, **kwargs):
    """cls.from_pretrained(--weights) (a save_pretrained directory), or None without --weights."""
    return args.weights and _load_weights(args, lambda: cls.from_pretrained(args.weights, **kwargs))


def _torchvision(args):
    import torch
    import torchvision

    model = getattr(torchvision.models, args.model)()  # random weights
    if args.weights:
        _load_weights(args, lambda: model.load_state_dict(torch.load(args.weights, map_location="cpu",
                                                                     weights_only=True)))
    return model


def _cvt(args):
    from transformers import CvtConfig, CvtForImageClassification

    from dropin import _runtime

    # --train: stochastic depth off (CvT-13 drops stage 3's residual branches at random, with masks that differ
    # between dtypes and under torch.compile: no two runs of a step could be compared)
    overrides = {"drop_path_rate": [0.0, 0.0, 0.0]} if args.train else {}
    config = CvtConfig(num_labels=1000, **(CVT_TINY if _runtime.INTERPRET else {}), **overrides)  # CvT-13
    return _pretrained(CvtForImageClassification, args, **overrides) or CvtForImageClassification(config)


def _llama(args):
    """LlamaModel; LlamaForCausalLM with --train (its loss from labels) and with --generate (generate() needs the
    LM head; its KV cache on)."""
    import transformers

    cls = transformers.LlamaForCausalLM if args.generate or args.train else transformers.LlamaModel
    cache = bool(args.generate)
    sizes = {field: getattr(args, flag) for flag, field in LLAMA.items() if field}
    positions = max(2048, args.seq + (args.generate or 0))
    config = transformers.LlamaConfig(max_position_embeddings=positions, use_cache=cache,
                                      attn_implementation="sdpa", **sizes)
    return _pretrained(cls, args, attn_implementation="sdpa", use_cache=cache) or cls(config)


# Model name -> a function that builds it from the parsed arguments (random weights unless --weights).
MODELS = {"resnet18": _torchvision, "resnet50": _torchvision, "cvt-13": _cvt, "llama": _llama}


def _inputs(args, model) -> tuple:
    """The forward arguments: random token ids [batch, seq] for llama, random images otherwise."""
    import torch

    from dropin import _runtime

    if args.model == "llama":
        return (torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=_runtime.KERNEL_DEVICE),)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=_runtime.KERNEL_DEVICE,
                    dtype=getattr(torch, args.dtype))
    return (x.to(memory_format=torch.channels_last if args.channels_last else torch.contiguous_format),)


def _check_inject_args(args):
    """Fills in the defaults that depend on the model and the interpreter; the problem with the arguments, or None."""
    from dropin import _runtime

    args.batch = args.batches[0] if args.batches else None
    bad = [f"--batch {b}" for b in args.batches or () if b <= 0]
    bad += [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in (*LLAMA, "image_size") and v is not None and v <= 0]
    if bad:
        return f"{bad[0]}: must be positive"
    given = [flag for flag in LLAMA if flag != "batch" and getattr(args, flag) is not None]
    if args.model == "llama":
        if args.image_size is not None or args.channels_last:
            return "--image-size and --channels-last are for image models, not llama"
        config_flags = [flag for flag in given if flag != "seq"]
        if args.weights and config_flags:
            return (f"--{config_flags[0].replace('_', '-')} cannot be combined with --weights (the checkpoint's "
                    f"config is used)")
        defaults = LLAMA_TINY if _runtime.INTERPRET else LLAMA_SEED_002
        for flag, value in defaults.items():
            if getattr(args, flag) is None:
                setattr(args, flag, args.heads if flag == "kv_heads" and args.heads else value)
        if args.hidden % args.heads or args.heads % args.kv_heads:
            return (f"--hidden {args.hidden} must be a multiple of --heads {args.heads}, and --heads a multiple of "
                    f"--kv-heads {args.kv_heads}")
    else:
        if given:
            return f"--{given[0].replace('_', '-')} is a llama option, not one of {args.model}"
        args.batch = args.batch or 1
        args.image_size = args.image_size or (32 if _runtime.INTERPRET else 224)
    if args.weights and not os.path.exists(args.weights):
        return f"--weights {args.weights}: no such file or directory"
    directory = args.model in ("cvt-13", "llama")  # HF: from_pretrained(directory); torchvision: a state_dict file
    if args.weights and os.path.isdir(args.weights) != directory:
        return (f"--weights {args.weights}: {args.model} loads "
                f"{'a save_pretrained directory' if directory else 'a state_dict file (torch.save)'}")
    if (args.json or args.csv) and not args.bench and not (args.json and args.curve):
        return "--json and --csv write the --bench rows (--json the --curve too): add --bench"
    if args.curve is not None and (not args.train or args.curve < 1 or args.generate is not None):
        return f"--curve {args.curve}: a number of steps (at least 1) with --train"
    if args.plot and not args.curve:
        return "--plot draws the --curve: add --train --curve STEPS"
    if args.generate is not None:
        if args.model != "llama" or not args.bench or args.train or args.processes > 1 or args.providers:
            return "--generate is a llama --bench option (inference, one process, every provider)"
        if args.generate < 2:
            return f"--generate {args.generate}: at least 2 new tokens (the prefill's and one decoding step's)"
    elif args.batches and len(args.batches) > 1:
        return f"--batch {','.join(map(str, args.batches))}: several batch sizes only with --generate"
    if args.providers and not args.bench:
        return "--providers chooses the --bench rows: add --bench"
    problem = _update_problem(args) if args.update else None
    if problem:
        return problem
    if args.processes < 1 or args.processes > 1 and not args.bench:
        return f"--processes {args.processes}: must be at least 1, and more than 1 only with --bench"
    for flag in ("prune", "sparse"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value <= 1:
            return f"--{flag} {value}: must be in [0, 1]"
    return None


def _prune(model, fraction: float, mlp_only: bool) -> None:
    """Zeros `fraction` of the weights of the model's Conv2d and Linear layers (llama: the MLP projections),
    smallest magnitudes model-wide; permanent (plain zeros, no prune hooks left)."""
    from torch import nn
    from torch.nn.utils import prune

    layers = [m for name, m in model.named_modules()
              if isinstance(m, (nn.Conv2d, nn.Linear)) and (not mlp_only or ".mlp." in f".{name}")]
    prune.global_unstructured([(m, "weight") for m in layers], pruning_method=prune.L1Unstructured, amount=fraction)
    for m in layers:
        prune.remove(m, "weight")


def load_suite(name: str):
    """The case-building function of a registered suite."""
    module, function = SUITES[name].split(":")
    return getattr(importlib.import_module(module), function)


def _info(args) -> int:
    from dropin import _runtime

    for key, value in _runtime.info().items():
        print(f"{key}: {value}")
    return 0


def _bench(args) -> int:
    from dropin import _runtime
    from dropin.bench import harness

    if args.providers and (args.suite in RUNNERS or not args.no_save):
        print(f"dropin bench: --providers needs --no-save (the result file holds every provider) and a suite of "
              f"cases (not {', '.join(RUNNERS)})", file=sys.stderr)
        return 2
    if args.suite in RUNNERS:
        module, function = RUNNERS[args.suite].split(":")
        return getattr(importlib.import_module(module), function)(args)
    quick = args.quick or _runtime.INTERPRET
    known = load_suite(args.suite)(quick=quick)
    classes = list(dict.fromkeys(c.group for c in known if c.group))
    if args.shape_class and args.shape_class not in classes:
        print(f"dropin bench: suite '{args.suite}' has no class {args.shape_class!r}; its classes: "
              f"{', '.join(classes) or 'none'}", file=sys.stderr)
        return 2
    cases = [c for c in known if (args.cases is None or args.cases in c.name)
             and args.shape_class in (None, c.group)]
    if args.providers:
        wanted = args.providers.split(",")
        offered = list(dict.fromkeys(name for c in known for name in c.providers))
        if not set(wanted) <= set(offered):
            print(f"dropin bench: suite '{args.suite}' has no provider {', '.join(sorted(set(wanted) - set(offered)))};"
                  f" its providers: {', '.join(offered)}", file=sys.stderr)
            return 2
        cases = [dataclasses.replace(c, providers={k: f for k, f in c.providers.items() if k in wanted})
                 for c in cases]
        cases = [c for c in cases if c.providers]
    if not cases:
        names = "\n  ".join(c.name for c in known)
        print(f"dropin bench: no case of suite '{args.suite}' matches --cases {args.cases!r}; the suite's "
              f"{'quick ' if quick else ''}cases:\n  {names}", file=sys.stderr)
        return 2
    result = harness.run_suite(
        args.suite, cases, results_dir=args.results_dir, save=not args.no_save, json_path=args.json,
        csv_path=args.csv, plot=args.plot, command=" ".join(["dropin", *args.argv]),
        warmup_ms=args.warmup, rep_ms=args.rep, update=args.update)
    ran = {c.name for c in cases}
    return 1 if any(name in ran for name in harness.failed_cases(result["rows"])) else 0


def _describe(args, model) -> str:
    from dropin import _runtime

    if args.model == "llama":
        c = model.config
        return (f"llama ({type(model).__name__}): {c.num_hidden_layers} layer(s), hidden {c.hidden_size}, "
                f"{c.num_attention_heads} heads ({c.num_key_value_heads} kv) of "
                f"{c.hidden_size // c.num_attention_heads}, intermediate {c.intermediate_size}, vocab {c.vocab_size}; "
                f"token ids [{args.batch}, {args.seq}]")
    reduced = " (reduced under the interpreter: " + ", ".join(f"{k} {v}" for k, v in CVT_TINY.items()) + ")"
    no_drop_path = ", stochastic depth off" if args.model == "cvt-13" and args.train else ""
    return (f"{args.model}{reduced if args.model == 'cvt-13' and _runtime.INTERPRET and not args.weights else ''}"
            f"{no_drop_path}, "
            f"{args.batch}x3x{args.image_size}x{args.image_size} images"
            f"{', channels_last' if args.channels_last else ''}")


def _training_loss(original, inputs):
    """The function that gives a model its training loss as output (bench.models.TrainingLoss, one set of fixed
    labels for every model)."""
    from dropin.bench import models

    labels = models.training_labels(original, inputs)
    return lambda model: models.TrainingLoss(model, labels)


def _train(original, model, inputs, grad, reference) -> bool:
    """One training step (upstream gradient `grad`) on each model; prints their errors against `reference` (the
    float64 step) and whether dropin's stay within the limit (for each parameter and the output: the dtype's
    backward tolerance or 2x PyTorch's own error there, whichever is larger). Returns whether they do."""
    from dropin._tolerance import limit
    from dropin.bench import models

    theirs = models.step_errors(models.train_step(original, original, inputs, grad), reference)
    ours = models.step_errors(models.train_step(model, model, inputs, grad), reference)
    bound = {k: limit(grad.dtype, theirs[k], backward=True) for k in ours}
    worst = max(ours, key=lambda k: ours[k] / bound[k])
    within = ours[worst] <= bound[worst]
    print(f"train step (loss: cross-entropy against fixed labels), errors against the original in float64 "
          f"(gradients relative to at least {models.GRAD_FLOOR:g} x the largest gradient's norm): output "
          f"{ours['output']:.2e} (PyTorch {theirs['output']:.2e}); {len(ours) - 1} parameter gradients, worst "
          f"against its limit: {worst} {ours[worst]:.2e} (PyTorch {theirs[worst]:.2e}, limit "
          f"{bound[worst]:.2e}): {'within' if within else 'BEYOND'} the limit")
    return within


def _run_again(args, extra: list, check: bool = True, bench: bool = True) -> dict | None:
    """The result JSON of this command run again in a process of its own, without the flags that only the first
    process acts on (--json, --csv, --processes, --curve, --plot, --update; --bench too where not `bench`) and with
    `extra`; None where it wrote none (check: a failing exit status raises)."""
    import json
    import subprocess
    import tempfile

    own = ("--json", "--csv", "--processes", "--curve", "--plot")  # (flags with a value)
    argv = [a for i, a in enumerate(args.argv) if a not in own and (i == 0 or args.argv[i - 1] not in own)
            and a != "--update" and (bench or a != "--bench")]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/rows.json"
        done = subprocess.run([sys.executable, "-m", "dropin.cli", *argv, *extra, "--json", path],
                              stdout=subprocess.PIPE, text=True)
        if check and done.returncode:
            tail = "\n".join(done.stdout.splitlines()[-20:])
            print(f"dropin inject: the process run again exited with {done.returncode}; its output ended:\n{tail}",
                  file=sys.stderr)
            done.check_returncode()
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None


def _bench_process(args, providers, number: int) -> list[dict]:
    """The bench rows of the host-bound ones among `providers` (`models.HOST_BOUND`: eager) of this command run
    again in a process of its own, the number-th of args.processes (the host's speed varies from process to
    process: eager figures are medians over processes)."""
    from dropin.bench.models import HOST_BOUND

    print(f"dropin inject: bench process {number} of {args.processes}", file=sys.stderr)
    providers = ",".join(p for p in HOST_BOUND if p in providers)
    return _run_again(args, ["--providers", providers, "--timing-only"])["rows"]


def _rerun_after_fault(args, rows: list[dict]) -> tuple[list[dict], dict]:
    """After a row's device error (`models.device_fault`), which leaves this process's CUDA context unusable: the
    rows it could not run (note `models.NOT_RUN`) and, with --curve, the loss curves run again in a fresh process.
    Returns (rows, that process's result: its curve or curve_error; {} where nothing was left to run)."""
    from dropin.bench import models

    pending = [r["provider"] for r in rows if r.get("note") == models.NOT_RUN]
    if not pending and not args.curve:
        return rows, {}
    left = pending + ["the loss curves"] * bool(args.curve)
    print(f"dropin inject: a device error left this process unusable; {', '.join(left)} run again in a fresh "
          f"process", file=sys.stderr)
    extra = ["--providers", ",".join(pending)] if pending else []
    result = _run_again(args, extra + (["--curve", str(args.curve)] if args.curve else []), check=False,
                        bench=bool(pending)) or {}
    fresh = {r["provider"]: r for r in result.get("rows", [])}
    lost = "its fresh process (after an earlier row's device error) wrote no row"
    rows = [r if r.get("note") != models.NOT_RUN else
            fresh.get(r["provider"]) or dict({k: v for k, v in r.items() if k != "note"}, error=lost)
            for r in rows]
    return models.with_speedups(rows), result


def _show_progress(quiet: bool, always: bool) -> None:
    """The progress lines of inject_'s stages and the bench's rows ('dropin.progress', INFO) on stderr where it is
    a terminal, or always, unless quiet."""
    import logging

    logger = logging.getLogger("dropin.progress")
    if quiet or not (always or sys.stderr.isatty()) or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dropin: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _earlier_result(args) -> dict | None:
    """With --update: the --json file's result as this run found it (None: no --update, or no file yet)."""
    if not (args.update and args.json and os.path.exists(args.json)):
        return None
    import json

    with open(args.json) as f:
        return json.load(f)


def _update_problem(args) -> str | None:
    """Why --update cannot merge this run into its --json file (None: it can, or the file is new)."""
    if not args.json:
        return "--update merges into the --json file: add --json FILE"
    rows = (_earlier_result(args) or {}).get("rows", [])
    ours = (args.model, "train" if args.train else "inference", args.dtype, args.batch)
    theirs = {(r["model"], r["mode"], r["dtype"], r["batch"]) for r in rows}
    if theirs - {ours}:
        found = ", ".join("/".join(map(str, t)) for t in sorted(theirs, key=str))
        return f"--update: {args.json} holds rows of {found}, not of {'/'.join(map(str, ours))}"
    return None


def _merged_into(earlier: dict | None, result: dict) -> dict:
    """result, or (--update) merged into `earlier`, the --json file as this run found it: this run's providers
    replace its rows, the others stay (in PROVIDERS' order, speed-ups from the merged rows), this run's loss curve
    replaces its curve (which stays where this run has none), env's "parts" lists each run's command and date: a
    bench measured in parts, one call each."""
    if earlier is None:
        return result
    from dropin.bench import harness, models

    both = harness.merged(earlier, result, key="provider")
    order = {p: i for i, p in enumerate(models.PROVIDERS)}
    both["rows"] = models.with_speedups(sorted(both["rows"], key=lambda r: order[r["provider"]]))
    curves = result if "curve" in result or "curve_error" in result else earlier
    both.update({k: curves[k] for k in ("curve", "curve_error") if k in curves},
                **({"partial": result["partial"]} if "partial" in result else {}))
    return both


def _write_partial(args, env: dict, earlier: dict | None, rows: list, processes: int) -> None:
    """With --json: `rows`, merged over the first `processes` bench processes, written marked `partial` (the final
    write replaces them), so that a run cut short keeps what it measured."""
    if not args.json:
        return
    from dropin.bench import harness

    left = [f"{args.processes - processes} of {args.processes} bench processes"] * (processes < args.processes) + \
        ["the loss curves"] * bool(args.curve)
    harness.write_json(args.json, _merged_into(earlier, {
        "env": env, "rows": rows, "partial": f"not run (the command did not finish): {' and '.join(left)}"}))
    print(f"dropin inject: wrote {args.json} (partial)", file=sys.stderr)


def _inject(args) -> int:
    import copy

    import torch

    from dropin import _runtime
    from dropin._tolerance import limit
    from dropin.inject import InjectConfig, VerificationError, inject_

    problem = _check_inject_args(args)
    if problem:
        print(f"dropin inject: {problem}", file=sys.stderr)
        return 2
    _show_progress(args.quiet, args.progress)
    if _runtime.INTERPRET:
        print("dropin inject: no GPU, kernels run under the Triton interpreter on the CPU (small sizes; "
              "torch.compile rows skipped)")
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    try:
        model = MODELS[args.model](args).train(args.train)
    except WeightsError as e:
        print(f"dropin inject: {e}", file=sys.stderr)
        return 2
    if args.prune:  # (before channels_last: torch's global pruning flattens the weights with view)
        _prune(model, args.prune, mlp_only=args.model == "llama")
    model = model.to(_runtime.KERNEL_DEVICE, getattr(torch, args.dtype), memory_format=memory_format)
    inputs = _inputs(args, model)
    original = copy.deepcopy(model) if args.train or args.bench else None
    try:
        report = inject_(model, InjectConfig(sparse=args.sparse), example_inputs=inputs, verify=args.verify,
                         coverage=args.verify and not args.bench)  # (--bench measures it on the step it times)
    except VerificationError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{_describe(args, model)}, {args.dtype}{', train mode' if args.train else ''}")
    print(report)
    if not (args.train or args.bench):
        return 0
    from dropin.bench import harness, models
    from dropin.bench.peers import liger_llama

    env = harness.environment("models", " ".join(["dropin", *args.argv]), {})
    earlier = _earlier_result(args)  # (read once: this run's partial writes merge into it too)
    rows, curve, rerun = [], None, None
    if args.generate:
        from dropin.bench import decode

        rows = decode.generate_rows(args.model, original, model, args.batches, args.seq, args.generate)
        print(decode.format_rows(rows))
    else:
        loss = _training_loss(original, inputs) if args.train else lambda m: m
        bare, original, model = original, loss(original), loss(model)
        grad = models.upstream_gradient(original, inputs) if args.train else None
        reference = models.float64_step(original, inputs, grad)  # one float64 copy for the check and the bench
        if args.train and not args.timing_only and not _train(original, model, inputs, grad, reference):
            return 1
        if not args.bench and not args.curve:
            return 0
    if args.bench and not args.generate:
        cover, measured = models.coverage(original, model, inputs, report, grad)
        peers = {"liger": lambda: loss(liger_llama(bare, loss=args.train))} if args.model == "llama" else {}
        rows = models.bench_rows(args.model, original, model, inputs, grad=grad, reference=reference,
                                 dtype=args.dtype, batch=args.batch, cover=cover, warmup_ms=args.warmup,
                                 rep_ms=args.rep, providers=args.providers, peers=peers)
        print(measured)
        rows, rerun = _rerun_after_fault(args, rows) if any(models.device_fault(r.get("error")) for r in rows) \
            else (rows, None)
        if args.processes > 1:
            print(models.format_rows(rows))  # (process 1's: a run cut short keeps them)
            runs = [rows]
            for number in range(2, args.processes + 1):
                _write_partial(args, env, earlier, models.merge_processes(runs), len(runs))
                runs.append(_bench_process(args, [r["provider"] for r in rows], number))
            rows = models.merge_processes(runs)
            print(f"medians of {args.processes} processes (each row: process_median_ms, spread_ms)")
        print(models.format_rows(rows))
        original_err = rows[0]["rel_err_vs_fp64"] or 0.0
        print(models.recommendation(rows, limit(getattr(torch, args.dtype), original_err, backward=args.train)))
    curve_error = None
    if args.curve and rerun is not None:  # (trained in the fresh process)
        curve = rerun.get("curve")
        curve_error = rerun.get("curve_error") or (None if curve else "its fresh process (after an earlier row's "
                                                                       "device error) wrote no loss curve")
    elif args.curve:  # last: it trains both models
        if rows:
            _write_partial(args, env, earlier, rows, args.processes)
        try:
            curve = models.loss_curve(original, model, inputs, args.curve, args.lr)
        except Exception as e:  # noqa: BLE001  (the rows are written all the same: a fatal CUDA error of one row
            # poisons the process for what follows)
            curve_error = f"{type(e).__name__}: {e}"
    if curve_error:
        print(f"dropin inject: the loss curves failed: {curve_error}", file=sys.stderr)
    if curve:
        print(f"loss curves, {args.curve} AdamW steps on one batch (cross-entropy against fixed targets): original "
              f"{curve['original'][0]:.4f} -> {curve['original'][-1]:.4f}, dropin {curve['dropin'][0]:.4f} -> "
              f"{curve['dropin'][-1]:.4f}; largest relative difference {curve['max_rel_diff']:.2e} (limit "
              f"{curve['limit']:.0e}; the original's own from its float64 curve {curve['torch_max_rel_diff']:.2e}): "
              f"{'within' if curve['within'] else 'BEYOND'} the limit")
    result = {"env": env, "rows": rows, **({"curve": curve} if curve else {}),
              **({"curve_error": curve_error} if curve_error else {})}
    title = f"{args.model}, {args.dtype}: {args.curve} AdamW steps on one batch"
    for path in filter(None, (args.json and harness.write_json(args.json, _merged_into(earlier, result)),
                              args.csv and harness.write_csv(args.csv, rows),
                              args.plot and curve and models.plot_curve(args.plot, curve, title))):
        print(f"dropin inject: wrote {path}", file=sys.stderr)
    return 1 if curve_error or (curve and not curve["within"]) else 0


def _zoo(args) -> int:
    from dropin.bench import zoo

    return zoo.run(args)


def _sizes(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer or a comma-separated list of integers")


def _providers(text: str) -> tuple[str, ...]:
    """A comma-separated list of `dropin.bench.models.PROVIDERS`, in that order."""
    from dropin.bench.models import PROVIDERS

    names = text.split(",")
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"'{text}': providers are a comma-separated list of {', '.join(PROVIDERS)}")
    return tuple(p for p in PROVIDERS if p in names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropin", description="dropin: drop-in Triton kernels for PyTorch.")
    parser.add_argument("--version", action="version", version=f"dropin {dropin.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="GPU, versions, interpreter on/off").set_defaults(func=_info)
    bench = commands.add_parser(
        "bench", help="check and time a benchmark suite",
        description="Checks every provider against a float64 reference and times it; prints a table and "
                    "writes RESULTS_DIR/<gpu>/<suite>.json. Exit code 1 if any case FAILED. Under the Triton "
                    "interpreter (no GPU) only small cases run and timings are CPU timings.")
    suites = sorted({**SUITES, **RUNNERS})
    bench.add_argument("suite", choices=suites, help="one of: " + ", ".join(suites))
    bench.add_argument("--cases", metavar="SUBSTRING", help="only cases whose name contains SUBSTRING")
    bench.add_argument("--class", dest="shape_class", metavar="NAME", help="only the cases of one shape class "
                       "(matmul: llm, epilogue, few-rows, long-k, odd, tall-skinny, short-wide, batched-small, "
                       "decode; conv2d: seed, resnet50, cvt13, small-batch, depthwise, fused, backward, large-image, "
                       "kernels, dilated, strided, pointwise, layouts; the README says what each holds); default: "
                       "every class (matmul and conv2d take over 10 minutes on an H100 or H200 with tuning: measured "
                       "in parts with --update)")
    bench.add_argument("--quick", action="store_true", help="small cases only (always on without a GPU)")
    bench.add_argument("--results-dir", default="benchmarks/results", help="default: %(default)s")
    bench.add_argument("--no-save", action="store_true", help="do not write the result file")
    bench.add_argument("--providers", metavar="NAMES", help="only these providers, comma-separated (e.g. "
                       "dropin,torch: a re-measurement without torch.compile's compile times); with --no-save "
                       "(the result file holds every provider; --json writes this run's rows)")
    bench.add_argument("--update", action="store_true", help="merge into the result file: this run's cases "
                       "replace their rows there, the others are kept (a suite measured in parts: --class)")
    bench.add_argument("--json", metavar="PATH", help="also write the result JSON to PATH")
    bench.add_argument("--csv", metavar="PATH", help="also write the rows as CSV to PATH")
    bench.add_argument("--plot", action="store_true", help="write a PNG next to the result file")
    bench.add_argument("--warmup", type=float, default=25, help="warm-up time per provider, ms (GPU)")
    bench.add_argument("--rep", type=float, default=100, help="timed repetitions per provider, ms")
    bench.set_defaults(func=_bench)
    inject = commands.add_parser(
        "inject", help="put dropin kernels into a model and print the report",
        description="Builds the model (random weights unless --weights, eval mode unless --train), swaps in "
                    "dropin modules and prints what was replaced (with its kernel) and what stays torch (with the "
                    "reason). Exit code 1 if --verify finds a divergence or the --train step's errors exceed their "
                    "limit, 2 for bad arguments. Under the Triton interpreter (no GPU) the sizes are small and CvT-13 "
                    "is reduced.")
    inject.add_argument("model", choices=sorted(MODELS))
    inject.add_argument("--batch", type=_sizes, dest="batches", metavar="BATCH",
                        help="default: 1, or 2 for llama (seed 002); with --generate a list, e.g. 1,8")
    inject.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    inject.add_argument("--channels-last", action="store_true", help="model and input in channels_last")
    inject.add_argument("--verify", action="store_true", help="compare with the original model on a random batch")
    inject.add_argument("--image-size", type=int, help="default: 224, or 32 under the interpreter")
    inject.add_argument("--weights", metavar="PATH", help="a torchvision state_dict file (resnet*), or a "
                        "save_pretrained directory (cvt-13, llama); default: random weights")
    inject.add_argument("--train", action="store_true", help="training mode; one step (forward, cross-entropy "
                        "loss against fixed labels, backward) on the original and the injected model, the loss and "
                        "gradients compared (llama: LlamaForCausalLM with its own loss)")
    inject.add_argument("--bench", action="store_true", help="time original / injected, eager / torch.compile "
                        "(inference, or with --train the training step and a fused AdamW step) with errors, peak "
                        "memory and coverage; llama: Liger-Kernel's too where it is installed")
    inject.add_argument("--prune", type=float, metavar="FRACTION", help="first zero this fraction of the weights of "
                        "the model's Conv2d and Linear layers (llama: its MLPs' projections), smallest magnitudes "
                        "model-wide (torch.nn.utils.prune.global_unstructured, made permanent)")
    inject.add_argument("--sparse", type=float, metavar="THRESHOLD", help="InjectConfig(sparse=THRESHOLD): layers "
                        "with at least this fraction of zeros run the sparse kernels")
    inject.add_argument("--json", metavar="PATH", help="with --bench: write the rows as JSON")
    inject.add_argument("--csv", metavar="PATH", help="with --bench: write the rows as CSV")
    inject.add_argument("--warmup", type=float, default=25, help="with --bench: warm-up time, ms (GPU)")
    inject.add_argument("--rep", type=float, default=100, help="with --bench: timed repetitions, ms")
    inject.add_argument("--curve", type=int, metavar="STEPS", help="with --train: train the original and the "
                        "injected model STEPS steps on one batch (AdamW) and compare their losses at every step")
    inject.add_argument("--lr", type=float, default=1e-5, help="with --curve: AdamW's learning rate (default "
                        "%(default)s: at 1e-4 a Llama of 7B-shaped layers learns the one batch by heart in 3 steps, "
                        "its loss down to 3e-4, where bf16's own rounding moves torch's curve 75%% off float64's)")
    inject.add_argument("--plot", metavar="PNG", help="with --curve: draw the loss curves and their relative "
                        "differences into this file (matplotlib)")
    inject.add_argument("--generate", type=int, metavar="NEW_TOKENS",
                        help="llama with --bench: time HF generate() instead (LlamaForCausalLM, static KV cache, "
                             "greedy, prompts of --seq random tokens, NEW_TOKENS new tokens, each --batch size): "
                             "tokens/s of original and injected, eager and reduce-overhead")
    inject.add_argument("--quiet", action="store_true", help="no progress lines on stderr (shown only where "
                        "stderr is a terminal, unless --progress)")
    inject.add_argument("--progress", action="store_true", help="progress lines on stderr (inject_'s stages, each "
                        "bench row's wall time) even where it is no terminal, e.g. a log file")
    inject.add_argument("--providers", type=_providers, metavar="LIST",
                        help="with --bench: time only these providers, comma-separated, e.g. original,dropin "
                             "(default: all eight, and liger for llama)")
    inject.add_argument("--update", action="store_true", help="with --json: merge into that file (same model, "
                        "mode, dtype and batch): this run's providers and loss curve replace the file's, the others "
                        "stay; a bench measured in parts, one call each (env.parts lists them)")
    # (the bench processes after the first: the first checked the training step)
    inject.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    inject.add_argument("--processes", type=int, default=1, help="with --bench: run it in this many processes "
                        "and give the median of their medians, with the spread (default: %(default)s)")
    llama = inject.add_argument_group("llama", "sizes; default: seed 002's config on a GPU (1 layer, hidden 1024, 4 "
                                      "heads, intermediate 11008, vocab 32000, seq 1024, batch 2), 1 layer, hidden 64, "
                                      "2 heads, intermediate 128, vocab 512, seq 8 under the interpreter; --kv-heads "
                                      "defaults to --heads; SDPA attention (the seed's eager path stays torch), no "
                                      "attention mask")
    for flag in LLAMA:
        if flag != "batch":
            llama.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag)
    inject.set_defaults(func=_inject)
    zoo = commands.add_parser(
        "zoo", help="inject, verify and time every model of the zoo: one row per model and dtype",
        description="For each model (every torchvision classifier, one variant of each common timm family, HF "
                    "models built from their configs; random weights): builds it in a process of its own, injects, "
                    "verifies against float64, measures coverage and times original and injected in eager and "
                    "every mode of `dropin inject --bench`; writes one row per (model, dtype) to "
                    "RESULTS_DIR/<gpu>/zoo.json after each model. A run resumes: models with a row for the same "
                    "versions are skipped (--rerun runs them again). Images: batch 8, 224x224 (or the model's "
                    "size); text: 2x512 tokens. Without a GPU --tiny is on and speed is not measured.")
    zoo.add_argument("--models", nargs="+", metavar="NAME", help="names or glob patterns (torchvision/resnet*, "
                     "hf/*, resnet50), or MODULE:FUNCTION for a model of one's own (FUNCTION(tiny) returns (model, "
                     "inputs)); default: the whole zoo")
    zoo.add_argument("--list", action="store_true", help="print the (model, dtype) rows a run would make, and stop")
    zoo.add_argument("--dtype", choices=sorted(ZOO_DTYPES), default="both",
                     help="both: bfloat16 for every model, float32 for image models too (default); float32: every "
                     "model in float32 (the interpreter's bfloat16 is not reliable)")
    zoo.add_argument("--tiny", action="store_true", help="tiny inputs and configs (always on without a GPU); "
                     "rows go to zoo-tiny.json")
    zoo.add_argument("--no-speed", action="store_true", help="inject, verify and measure coverage, time nothing")
    zoo.add_argument("--time-limit", type=float, default=600, metavar="SECONDS",
                     help="per model and dtype; its row says when it ran out (default: %(default)s)")
    zoo.add_argument("--budget", type=float, metavar="SECONDS", help="stop starting models after this long (a "
                     "model cut short by it gets no row: it runs again next time)")
    zoo.add_argument("--rerun", action="store_true", help="run the chosen models again (their rows replaced)")
    zoo.add_argument("--shard", metavar="I/N", help="the I-th of N equal shares (from 0) of the chosen models that have "
                     "no row (all with --rerun): N runs side by side, one a GPU, into one file")
    zoo.add_argument("--results-dir", default="benchmarks/results", help="default: %(default)s")
    zoo.add_argument("--file", metavar="PATH", help="the result file (default: RESULTS_DIR/<gpu>/zoo.json)")
    zoo.add_argument("--table", action="store_true", help="print the markdown zoo table and its summary against "
                     "the zoo's targets from the result file (also written beside it, .md), run nothing")
    zoo.add_argument("--warmup", type=float, default=25, help="warm-up time per mode, ms (default: %(default)s)")
    zoo.add_argument("--rep", type=float, default=100, help="timed repetitions per mode, ms (default: %(default)s)")
    zoo.set_defaults(func=_zoo)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
