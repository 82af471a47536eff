"""Command line: `dropin info`, `dropin bench SUITE [options]`."""
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
}


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
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
