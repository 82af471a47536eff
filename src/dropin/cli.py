"""Command line: `dropin info`, `dropin bench SUITE [options]`, `dropin inject MODEL [options]`."""
import argparse
import importlib
import sys

from dropin import _runtime

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
}


def _torchvision(name: str):
    import torchvision

    return getattr(torchvision.models, name)()  # random weights


# Model name -> a function that builds it (torch, random weights).
MODELS = {"resnet18": lambda: _torchvision("resnet18"), "resnet50": lambda: _torchvision("resnet50")}


def load_suite(name: str):
    """The case-building function of a registered suite."""
    module, function = SUITES[name].split(":")
    return getattr(importlib.import_module(module), function)


def _info(args) -> int:
    for key, value in _runtime.info().items():
        print(f"{key}: {value}")
    return 0


def _bench(args) -> int:
    from dropin.bench import harness

    cases = load_suite(args.suite)(quick=args.quick or _runtime.INTERPRET)
    cases = [c for c in cases if args.cases is None or args.cases in c.name]
    if not cases:
        print(f"dropin bench: no case of suite '{args.suite}' matches --cases {args.cases!r}", file=sys.stderr)
        return 2
    result = harness.run_suite(
        args.suite, cases, results_dir=args.results_dir, save=not args.no_save, json_path=args.json,
        csv_path=args.csv, plot=args.plot, command=" ".join(["dropin", *args.argv]),
        warmup_ms=args.warmup, rep_ms=args.rep)
    return 1 if harness.failed_cases(result["rows"]) else 0


def _inject(args) -> int:
    import torch

    from dropin.inject import VerificationError, inject_

    size = args.image_size or (32 if _runtime.INTERPRET else 224)
    if _runtime.INTERPRET:
        print(f"dropin inject: no GPU, kernels run under the Triton interpreter on the CPU ({size}x{size} images)")
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    dtype = getattr(torch, args.dtype)
    model = MODELS[args.model]().eval().to(_runtime.KERNEL_DEVICE, dtype, memory_format=memory_format)
    x = torch.randn(args.batch, 3, size, size, device=_runtime.KERNEL_DEVICE, dtype=dtype)
    try:
        report = inject_(model, example_inputs=x.to(memory_format=memory_format), verify=args.verify)
    except VerificationError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.model}, batch {args.batch}, {args.dtype}{', channels_last' if args.channels_last else ''}")
    print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropin", description="dropin: drop-in Triton kernels for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="GPU, versions, interpreter on/off").set_defaults(func=_info)
    bench = commands.add_parser(
        "bench", help="check and time a benchmark suite",
        description="Checks every provider against a float64 reference and times it; prints a table and "
                    "writes RESULTS_DIR/<gpu>/<suite>.json. Exit code 1 if any case FAILED. Under the Triton "
                    "interpreter (no GPU) only small cases run and timings are CPU timings.")
    bench.add_argument("suite", choices=sorted(SUITES), help="one of: " + ", ".join(sorted(SUITES)))
    bench.add_argument("--cases", metavar="SUBSTRING", help="only cases whose name contains SUBSTRING")
    bench.add_argument("--quick", action="store_true", help="small cases only (always on without a GPU)")
    bench.add_argument("--results-dir", default="benchmarks/results", help="default: %(default)s")
    bench.add_argument("--no-save", action="store_true", help="do not write the result file")
    bench.add_argument("--json", metavar="PATH", help="also write the result JSON to PATH")
    bench.add_argument("--csv", metavar="PATH", help="also write the rows as CSV to PATH")
    bench.add_argument("--plot", action="store_true", help="write a PNG next to the result file")
    bench.add_argument("--warmup", type=float, default=25, help="warm-up time per provider, ms (GPU)")
    bench.add_argument("--rep", type=float, default=100, help="timed repetitions per provider, ms")
    bench.set_defaults(func=_bench)
    inject = commands.add_parser(
        "inject", help="put dropin kernels into a model and print the report",
        description="Builds the model (random weights, eval mode), swaps in dropin modules and prints what was "
                    "replaced (with its kernel) and what stays torch (with the reason). Exit code 1 if "
                    "--verify finds a divergence. Under the Triton interpreter (no GPU) images are small.")
    inject.add_argument("model", choices=sorted(MODELS))
    inject.add_argument("--batch", type=int, default=1, help="default: %(default)s")
    inject.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    inject.add_argument("--channels-last", action="store_true", help="model and input in channels_last")
    inject.add_argument("--verify", action="store_true", help="compare with the original model on a random batch")
    inject.add_argument("--image-size", type=int, help="default: 224, or 32 under the interpreter")
    inject.set_defaults(func=_inject)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
