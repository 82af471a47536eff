"""Probe (GPU): where torch.compile's first call of a zoo model goes, original beside injected. The zoo's compile_s
(the first compiled call, default mode) is 5x the original's on hf/convnext (77.9 s injected against 14.7, bf16,
batch 8, H200): a zoo row pays it twice (default and reduce-overhead) and a user once a process.
Known on the CPU (Triton's frontend for a pretend sm_90): torch reads each wrap_triton launch's TTIR to find the
tensors it writes (`identify_accessed_tensors`, in functionalization and again in Inductor's lowering), and
generating it takes 9.7 s for ConvNeXt-tiny's 86 launches (18 depthwise 7x7 launches at 384 ms each), 3.6 s for
ResNet-50's 57; dropin memoizes it per kernel specialization (`_runtime.memoize_launch_analysis`: 4 passes over
ConvNeXt's launches 40.7 -> 3.1 s on that CPU). What the rest is (Dynamo's tracing of dropin's Python, Inductor's
code generation, Triton's compiles of dropin's kernels, cudagraph trees' recording) this probe says.
Each (side, mode) runs in a process of its own with empty Inductor and Triton caches (temporary directories; --warm
keeps the ones of the run before): the model (the zoo's builder, bf16, eval, no_grad), for the injected side
`dropin.inject_` with the example inputs, one eager forward, then the first compiled call under cProfile. Printed:
its wall seconds; torch's own phase timers (`torch._dynamo.utils.compile_times`); the cumulative seconds and calls
of the functions named in PARTS; the top functions by cumulative time.
Usage: PYTHONPATH=src python3 benchmarks/probes/compile_time.py MODEL [MODEL ...] [--sides original dropin]
[--modes default reduce-overhead] [--top N] [--warm] [--no-memo]   (MODEL: a zoo name, e.g. hf/convnext
torchvision/resnet50; --no-memo: the injected side also without dropin's memo of torch's launch analysis)"""
import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

# (file, function) whose cumulative time is printed: Dynamo's tracing of a frame (all the rest nested inside),
# AOT autograd's capture, torch's TTIR analysis of a wrap_triton launch and its TTIR generation, Inductor's
# compile of a graph, its lowering, code generation and waits on its compile pool, Triton's compiles in this process
PARTS = (("_dynamo/convert_frame.py", "_compile"), ("_functorch/aot_autograd.py", "create_aot_dispatcher_function"),
         ("_higher_order_ops/triton_kernel_wrap.py", "identify_accessed_tensors"),
         ("_higher_order_ops/triton_kernel_wrap.py", "generate_ttir"), ("_inductor/compile_fx.py", "compile_fx_inner"),
         ("_inductor/graph.py", "run"), ("_inductor/graph.py", "codegen"), ("_inductor/async_compile.py", "wait"),
         ("triton/compiler/compiler.py", "compile"))


def one(model_name: str, side: str, mode: str, top: int, memo: bool) -> None:
    """Runs one (side, mode) in this process and prints its report (memo False: torch's launch analysis without
    dropin's memo, `_runtime.memoize_launch_analysis`)."""
    import torch

    import dropin
    import dropin.ops  # noqa: F401 (registers the ops, which installs the memo)
    from dropin import _runtime
    from dropin.bench import zoo_models
    from dropin.bench.models import main_output

    if not memo:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
        for name in _runtime._LAUNCH_ANALYSES:
            analysis = getattr(wrap, name, None)
            setattr(wrap, name, getattr(analysis, "__wrapped__", analysis))
    torch.manual_seed(0)
    model, inputs = zoo_models.entry(model_name).build(False)
    device = _runtime.KERNEL_DEVICE
    model = model.eval().to(device, torch.bfloat16)
    inputs = tuple(t.to(device, torch.bfloat16 if t.is_floating_point() else t.dtype) for t in inputs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        if side == "dropin":
            dropin.inject_(model, example_inputs=inputs, verify=False)
        main_output(model(*inputs))
        sync()
        compiled = torch.compile(model, mode=None if mode == "default" else mode)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        main_output(compiled(*inputs))
        sync()
        profiler.disable()
        wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    print(f"== {model_name} {side} {mode}{'' if memo else ' (no memo)'}: first compiled call {wall:.1f} s")
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    analysis = next((getattr(wrap, n) for n in _runtime._LAUNCH_ANALYSES if hasattr(wrap, n)), None)
    memo_info = getattr(analysis, "cache_info", None)
    if memo_info is not None:
        print(f"  launch-analysis memo: {memo_info()}")
    rows = list(stats.stats.items())
    for suffix, part in PARTS:
        for (path, line, name), stat in rows:
            if name == part and path.endswith(suffix):
                print(f"  {suffix + ':' + part:70s} {stat[3]:7.2f} s cumulative, {stat[1]:5d} calls")
    print(f"  top {top} by cumulative time:")
    for (path, line, name), stat in sorted(rows, key=lambda r: -r[1][3])[:top]:
        print(f"    {stat[3]:7.2f} s {stat[1]:6d} calls  {name} ({os.sep.join(path.split(os.sep)[-2:])}:{line})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--sides", nargs="+", default=["original", "dropin"], choices=["original", "dropin"])
    parser.add_argument("--modes", nargs="+", default=["default"], choices=["default", "reduce-overhead"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--warm", action="store_true", help="keep the Inductor and Triton caches between runs")
    parser.add_argument("--no-memo", action="store_true", help="also each run without dropin's memo of torch's "
                        "launch analysis (`_runtime.memoize_launch_analysis`)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a child process's task, JSON)
    args = parser.parse_args(argv)
    if args.one:
        task = json.loads(args.one)
        one(task["model"], task["side"], task["mode"], args.top, task["memo"])
        return 0
    with tempfile.TemporaryDirectory() as kept:
        for model_name in args.models:
            for mode in args.modes:
                for side, memo in [(side, memo) for side in args.sides
                                   for memo in ((True, False) if args.no_memo and side == "dropin" else (True,))]:
                    with tempfile.TemporaryDirectory() as fresh:
                        cache = kept if args.warm else fresh
                        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                               "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
                        task = json.dumps({"model": model_name, "side": side, "mode": mode, "memo": memo})
                        subprocess.run([sys.executable, __file__, model_name, "--one", task, "--top", str(args.top)],
                                       env=env, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
