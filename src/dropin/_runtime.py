"""Device, architecture and version facts; the one place that branches on the Triton version.

Importing this module switches Triton's interpreter on (TRITON_INTERPRET=1) when no CUDA device is
present, so that every kernel runs on the CPU. It must therefore be imported before any kernel is defined (triton
itself may have been imported before: its own jit functions are then made interpreted ones).
"""
import copy
import functools
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the interpreter switch)
from triton.runtime.jit import JITFunction  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false")


def _interpret_triton_language() -> None:
    """Makes the @triton.jit functions of triton.language (tl.cdiv, tl.sigmoid, tl.rand, ...) interpreted ones.

    @triton.jit picks the interpreter when it decorates: where triton was imported before the switch above (by
    torchvision, or by the user), triton.language's own functions are compiled-only ones, which an interpreted kernel
    cannot call. Each is replaced in its module's namespace, which is also the globals the others call it through."""
    from triton.runtime.interpreter import InterpretedFunction

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))


if INTERPRET:
    _interpret_triton_language()
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
# Triton versions whose CompiledKernel.run(grid..., stream, function, metadata, hooks, *args) signature
# ops/_dispatch.Launch calls directly (as read in 3.6 on the GPU and 3.8 in source); others take the ordinary
# `kernel[grid](...)` path every call.
DIRECT_LAUNCH = (3, 6) <= TRITON_VERSION <= (3, 8)


def raw_launcher(compiled, grid: tuple):
    """A call (stream, launch_metadata, enter_hook, exit_hook, *args) of compiled's C launcher on `grid`, skipping
    the Python wrapper of CompiledKernel.run (its closures and scratch look-ups: ~3 us a launch): global scratch
    (kernels that build tensor descriptors on the device) allocated here, from torch's caching allocator, freed after
    the launch in stream order. Triton 3.6 only (its launcher's argument order, read on the GPU); None elsewhere,
    and for kernels that take profiling scratch (instrumented builds)."""
    launcher = compiled.run
    launch = getattr(launcher, "launch", None)
    if TRITON_VERSION != (3, 6) or INTERPRET or launch is None or launcher.profile_scratch_size > 0:
        return None
    gx, gy, gz = grid
    scratch = gx * gy * gz * launcher.num_ctas * launcher.global_scratch_size
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    function, packed, device = compiled.function, compiled.packed_metadata, torch.cuda.current_device()
    if scratch == 0:
        def run(stream, metadata, enter, leave, *args):
            launch(gx, gy, gz, stream, function, coop, pdl, None, None, packed, metadata, enter, leave, *args)
        return run

    def run_with_scratch(stream, metadata, enter, leave, *args):
        buffer = torch.empty(scratch, dtype=torch.int8, device=device)
        launch(gx, gy, gz, stream, function, coop, pdl, buffer, None, packed, metadata, enter, leave, *args)
    return run_with_scratch


# Triton's AsyncCompileMode (3.6 to 3.8): within it a kernel's compile goes to an executor and a warm-up returns at
# once; ops/_autotune compiles a tuning's candidates side by side through it. None elsewhere (compiled one by one).
try:
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:
    AsyncCompileMode = None
# The device a kernel runs on: CUDA tensors, or CPU tensors under the interpreter.
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda"


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code: triton's (a constexpr_function since 3.6) costs ~1.6 us of CPU time a call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (0 for n <= 0, as triton's), at a plain function's cost. For a symbolic
    size (torch.compile, dynamic shapes) the power of two of the traced value, guarded: another value outside
    (p / 2, p] recompiles."""
    if type(n) is not int:
        p = next_power_of_2(size_hint(n))
        if not (p // 2 < n <= p):  # comparisons of a symbolic size install the guard
            raise AssertionError(f"next_power_of_2: {n} outside ({p // 2}, {p}]")
        return p
    return 1 << (n - 1).bit_length() if n > 0 else 0


def size_hint(n) -> int:
    """n as an int: a symbolic size (torch.compile with dynamic shapes) gives the value it was traced with, without
    a guard. For choices that only tune (a tile size), never for ones a result depends on."""
    if type(n) is int:
        return n
    shapes = torch.fx.experimental.symbolic_shapes
    # torch 2.11 names it hint_int; later versions optimization_hint
    return (shapes.optimization_hint if hasattr(shapes, "optimization_hint") else shapes.hint_int)(n)


# torch's analysis of the tensors a wrap_triton launch reads and writes, by the names torch versions give it
_LAUNCH_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_LAUNCH_ANALYSIS_MEMO = 4096  # entries kept at most


def memoize_launch_analysis() -> None:
    """Makes torch.compile generate each dropin kernel's TTIR once per specialization when it finds what a
    wrap_triton launch writes: torch's analysis regenerates the TTIR for every launch, up to four times a launch in
    one compile (functionalization, Inductor's lowering and graph passes), 9.7 s a pass for ConvNeXt-tiny's 86
    launches on a 2-core CPU (a depthwise 7x7 launch 384 ms). Its result depends on the kernel, the tensors' dtypes
    (torch compiles against `torch.empty(2, dtype)` stand-ins and 2 for each symbolic value), the constexprs' and
    other arguments' values, and of an integer that is no constexpr only what Triton specializes it on: those key
    the memo (`_argument_key`), which returns a copy (its callers may change the result). Other kernels than
    dropin's go straight to torch's; without the analysis (another torch) nothing changes."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:
        return
    for name in _LAUNCH_ANALYSES:
        analysis = getattr(wrap, name, None)
        if analysis is None or hasattr(analysis, "__wrapped__"):
            continue
        memo = _memoized(analysis)
        # (a module that imported the function by name, Inductor's, holds it too)
        for module in (wrap, sys.modules.get("torch._inductor.ir"), sys.modules.get("torch._inductor.graph")):
            if getattr(module, name, None) is analysis:
                setattr(module, name, memo)


def _memoized(analysis):
    """analysis memoized; `memo.cache_info()`: its hits, misses and entries."""
    cache, counts = {}, {"hits": 0, "misses": 0}

    @functools.wraps(analysis)
    def memo(kernel, kwargs, *rest):
        fn = kernel
        while hasattr(fn, "fn"):  # (an Autotuner holds its JITFunction, which holds the Python function)
            fn = fn.fn
        if not getattr(fn, "__module__", "").startswith("dropin."):
            return analysis(kernel, kwargs, *rest)
        # torch.compile wraps a launch given num_warps or num_stages in an Autotuner of its own, one per launch
        # site, and analyses its JITFunction with the first config's arguments: the key is those
        jit, arguments = kernel, dict(kwargs)
        if isinstance(kernel, triton.runtime.Autotuner):
            jit = kernel.fn
            arguments.update(kernel.configs[0].kwargs if kernel.configs else {})
        constexpr = {p.name: p.is_constexpr for p in getattr(jit, "params", ())}
        try:
            key = (jit, tuple(sorted((name, _argument_key(v, constexpr.get(name, True)))
                                     for name, v in arguments.items())), repr(rest))
            result = cache.get(key)
        except Exception:  # noqa: BLE001 (an argument that cannot key: torch's own analysis decides)
            return analysis(kernel, kwargs, *rest)
        counts["hits" if result is not None else "misses"] += 1
        if result is None:
            if len(cache) >= _LAUNCH_ANALYSIS_MEMO:
                cache.clear()
            result = cache[key] = analysis(kernel, kwargs, *rest)
        try:
            return copy.deepcopy(result)
        except Exception:  # noqa: BLE001 (a result that does not copy: torch's own analysis again)
            return analysis(kernel, kwargs, *rest)
    memo.cache_info = lambda: dict(counts, entries=len(cache))
    return memo


def _argument_key(value, constexpr: bool = True):
    """What torch's TTIR generation reads of one launch argument: a tensor's dtype (a FakeTensor or Inductor's
    TensorBox alike), nothing of a symbolic value, of an integer that is no constexpr what Triton specializes it on
    (its type, i32, i64 or u64 by its range; divisibility by 16; 1), the value of anything else. (ConvNeXt-tiny's
    TTIRs a compile: 27 -> 20; of its four depthwise 7x7 ones, 0.2-0.4 s each on a 2-core CPU, two.)"""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(value).__module__.startswith("sympy"):
        return ("symbolic",)
    ir = sys.modules.get("torch._inductor.ir")
    if isinstance(value, torch.Tensor) or ir is not None and isinstance(value, ir.IRNode):
        return ("tensor", str(value.dtype))
    if type(value) is int and not constexpr:
        return ("integer", -2**31 <= value < 2**31, -2**63 <= value < 2**63, value % 16 == 0, value == 1)
    return ("value", type(value).__name__, value)


_KERNEL_SOURCE = "user_defined_triton_kernel_transitive_closure_source_code"  # Inductor's, in codegen/wrapper.py
_ABSENT = object()  # (a global name that a scope does not hold)


@functools.lru_cache(maxsize=None)
def memoize_kernel_source() -> None:
    """Makes Inductor collect each dropin kernel's source code (with the Triton functions and constants it uses)
    once: torch collects it anew for every op and launch whose graph it hashes (the AOT autograd and FX graph caches'
    keys: each op's call for every kernel the op may launch) and for each kernel it generates code for, 195 times
    (2.8 s under cProfile) in hf/convnext's first compile on the H200 host. Its result depends on the kernel's
    source and the values of the global names that it and the Triton functions it calls read: a kept result is
    returned while each of those is the same object (`_source_reads`), else torch collects it again. Other kernels
    than dropin's, and a fused epilogue's source, go straight to torch's; without the function (another torch)
    nothing changes. Installed once, at the first traced launch, not with the ops: it imports Inductor's wrapper
    module (0.16 s on a 2-core CPU)."""
    try:
        from torch._inductor.codegen import wrapper
    except ImportError:
        return
    source = getattr(wrapper, _KERNEL_SOURCE, None)
    if source is not None and not hasattr(source, "__wrapped__"):
        setattr(wrapper, _KERNEL_SOURCE, _memoized_source(source))


def _memoized_source(source):
    """source memoized per kernel; `memo.cache_info()`: its hits, misses and entries."""
    cache, counts = {}, {"hits": 0, "misses": 0}

    @functools.wraps(source)
    def memo(kernel, *rest, **kwargs):
        if not (isinstance(kernel, JITFunction) and kernel.__module__.startswith("dropin.")) or any(rest) \
                or any(kwargs.values()):
            return source(kernel, *rest, **kwargs)
        found = cache.get(kernel)
        if found is not None and all((scope.get(name, _ABSENT) if type(scope) is dict
                                      else getattr(scope, name, _ABSENT)) is value for scope, name, value in found[1]):
            counts["hits"] += 1
            return found[0]
        counts["misses"] += 1
        reads = _source_reads(kernel)  # (before torch reads them: a change in between misses next time)
        result = source(kernel)
        cache[kernel] = result, reads
        return result
    memo.cache_info = lambda: dict(counts, entries=len(cache))
    return memo


def _source_reads(kernel) -> list:
    """What Inductor's collection of kernel's source reads, as (scope, name, value): for the kernel and every Triton
    function it reaches through its globals, its source, name and code, and each global name its code names (its
    value, or _ABSENT) with that name's annotation, and the global `dtype` (which torch reads for a
    constexpr_function's annotations). A scope is a dict (read by key) or an object (by attribute)."""
    functions = (JITFunction, getattr(triton.runtime.jit, "ConstexprFunction", JITFunction))
    reads, seen, todo = [], set(), [kernel]
    while todo:
        jit = todo.pop()
        if id(jit) in seen:
            continue
        seen.add(id(jit))
        fn, scope = jit.fn, jit.fn.__globals__
        annotations = scope.get("__annotations__", {})
        reads += [(jit, "src", jit.src), (jit, "__name__", jit.__name__), (fn, "__code__", fn.__code__),
                  (scope, "__annotations__", scope.get("__annotations__", _ABSENT)),
                  (scope, "dtype", scope.get("dtype", _ABSENT))]
        for name in fn.__code__.co_names:
            value = scope.get(name, _ABSENT)
            reads += [(scope, name, value), (annotations, name, annotations.get(name, _ABSENT))]
            if isinstance(value, functions):
                todo.append(value)
    return reads


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (where a device sync, e.g. timing, is not
    allowed); False without CUDA. (HAS_CUDA, not torch.cuda.is_available(): that reads the environment on every
    call, ~10 us, and plans ask this on every call of some ops.)"""
    return not INTERPRET and HAS_CUDA and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def is_hopper(device_index: int = 0) -> bool:
    """True on sm_90 (H100/H200), where TMA tensor descriptors and wgmma are available."""
    return not INTERPRET and torch.cuda.get_device_capability(device_index)[0] == 9


# torch >= 2.9's fp32_precision settings, read through their C getter (the properties' own: ~0.2 us against ~1 us a
# property), as (backend, op) from the op's own setting up: torch.backends.cuda.matmul, then torch.backends for
# matmuls; torch.backends.cudnn.conv, torch.backends.cudnn, torch.backends for convolutions
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)
_PRECISION_CHAINS = {"matmul": (("cuda", "matmul"), ("generic", "all")),
                     "conv": (("cuda", "conv"), ("cuda", "all"), ("generic", "all"))}


def tf32_allowed(op: str) -> bool:
    """Whether torch now lets a float32 `op` run in TF32 (or coarser): "matmul" by cuBLAS's rule, "conv" by cuDNN's.
    Torch >= 2.9 answers through its fp32_precision settings, the op's own first ("none" inherits: the backend's,
    then torch.backends'); the legacy flags (allow_tf32, set_float32_matmul_precision) set those too, and reading
    a legacy flag after the new settings were used raises in torch, so the legacy flags are read only where the
    settings are absent."""
    chain = _PRECISION_CHAINS.get(op)
    if chain is None:
        raise ValueError(f"tf32_allowed: op must be 'matmul' or 'conv', got {op!r}")
    if _FP32_PRECISION is None:
        return (torch.backends.cuda.matmul if op == "matmul" else torch.backends.cudnn).allow_tf32
    for backend, name in chain:
        value = _FP32_PRECISION(backend, name)
        if value != "none":
            return value in ("tf32", "bf16")
    return False


@functools.lru_cache(maxsize=None)
def gpu_name() -> str:
    return torch.cuda.get_device_name() if HAS_CUDA else "cpu (Triton interpreter)"


def gpu_slug() -> str:
    """Short name for result folders: 'h100', 'h200', or 'cpu'."""
    name = gpu_name().lower()
    for slug in ("h200", "h100", "a100", "l40s", "l4"):
        if slug in name:
            return slug
    return "cpu" if not HAS_CUDA else name.replace("nvidia", "").strip().replace(" ", "-")


def check_kernel_device(op: str, **tensors: torch.Tensor) -> torch.device:
    """Checks that every tensor is on one device that the kernels can run on; returns it.

    Raises RuntimeError (torch's type for device mismatches) naming the offending argument.
    """
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: argument '{name}' must be a Tensor, got {type(t).__name__}")
        if t.device.type != KERNEL_DEVICE:
            where = "the Triton interpreter is on" if INTERPRET else "the Triton interpreter is off"
            raise RuntimeError(
                f"{op}: argument '{name}' is on {t.device}, but {where}: "
                f"dropin kernels need {KERNEL_DEVICE} tensors here")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise RuntimeError(
                f"{op}: expected all tensors on the same device, but '{first}' is on {device} "
                f"and '{name}' is on {t.device}")
    return device


def info() -> dict:
    """Facts printed by `dropin info` and stored in every result file."""
    import dropin
    return {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dropin": dropin.__version__,
        "interpreter": INTERPRET,
        "cuda": torch.version.cuda,
    }
